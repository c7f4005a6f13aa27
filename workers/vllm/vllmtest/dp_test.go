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
