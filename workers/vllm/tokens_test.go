package vllm

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
)

var tokenizeAnswers = []string{
	`{"count":3,"max_model_len":8192,"tokens":[1,22,333]}`,
	`{"tokens":[],"count":0}`,
	` { "count" : 2 , "tokens" : [ 7 , 4294967295 ] , "token_strs" : null } `,
	`{"count":2,"tokens":[7,8],"token_strs":["a","b"]}`,
	`{"count":2,"tokens":[7,4294967296]}`,
	`{"count":1,"tokens":[-1]}`,
	`{"count":1,"tokens":[1.5]}`,
	`{"count":1,"tokens":[01]}`,
	`{"count":1,"tokens":[1],"count":2}`,
	`{"count":1,"Tokens":[5],"tokens":[1]}`,
	`{"count":1,"tokens":null}`,
	`{"count":"1","tokens":[1]}`,
	`{"count":1,"tokens":[1],"note":"a \"quoted\" word"}`,
	`{"count":1,"tokens":[1]`,
	`{"count":1,"tokens":[1]} x`,
	`[]`,
	``,
}

// The scanner agrees with encoding/json on every answer: the same tokens
// where encoding/json decodes it, an error where it does not.
func TestParseTokenizeResponseAgreesWithJSON(t *testing.T) {
	long := make([]string, 8000)
	for i := range long {
		long[i] = fmt.Sprint(i * 37 % 128000)
	}
	answers := append(tokenizeAnswers, `{"count":8000,"tokens":[`+strings.Join(long, ",")+`]}`)
	for _, a := range answers {
		checkAgrees(t, []byte(a))
	}
	if _, err := scanTokenizeResponse([]byte(answers[len(answers)-1])); err != nil {
		t.Errorf("the common shape was left to encoding/json: %v", err)
	}
}

func checkAgrees(t *testing.T, b []byte) {
	t.Helper()
	var want tokenizeResponse
	werr := json.Unmarshal(b, &want)
	got, gerr := parseTokenizeResponse(b)
	switch {
	case (werr == nil) != (gerr == nil):
		t.Errorf("%q: error %v, encoding/json's %v", b, gerr, werr)
	case werr == nil && (got.Count != want.Count || !slices.Equal(got.Tokens, want.Tokens)):
		t.Errorf("%q: %d %v, encoding/json's %d %v", b, got.Count, got.Tokens, want.Count, want.Tokens)
	}
}

func FuzzParseTokenizeResponse(f *testing.F) {
	for _, a := range tokenizeAnswers {
		f.Add([]byte(a))
	}
	f.Fuzz(func(t *testing.T, b []byte) { checkAgrees(t, b) })
}

func BenchmarkParseTokenizeResponse(b *testing.B) {
	toks := make([]string, 8000)
	for i := range toks {
		toks[i] = fmt.Sprint(i * 37 % 128000)
	}
	body := []byte(`{"count":8000,"max_model_len":131072,"tokens":[` + strings.Join(toks, ",") + `],"token_strs":null}`)
	b.Run("scanner", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := parseTokenizeResponse(body); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("encoding-json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var r tokenizeResponse
			if err := json.Unmarshal(body, &r); err != nil {
				b.Fatal(err)
			}
		}
	})
}
