package vllmtest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// DP is a fake vLLM started with --data-parallel-size: one OpenAI server
// in front of a Server per rank, each with its own KV cache and event
// publisher, as vLLM runs an engine per rank behind its API server. Rank
// r publishes on the events and replay ports of rank 0 plus r (vLLM's
// offset_endpoint_port) and stamps its batches with its rank. A request
// carrying the X-data-parallel-rank header goes to that rank (an invalid
// or out-of-range one is a 400); one without goes to the rank with the
// fewest requests in flight, the lowest on a tie, as vLLM's load balancer
// does by its queues. /metrics has every rank's series, labelled
// engine="<rank>"; /tokenize and /v1/models are rank 0's.
//
// With Config.SGLang it is SGLang started with --dp-size (and
// --enable-dp-attention): a request names its rank by the
// X-Data-Parallel-Rank header or the body's routed_dp_rank (or
// data_parallel_rank, its older name), the header first, and the series
// of /metrics are labelled dp_rank="<rank>".
type DP struct {
	// URL is the front server's base URL.
	URL string

	sglang   bool
	pinned   [3]atomic.Int64 // requests by how their rank was picked
	ranks    []*Server
	inFlight []atomic.Int64
	proxies  []*httputil.ReverseProxy
	ln       net.Listener
	hs       *http.Server
	once     sync.Once
}

// NewDP starts a fake vLLM with n data-parallel ranks, each a Server of
// cfg (whose EventsAddr, ReplayAddr and HTTPAddr are ignored: the ranks
// take consecutive free ports), edited by per, if given, for each rank.
// Close it.
func NewDP(cfg Config, n int, per ...func(rank int, c *Config)) (*DP, error) {
	if n < 1 {
		return nil, fmt.Errorf("data-parallel size: %d is below 1", n)
	}
	var err error
	for range 20 { // consecutive free ports may be taken meanwhile: try others
		var d *DP
		if d, err = newDP(cfg, n, per); err == nil {
			return d, nil
		}
	}
	return nil, err
}

func newDP(cfg Config, n int, per []func(int, *Config)) (*DP, error) {
	events, err := freePorts(n)
	if err != nil {
		return nil, err
	}
	replay, err := freePorts(n)
	if err != nil {
		return nil, err
	}
	d := &DP{inFlight: make([]atomic.Int64, n), sglang: cfg.SGLang}
	for r := range n {
		rc := cfg
		for _, f := range per {
			f(r, &rc)
		}
		rc.DPRank, rc.HTTPAddr = r, ""
		rc.EventsAddr = "127.0.0.1:" + strconv.Itoa(events+r)
		rc.ReplayAddr = "127.0.0.1:" + strconv.Itoa(replay+r)
		s, err := New(rc)
		if err != nil {
			d.Close()
			return nil, err
		}
		d.ranks = append(d.ranks, s)
		u, _ := url.Parse(s.URL)
		p := httputil.NewSingleHostReverseProxy(u)
		p.FlushInterval = -1 // event streams flow token by token
		d.proxies = append(d.proxies, p)
	}
	if d.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
		d.Close()
		return nil, err
	}
	d.URL = "http://" + d.ln.Addr().String()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", d.metrics)
	mux.HandleFunc("POST /v1/chat/completions", d.complete)
	mux.HandleFunc("POST /v1/completions", d.complete)
	mux.Handle("/", d.proxies[0])
	d.hs = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go d.hs.Serve(d.ln)
	return d, nil
}

// freePorts returns the first of n consecutive ports free on 127.0.0.1.
func freePorts(n int) (int, error) {
	for range 50 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		base := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		free := base+n-1 <= 65535
		for p := base + 1; free && p < base+n; p++ {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
			if err != nil {
				free = false
				break
			}
			l.Close()
		}
		if free {
			return base, nil
		}
	}
	return 0, errors.New("no consecutive free ports")
}

// Close stops the front server and every rank. It is idempotent.
func (d *DP) Close() {
	d.once.Do(func() {
		if d.hs != nil {
			d.hs.Close()
		}
		for _, s := range d.ranks {
			s.Close()
		}
	})
}

// Size returns the number of ranks.
func (d *DP) Size() int { return len(d.ranks) }

// Rank returns rank r's server: its cache, events and counters.
func (d *DP) Rank(r int) *Server { return d.ranks[r] }

// complete hands a completion to the rank its header names, or the least
// busy one.
func (d *DP) complete(w http.ResponseWriter, r *http.Request) {
	if d.sglang {
		rank, by, ok := sglangRank(w, r, len(d.ranks))
		if ok {
			d.pinned[by].Add(1)
			d.serve(w, r, rank)
		}
		return
	}
	rank := -1
	if h := r.Header.Get("X-data-parallel-rank"); h != "" {
		n, err := strconv.Atoi(h)
		if err != nil || n < 0 || n >= len(d.ranks) {
			writeError(w, http.StatusBadRequest, "BadRequestError",
				fmt.Sprintf("Invalid X-data-parallel-rank header value %q: a rank 0–%d is required.", h, len(d.ranks)-1))
			return
		}
		rank = n
		d.pinned[pinHeader].Add(1)
	} else {
		d.pinned[pinBalanced].Add(1)
	}
	d.serve(w, r, rank)
}

// Pinned returns how many completions named their rank by a header, by
// a field of their body (SGLang's), and how many named none and went to
// the least busy rank.
func (d *DP) Pinned() (header, body, balanced int) {
	return int(d.pinned[pinHeader].Load()), int(d.pinned[pinBody].Load()), int(d.pinned[pinBalanced].Load())
}

// serve hands a completion to rank, or to the least busy rank if -1.
func (d *DP) serve(w http.ResponseWriter, r *http.Request, rank int) {
	if rank < 0 {
		rank = 0
		for i := range d.inFlight {
			if d.inFlight[i].Load() < d.inFlight[rank].Load() {
				rank = i
			}
		}
	}
	d.inFlight[rank].Add(1)
	defer d.inFlight[rank].Add(-1)
	d.proxies[rank].ServeHTTP(w, r)
}

// metrics serves every rank's metrics, each series labelled with its rank.
func (d *DP) metrics(w http.ResponseWriter, r *http.Request) {
	merged := map[string]*dto.MetricFamily{}
	for r, s := range d.ranks {
		rec := &bytes.Buffer{}
		rw := &textRecorder{h: http.Header{}, buf: rec}
		s.metrics(rw, nil)
		p := expfmt.NewTextParser(model.UTF8Validation)
		fams, err := p.TextToMetricFamilies(io.Reader(rec))
		if err != nil {
			writeError(w, http.StatusInternalServerError, "InternalServerError", err.Error())
			return
		}
		for name, f := range fams {
			for _, m := range f.Metric {
				for _, l := range m.Label {
					if n := l.GetName(); n == "engine" || d.sglang && n == "dp_rank" {
						v := strconv.Itoa(r)
						l.Value = &v
					}
				}
			}
			if g := merged[name]; g != nil {
				g.Metric = append(g.Metric, f.Metric...)
			} else {
				merged[name] = f
			}
		}
	}
	names := make([]string, 0, len(merged))
	for n := range merged {
		names = append(names, n)
	}
	sort.Strings(names)
	var page bytes.Buffer
	for _, n := range names {
		expfmt.MetricFamilyToText(&page, merged[n])
	}
	mode := d.ranks[0].cfg.MetricsQuery
	if d.sglang {
		mode = QueryEmpty
	}
	writeMetricsPage(w, r, mode, page.Bytes())
}

// textRecorder captures a handler's body.
type textRecorder struct {
	h   http.Header
	buf *bytes.Buffer
}

func (t *textRecorder) Header() http.Header         { return t.h }
func (t *textRecorder) Write(b []byte) (int, error) { return t.buf.Write(b) }
func (t *textRecorder) WriteHeader(int)             {}
