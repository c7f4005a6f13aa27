package vllmtest_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/workers/vllm"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

// A data-parallel fake: each rank publishes on the base port plus its
// rank, stamps its batches with it, and caches only what the
// X-data-parallel-rank header sends it; /metrics labels each rank's series.
func TestDP(t *testing.T) {
	d, err := vllmtest.NewDP(vllmtest.Config{TimeScale: 1e6}, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	port := func(endpoint string) int {
		p, _ := strconv.Atoi(endpoint[strings.LastIndexByte(endpoint, ':')+1:])
		return p
	}
	r0, r1 := d.Rank(0), d.Rank(1)
	if port(r1.EventsEndpoint()) != port(r0.EventsEndpoint())+1 || port(r1.ReplayEndpoint()) != port(r0.ReplayEndpoint())+1 {
		t.Errorf("rank 1 publishes on %s (replay %s), want rank 0's ports (%s, %s) plus 1",
			r1.EventsEndpoint(), r1.ReplayEndpoint(), r0.EventsEndpoint(), r0.ReplayEndpoint())
	}
	msgs := subscribe(t, r1)

	prompt := strings.Repeat("the same long document, ", 40)
	post := func(rank string) int {
		req, _ := http.NewRequest(http.MethodPost, d.URL+"/v1/completions",
			strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1}`, r0.Model(), prompt)))
		if rank != "" {
			req.Header.Set("X-data-parallel-rank", rank)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := post("1"); code != http.StatusOK {
		t.Fatalf("rank 1: status %d", code)
	}
	b := next(t, msgs)
	if !b.HasDPRank || b.DPRank != 1 {
		t.Errorf("rank 1's batch has rank %d (set %v), want 1", b.DPRank, b.HasDPRank)
	}
	toks := vllmtest.CompletionTokens(prompt, true)
	if r0.Cached(toks, "") != 0 || r1.Cached(toks, "") == 0 {
		t.Errorf("cached on rank 0: %d tokens, rank 1: %d; want only rank 1", r0.Cached(toks, ""), r1.Cached(toks, ""))
	}
	for _, bad := range []string{"2", "-1", "one"} {
		if code := post(bad); code != http.StatusBadRequest {
			t.Errorf("rank %q: status %d, want 400", bad, code)
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for r := range 2 {
		sc, err := vllm.NewRankScraper(d.URL, "", vllm.VLLM, r)
		if err != nil {
			t.Fatal(err)
		}
		m, err := sc.Scrape(ctx)
		sc.Close()
		if err != nil || m.GPUBlocks != int64(r0.GPUBlocks()) || !m.HasLoad {
			t.Errorf("rank %d's metrics: %+v, %v; want its load and its %d blocks", r, m, err, r0.GPUBlocks())
		}
	}
}

// An SGLang data-parallel fake: a request goes to the rank its
// X-Data-Parallel-Rank header names (whatever the case of its name), else
// the rank of its body's routed_dp_rank or data_parallel_rank; a header
// that is no integer is SGLang's 400; the metrics are SGLang's, labelled
// dp_rank; /tokenize takes a prompt, not messages; rank 0 stamps its
// batches too.
func TestSGLangDP(t *testing.T) {
	d, err := vllmtest.NewDP(vllmtest.Config{TimeScale: 1e6, SGLang: true, BlockSize: 32}, 2,
		func(rank int, c *vllmtest.Config) { c.GPUBlocks = 100 * (rank + 1) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(d.Close)
	r0, r1 := d.Rank(0), d.Rank(1)
	msgs := subscribe(t, r0)
	post := func(path, header, rank, body string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, d.URL+path, strings.NewReader(body))
		if header != "" {
			req.Header[header] = []string{rank}
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	completion := func(extra string) string {
		return fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":1%s}`, r0.Model(), strings.Repeat("a long document, ", 20), extra)
	}
	for _, c := range []struct {
		header, value, extra string
		rank                 int
	}{
		{"x-data-parallel-rank", "1", `,"routed_dp_rank":0`, 1}, // the header wins
		{"", "", `,"routed_dp_rank":1`, 1},
		{"", "", `,"data_parallel_rank":0`, 0},
	} {
		before := []int{len(r0.Requests()), len(r1.Requests())}
		if code, body := post("/v1/completions", c.header, c.value, completion(c.extra)); code != http.StatusOK {
			t.Fatalf("header %q=%q body %s: status %d: %s", c.header, c.value, c.extra, code, body)
		}
		if got := len(d.Rank(c.rank).Requests()) - before[c.rank]; got != 1 {
			t.Errorf("header %q=%q body %s: rank %d served %d requests, want 1", c.header, c.value, c.extra, c.rank, got)
		}
	}
	if header, body, balanced := d.Pinned(); header != 1 || body != 2 || balanced != 0 {
		t.Errorf("pinned by header %d, by body %d, balanced %d; want 1, 2, 0", header, body, balanced)
	}
	if code, body := post("/v1/completions", "X-Data-Parallel-Rank", "one", completion("")); code != http.StatusBadRequest ||
		!strings.Contains(body, "Invalid X-Data-Parallel-Rank header") {
		t.Errorf("a rank header that is no integer: status %d %s, want SGLang's 400", code, body)
	}
	if b := next(t, msgs); !b.HasDPRank || b.DPRank != 0 {
		t.Errorf("rank 0's batch has rank %d (set %v), want 0, set", b.DPRank, b.HasDPRank)
	}
	if code, _ := post("/tokenize", "", "", fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}]}`, r0.Model())); code != http.StatusUnprocessableEntity {
		t.Errorf("/tokenize with messages: status %d, want 422 (SGLang tokenizes a prompt)", code)
	}
	if code, body := post("/tokenize", "", "", fmt.Sprintf(`{"model":%q,"prompt":"a document"}`, r0.Model())); code != http.StatusOK ||
		!strings.Contains(body, `"tokens"`) {
		t.Errorf("/tokenize with a prompt: status %d %s", code, body)
	}
	for r := range 2 {
		sc, err := vllm.NewRankScraper(d.URL, "", vllm.SGLang, r)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		m, err := sc.Scrape(ctx)
		cancel()
		sc.Close()
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
		if want := int64(d.Rank(r).GPUBlocks() * 32); m.KVTokens != want {
			t.Errorf("rank %d: KV capacity %d tokens, want its own %d", r, m.KVTokens, want)
		}
	}
}
