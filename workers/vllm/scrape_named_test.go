package vllm_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/workers/vllm"
	"github.com/batonllm/baton/workers/vllm/vllmtest"
)

// recorder fronts an engine and notes each request's query and the
// bytes of its answer.
type recorder struct {
	mu    sync.Mutex
	asked []string // each request's raw query
	sizes []int
}

func (rec *recorder) front(t *testing.T, backend string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		resp, err := http.Get(backend + r.URL.RequestURI())
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		rec.mu.Lock()
		rec.asked = append(rec.asked, r.URL.RawQuery)
		rec.sizes = append(rec.sizes, len(body))
		rec.mu.Unlock()
		w.WriteHeader(resp.StatusCode)
		w.Write(body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// wholePage parses the engine's whole page, as a scraper asking for
// every series reads it.
func wholePage(t *testing.T, url string, rank string) vllm.Metrics {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	m, err := vllm.ParseEngine(resp.Body, vllm.VLLM, rank)
	if err != nil || !m.HasLoad {
		t.Fatalf("whole page: %+v, %v", m, err)
	}
	return m
}

// TestScraperAsksByName: a vLLM engine is asked for only the series
// baton reads, and reads the same load from them as from the whole
// page; an engine that answers the query with the whole page is read as
// well; one that answers it with an empty page (a multiprocess registry)
// or refuses it is read whole from then on, from the first scrape.
func TestScraperAsksByName(t *testing.T) {
	for _, tt := range []struct {
		name     string
		mode     vllmtest.MetricsQuery
		named    bool // still asked by name after the scrapes
		requests int  // for three scrapes
		small    bool // the answers to named requests are small
	}{
		{"names", vllmtest.QueryNames, true, 3, true},
		{"ignored", vllmtest.QueryIgnored, true, 3, false},
		{"empty", vllmtest.QueryEmpty, false, 4, true},
		{"refused", vllmtest.QueryRefused, false, 4, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			eng, err := vllmtest.New(vllmtest.Config{NoEvents: true, TimeScale: 1e6, MetricsQuery: tt.mode, MaxLoRAs: 2})
			if err != nil {
				t.Fatal(err)
			}
			defer eng.Close()
			want := wholePage(t, eng.URL, "")
			rec := &recorder{}
			front := rec.front(t, eng.URL)
			s, err := vllm.NewScraper(front.URL, "", vllm.VLLM)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			for i := range 3 {
				got, err := s.Scrape(ctx)
				if err != nil {
					t.Fatalf("scrape %d: %v", i, err)
				}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("scrape %d (-whole page +scraped):\n%s", i, diff)
				}
			}
			if s.Named() != tt.named {
				t.Errorf("Named() = %v after three scrapes, want %v", s.Named(), tt.named)
			}
			if len(rec.asked) != tt.requests {
				t.Fatalf("%d requests for three scrapes (%q), want %d", len(rec.asked), rec.asked, tt.requests)
			}
			if !strings.Contains(rec.asked[0], "name%5B%5D=vllm%3Anum_requests_running") {
				t.Errorf("first request's query %q does not name vllm:num_requests_running", rec.asked[0])
			}
			if small := rec.sizes[0] < 2000; small != tt.small {
				t.Errorf("the first answer is %d bytes; want small: %v", rec.sizes[0], tt.small)
			}
			if !tt.named && rec.asked[len(rec.asked)-1] != "" {
				t.Errorf("the last request asked %q, want the whole page", rec.asked[len(rec.asked)-1])
			}
		})
	}
}

// TestRankScraperAsksByName: each data-parallel rank reads its own load
// from the named series as from the whole page.
func TestRankScraperAsksByName(t *testing.T) {
	dp, err := vllmtest.NewDP(vllmtest.Config{NoEvents: true, TimeScale: 1e6}, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer dp.Close()
	rec := &recorder{}
	front := rec.front(t, dp.URL)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for rank := range 2 {
		want := wholePage(t, dp.URL, []string{"0", "1"}[rank])
		s, err := vllm.NewRankScraper(front.URL, "", vllm.VLLM, rank)
		if err != nil {
			t.Fatal(err)
		}
		got, err := s.Scrape(ctx)
		s.Close()
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("rank %d (-whole page +scraped):\n%s", rank, diff)
		}
		if !s.Named() {
			t.Errorf("rank %d: no longer asked by name", rank)
		}
	}
	if len(rec.asked) != 2 || rec.sizes[0] > 2000 {
		t.Errorf("requests %q of %v bytes, want two small ones", rec.asked, rec.sizes)
	}
}
