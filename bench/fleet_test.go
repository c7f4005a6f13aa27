package bench

import (
	"context"
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/batonllm/baton/bench/workload"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

func TestParseFleets(t *testing.T) {
	fs, err := ParseFleets("colocated, disagg:2:5,colocated:3", 7)
	if err != nil {
		t.Fatal(err)
	}
	want := []Fleet{{Workers: 7}, {Workers: 7, Prefill: 2, Decode: 5}, {Workers: 3, Name: "colocated:3"}}
	if len(fs) != len(want) {
		t.Fatalf("got %v", fs)
	}
	for i := range want {
		if fs[i] != want[i] {
			t.Errorf("fleet %d: got %+v, want %+v", i, fs[i], want[i])
		}
	}
	if got := Column("kv_aware", fs[1]); got != "kv_aware/disagg:2:5" {
		t.Errorf("column %q", got)
	}
	if got := Column("kv_aware", fs[0]); got != "kv_aware" {
		t.Errorf("column %q", got)
	}
	if got := Column("random", fs[2]); got != "random/colocated:3" {
		t.Errorf("column %q", got)
	}
	for _, bad := range []string{"", "disagg", "disagg:0:2", "disagg:2", "colocated:x", "gpu", "colocated,colocated", "disagg:1:1,disagg:1:1", "disagg:1:4097", "colocated:03"} {
		if _, err := ParseFleets(bad, 7); err == nil {
			t.Errorf("ParseFleets(%q): no error", bad)
		}
	}
	// An in-process fleet holds up to 1,024 workers of a role, one on the
	// virtual clock up to 4,096.
	big, err := ParseFleets("disagg:1:1100", 7)
	if err != nil {
		t.Fatal(err)
	}
	o := Options{Strategies: []string{"kv_aware"}, Workers: 7, Fleets: big}
	if err := o.Validate(); err == nil || !strings.Contains(err.Error(), "1–1024 decode workers") {
		t.Errorf("1,100 decode workers in process: %v", err)
	}
	o.Virtual = true
	if err := o.Validate(); err != nil {
		t.Errorf("1,100 decode workers on the virtual clock: %v", err)
	}
}

// A tiny colocated versus disaggregated comparison with the shared tier,
// end to end: every column completes the identical sequence, and a
// disaggregated column's responses stream from its decode workers.
func TestBenchDisaggregated(t *testing.T) {
	if testing.Short() {
		t.Skip("starts fleets")
	}
	w, err := workload.LongContext(workload.DefaultLongContext(3), 12, 7)
	if err != nil {
		t.Fatal(err)
	}
	o := Options{Strategies: []string{"prefix_aware", "kv_aware"}, Workers: 2, Speedup: 20, Rate: 2, Seed: 7,
		Fleets: []Fleet{{Workers: 2}, {Workers: 2, Prefill: 1, Decode: 1}}, SharedTier: true}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := Run(ctx, o, w)
	if err != nil {
		t.Fatal(err)
	}
	var labels []string
	for _, s := range rep.Strategies {
		labels = append(labels, s.Strategy)
	}
	if got := strings.Join(labels, ","); got != "prefix_aware,prefix_aware/disagg:1:1,kv_aware,kv_aware/disagg:1:1" {
		t.Fatalf("columns %s", got)
	}
	for _, s := range rep.Strategies {
		if s.OK != 12 || s.Errors != 0 {
			t.Errorf("%s: %d ok, %d errors (%s)", s.Strategy, s.OK, s.Errors, s.ErrorSample)
		}
		if strings.Contains(s.Strategy, "disagg") {
			if s.Fleet != "1 prefill + 1 decode" || s.Ideal != 1 || len(s.Shares) != 1 || s.Shares["decode-0"] != 1 {
				t.Errorf("%s: fleet %q ideal %v shares %v; want all on decode-0", s.Strategy, s.Fleet, s.Ideal, s.Shares)
			}
			n, remote := 0.0, 0.0
			for k, v := range s.Counters {
				if strings.HasPrefix(k, "disagg_decisions_total{") {
					n += v
					if strings.Contains(k, "decision=remote") {
						remote += v
					}
				}
			}
			if n != 12 {
				t.Errorf("%s: %v disaggregation decisions counted, want 12 (counters %v)", s.Strategy, n, s.Counters)
			}
			prefilled := 0
			for _, r := range s.Results {
				if r.PrefillWorker == "prefill-0" {
					prefilled++
				} else if r.PrefillWorker != "" {
					t.Errorf("%s: request %d prefilled on %q", s.Strategy, r.Index, r.PrefillWorker)
				}
			}
			if float64(prefilled) != remote {
				t.Errorf("%s: %d results name prefill-0 as their prefill worker, %v remote prefills counted; want the same", s.Strategy, prefilled, remote)
			}
		} else if r := s.Results; len(r) > 0 && r[0].PrefillWorker != "" {
			t.Errorf("%s: a colocated request names prefill worker %q", s.Strategy, r[0].PrefillWorker)
		}
		if !strings.Contains(s.Strategy, "disagg") && (s.Fleet != "2 colocated" || s.Ideal != 0.5) {
			t.Errorf("%s: fleet %q ideal %v", s.Strategy, s.Fleet, s.Ideal)
		}
		if s.HitRate <= 0 {
			t.Errorf("%s: no KV reuse over 3 documents", s.Strategy)
		}
	}
	if !rep.SharedTier || len(rep.Fleets) != 2 {
		t.Errorf("report fleets %v shared %v", rep.Fleets, rep.SharedTier)
	}
	var md strings.Builder
	rep.Markdown(&md)
	for _, want := range []string{"| kv_aware/disagg:1:1 |", "1 prefill + 1 decode", "--shared-tier"} {
		if !strings.Contains(md.String(), want) {
			t.Errorf("report lacks %q", want)
		}
	}
}

// With --replicas 1,2 each strategy runs once per number of replicas, a
// column each; with two, the requests are spread over both replicas
// (each counts its half), and every request completes.
func TestBenchReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("starts fleets")
	}
	w, err := workload.LongContext(workload.DefaultLongContext(3), 12, 7)
	if err != nil {
		t.Fatal(err)
	}
	o := Options{Strategies: []string{"kv_aware"}, Workers: 2, Speedup: 20, Rate: 2, Seed: 7, Replicas: []int{1, 2}}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := Run(ctx, o, w)
	if err != nil {
		t.Fatal(err)
	}
	var labels []string
	for _, s := range rep.Strategies {
		labels = append(labels, s.Strategy)
	}
	if got := strings.Join(labels, ","); got != "kv_aware/replicas:1,kv_aware/replicas:2" {
		t.Fatalf("columns %s", got)
	}
	for _, s := range rep.Strategies {
		if s.OK != 12 || s.Errors != 0 {
			t.Errorf("%s: %d ok, %d errors (%s)", s.Strategy, s.OK, s.Errors, s.ErrorSample)
		}
		// Every replica's decisions are counted, one per request.
		decisions := 0.0
		for k, v := range s.Counters {
			if strings.HasPrefix(k, "routing_decisions_total{") {
				decisions += v
			}
		}
		if decisions != 12 {
			t.Errorf("%s: %v routing decisions counted over the replicas, want 12 (%v)", s.Strategy, decisions, s.Counters)
		}
	}
	if f := rep.Strategies[1].Fleet; f != "2 colocated, 2 scheduler replicas" {
		t.Errorf("fleet %q, want the replicas named", f)
	}
}

// The in-process scheduler's random choices are seeded: two runs of random
// on the same sequence send the same number of requests to each worker.
func TestBenchSeededRandomRepeats(t *testing.T) {
	if testing.Short() {
		t.Skip("starts fleets")
	}
	w, err := workload.LongContext(workload.DefaultLongContext(4), 24, 3)
	if err != nil {
		t.Fatal(err)
	}
	o := Options{Strategies: []string{"random", "random"}, Workers: 3, Speedup: 20, Rate: 4, Seed: 3}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	rep, err := Run(ctx, o, w)
	if err != nil {
		t.Fatal(err)
	}
	a, b := rep.Strategies[0], rep.Strategies[1]
	if a.OK != 24 || b.OK != 24 {
		t.Fatalf("%d and %d ok", a.OK, b.OK)
	}
	if !maps.Equal(a.Shares, b.Shares) {
		t.Errorf("shares differ between runs with one seed: %v and %v", a.Shares, b.Shares)
	}
}

// With --share-redis the replicas of a fleet share their decisions through
// a real Redis, with --share-peers straight to each other: each receives
// what the other sent, every request completes, and the report gives how
// late the decisions arrived.
func TestBenchReplicasShare(t *testing.T) {
	if testing.Short() {
		t.Skip("starts fleets and redis-server")
	}
	w, err := workload.LongContext(workload.DefaultLongContext(3), 12, 7)
	if err != nil {
		t.Fatal(err)
	}
	for _, via := range []string{"redis", "peer"} {
		t.Run(via, func(t *testing.T) {
			o := Options{Strategies: []string{"kv_aware"}, Workers: 2, Speedup: 20, Rate: 2, Seed: 7, Replicas: []int{2}}
			fleet := "2 scheduler replicas sharing straight"
			if via == "redis" {
				o.ShareRedis, fleet = redistest.Start(t).Addr(), "2 scheduler replicas sharing through Redis"
			} else {
				o.SharePeers = true
			}
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			rep, err := Run(ctx, o, w)
			if err != nil {
				t.Fatal(err)
			}
			s := rep.Strategies[0]
			if s.OK != 12 || s.Errors != 0 {
				t.Errorf("%s: %d ok, %d errors (%s)", s.Strategy, s.OK, s.Errors, s.ErrorSample)
			}
			if !strings.Contains(s.Fleet, fleet) {
				t.Errorf("fleet %q does not say how its replicas share", s.Fleet)
			}
			sent, received := s.Counters["replica_sync_entries_total{direction=sent,via="+via+"}"], s.Counters["replica_sync_entries_total{direction=received,via="+via+"}"]
			if sent == 0 || received == 0 {
				t.Errorf("entries sent %v, received %v over the replicas; want both above 0 (%v)", sent, received, s.Counters)
			}
			if s.SyncLagMs[1] <= 0 || s.SyncLagMs[0] > s.SyncLagMs[1] {
				t.Errorf("sharing lag p50 / p99 %v ms; want both measured, p50 at most p99", s.SyncLagMs)
			}
			var md strings.Builder
			rep.Markdown(&md)
			if !strings.Contains(md.String(), "Replica sharing lag ("+s.Strategy+")") {
				t.Errorf("the report does not give the sharing lag:\n%s", md.String())
			}
		})
	}
}

// TestBenchReplicasFirst: with ReplicasFirst every request goes to the
// first target, without it they take turns.
func TestBenchReplicasFirst(t *testing.T) {
	w, err := workload.LongContext(workload.DefaultLongContext(2), 6, 1)
	if err != nil {
		t.Fatal(err)
	}
	for _, first := range []bool{false, true} {
		var got [2]atomic.Int64
		var urls []string
		for i := range got {
			srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
				if r.Method == http.MethodPost {
					got[i].Add(1)
				}
				http.Error(rw, `{"error":{"message":"no","type":"server_error"}}`, http.StatusServiceUnavailable)
			}))
			t.Cleanup(srv.Close)
			urls = append(urls, srv.URL)
		}
		o := Options{Strategies: []string{"kv_aware"}, Workers: 2, Speedup: 20, Rate: 20, Seed: 1,
			Target: strings.Join(urls, ","), ReplicasFirst: first}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := Run(ctx, o, w); err != nil {
			t.Fatal(err)
		}
		want := [2]int64{3, 3}
		if first {
			want = [2]int64{6, 0}
		}
		if a, b := got[0].Load(), got[1].Load(); a != want[0] || b != want[1] {
			t.Errorf("first %v: requests %d and %d, want %v", first, a, b, want)
		}
	}
}
