package workload

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"unsafe"
)

func TestDeterministic(t *testing.T) {
	gens := map[string]func(seed uint64) (*Workload, error){
		"long-context": func(s uint64) (*Workload, error) { return LongContext(DefaultLongContext(5), 30, s) },
		"zipf": func(s uint64) (*Workload, error) {
			c := DefaultLongContext(5)
			c.Popularity = Zipf
			return LongContext(c, 30, s)
		},
		"sharegpt": func(s uint64) (*Workload, error) { return ShareGPT(ShareGPTConfig{Active: 4}, 30, s) },
		"agentic":  func(s uint64) (*Workload, error) { return Agentic(AgenticConfig{Agents: 2, Active: 3}, 30, s) },
	}
	for name, gen := range gens {
		a, err := gen(7)
		if err != nil {
			t.Fatal(name, err)
		}
		b, _ := gen(7)
		c, _ := gen(8)
		if !reflect.DeepEqual(a, b) {
			t.Errorf("%s: same seed, different requests", name)
		}
		if reflect.DeepEqual(a.Requests, c.Requests) {
			t.Errorf("%s: different seeds, same requests", name)
		}
		if len(a.Requests) != 30 {
			t.Errorf("%s: %d requests", name, len(a.Requests))
		}
	}
}

func TestLongContextShape(t *testing.T) {
	w, err := LongContext(DefaultLongContext(3), 50, 1)
	if err != nil {
		t.Fatal(err)
	}
	docs := map[string]bool{}
	for _, r := range w.Requests {
		c := r.Messages[0].Text()
		docs[c[:32000]] = true
		q := len(c) - 32000
		if q < 400 || q > 1200 {
			t.Errorf("question of %d chars, want 400–1200", q)
		}
		if r.MaxTokens < 100 || r.MaxTokens > 300 {
			t.Errorf("max_tokens %d", r.MaxTokens)
		}
	}
	if len(docs) != 3 {
		t.Errorf("%d distinct documents, want 3", len(docs))
	}
}

func TestHistoryGrows(t *testing.T) {
	w, _ := ShareGPT(ShareGPTConfig{Active: 1}, 3, 1)
	a, b := w.Requests[0].RoutingText(), w.Requests[1].RoutingText()
	if !strings.HasPrefix(b, a) || len(b) <= len(a) {
		t.Error("second turn does not extend the first")
	}
	w, _ = Agentic(AgenticConfig{Agents: 1, Active: 1}, 3, 1)
	a, b = w.Requests[0].RoutingText(), w.Requests[1].RoutingText()
	if !strings.HasPrefix(b, a) || len(b) <= len(a) {
		t.Error("second agent step does not extend the first")
	}
}

func TestParseMooncake(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 10, "input_length": 1000, "output_length": 7, "hash_ids": [0, 2]}
`
	recs, err := ParseMooncake(strings.NewReader(good), 0)
	if err != nil || len(recs) != 2 {
		t.Fatalf("%v %d", err, len(recs))
	}
	w := Mooncake(recs, 1)
	p0, p1 := w.Requests[0].Messages[0].Content, w.Requests[1].Messages[0].Content
	if len(p0) != 2400 || len(p1) != 4000 || p0[:2048] != p1[:2048] || p0[2048:2400] == p1[2048:2400] {
		t.Error("hash ids do not map to shared 2,048-character blocks")
	}
	if w.Requests[1].At.Milliseconds() != 10 || w.Requests[1].MaxTokens != 7 {
		t.Error("timestamp or output length lost")
	}
	for _, tc := range []struct{ in, want string }{
		{good + "{\"timestamp\": 20, \"input_length\": 600\n", "line 3"},
		{good + `{"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [0]}`, "line 3"},
		{`{"timestamp": 5, "input_length": 6, "output_length": 5, "hash_ids": [0]}` + "\n" + `{"timestamp": 1, "input_length": 6, "output_length": 5, "hash_ids": [0]}`, "line 2"},
		{"\nnot json", "line 2"},
		{`{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}`, "line 1"},
	} {
		_, err := ParseMooncake(strings.NewReader(tc.in), 0)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: err %v, want %s", tc.in, err, tc.want)
		}
	}
}

func TestParseAzure(t *testing.T) {
	head := "TIMESTAMP,ContextTokens,GeneratedTokens\n"
	good := head + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
	recs, err := ParseAzure(strings.NewReader(good), 0)
	if err != nil || len(recs) != 2 {
		t.Fatalf("%v %d", err, len(recs))
	}
	w := Azure(recs, 1)
	if got := w.Requests[1].At.Milliseconds(); got != 4314 {
		t.Errorf("arrival %d ms, want 4314", got)
	}
	if len(w.Requests[0].Messages[0].Content) != 374*4 || w.Requests[1].MaxTokens != 109 {
		t.Error("lengths lost")
	}
	for _, tc := range []struct{ in, want string }{
		{"TIME,A,B\n", "line 1"},
		{good + "2023-11-16 18:15:51,12\n", "line 4"},
		{good + "yesterday,1,2\n", "line 4"},
		{good + "2023-11-16 18:15:52.0,x,2\n", "line 4"},
		{head + "2023-11-16 18:15:52.0,5,0\n", "line 2"},
		{good + "2023-11-16 18:15:40.0,5,5\n", "line 4"},
	} {
		_, err := ParseAzure(strings.NewReader(tc.in), 0)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: err %v, want %s", tc.in, err, tc.want)
		}
	}
}

func TestRealTracesParse(t *testing.T) {
	moon, err := LoadTrace("testdata/mooncake_conversation_head.jsonl", 300, ParseMooncake)
	if err != nil || len(moon) != 300 {
		t.Errorf("mooncake excerpt: %d records, %v", len(moon), err)
	}
	for _, p := range []string{"testdata/azure2023_code_head.csv", "testdata/azure2023_conv_head.csv"} {
		recs, err := LoadTrace(p, 300, ParseAzure)
		if err != nil || len(recs) != 300 {
			t.Errorf("%s: %d records, %v", p, len(recs), err)
		}
	}
}

// Long-context requests about one document hold it once, and send and
// route its whole text.
func TestLongContextSharesDocuments(t *testing.T) {
	w, err := LongContext(DefaultLongContext(2), 20, 1)
	if err != nil {
		t.Fatal(err)
	}
	held := map[string]*byte{} // a document's first 64 characters → its memory
	for i, r := range w.Requests {
		m := r.Messages[0]
		doc := m.Text()[:32000]
		if len(m.lead) != len(doc) {
			t.Errorf("request %d: a lead of %d characters, want its document's %d", i, len(m.lead), len(doc))
		}
		if p, ok := held[doc[:64]]; ok && p != unsafe.StringData(m.lead) {
			t.Errorf("request %d holds its own copy of the document", i)
		}
		held[doc[:64]] = unsafe.StringData(m.lead)
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		var got struct{ Role, Content string }
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatal(err)
		}
		if got.Role != "user" || got.Content != m.Text() {
			t.Errorf("request %d: JSON carries role %q and %d characters of content, want user and %d", i, got.Role, len(got.Content), len(m.Text()))
		}
		if want := "<|user|>\n" + m.Text() + "\n"; r.RoutingText() != want {
			t.Errorf("request %d: RoutingText is not the message's whole text", i)
		}
	}
	if len(held) != 2 {
		t.Errorf("%d documents, want 2", len(held))
	}
}
