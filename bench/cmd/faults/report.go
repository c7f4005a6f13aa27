package main

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/batonllm/baton/bench/haproxy"
)

// p99 of the latencies of the ok steady requests that started in [from, to).
func p99(res []result, from, to time.Time) string {
	var l []float64
	for _, r := range res {
		if r.kind == "steady" && r.outcome == outOK && !r.start.Before(from) && r.start.Before(to) {
			l = append(l, r.latency().Seconds())
		}
	}
	if len(l) == 0 {
		return "–"
	}
	slices.Sort(l)
	return fmt.Sprintf("%.2f", l[int(math.Ceil(0.99*float64(len(l))))-1])
}

func countOutcomes(res []result) map[string]int {
	n := map[string]int{}
	for _, r := range res {
		n[r.outcome]++
	}
	return n
}

// details lists the distinct failures, most frequent first, at most k.
func details(res []result, k int) string {
	n := map[string]int{}
	for _, r := range res {
		if r.outcome == outOK || r.outcome == outCut {
			continue
		}
		d := r.detail
		if len(d) > 90 {
			d = d[:90] + "…"
		}
		n[fmt.Sprintf("%s (%s): %s", r.outcome, r.kind, d)]++
	}
	keys := make([]string, 0, len(n))
	for key := range n {
		keys = append(keys, key)
	}
	sort.Slice(keys, func(i, j int) bool { return n[keys[i]] > n[keys[j]] || n[keys[i]] == n[keys[j]] && keys[i] < keys[j] })
	var parts []string
	for i, key := range keys {
		if i == k {
			parts = append(parts, fmt.Sprintf("%d more kinds", len(keys)-k))
			break
		}
		parts = append(parts, fmt.Sprintf("%d× %s", n[key], key))
	}
	return strings.Join(parts, "; ")
}

func mib(b float64) string { return fmt.Sprintf("%.0f", b/(1<<20)) }

func gauge(m metrics, name string) float64 {
	if m == nil {
		return math.NaN()
	}
	return m.sum(name, nil)
}

func matrixReport(o options, wins []*window, rec *recorder, idle0, idle1 metrics, tier map[string]metrics, load0, load1 string, took time.Duration) string {
	res := rec.snapshot()
	var b strings.Builder
	fmt.Fprintf(&b, "Fleet: baton's simulated workers (`baton worker`, %s preset, H100, --time-scale %g), 2 prefill (p0, p1) + 2 decode (d0, d1), each behind a link proxy that every connection to it passes through (the replicas' calls and Watch streams, the KV blocks pushed to it), forwarding HTTP/2 frames unchanged unless a fault says; shared KV tier on a throwaway redis-server behind a delaying proxy; two `baton serve` replicas (kv_aware, so each follows every worker's Watch stream; max_in_flight %d, max_queue %d, queue_timeout 2s); loopback.\n\n",
		model, o.timeScale, maxInFlight, maxQueue)
	to := "alternating between the replicas and retrying connection errors on the other"
	if o.lb {
		to = fmt.Sprintf("sent to %s in front of the replicas (round robin per request, each replica's /readyz checked every %s, a refused connection tried again on the other replica; the replicas' drain_delay %s), each request once", o.lbVersion, haproxy.CheckInterval, lbDrainDelay)
	}
	fmt.Fprintf(&b, "Load: %d steady clients, one request after another, half streamed, each a 2,400-character document of 16 plus a question of its own, max_tokens 16–64, %s; client deadline %s. Windows: %s before, %s of fault, %s after the fleet is whole again. Run took %s; %s; load average %s at the start, %s at the end.\n\n",
		o.clients, to, o.deadline, o.before, o.during, o.after, took.Round(time.Second), cpus(), load0, load1)
	b.WriteString("| fault | injection | sent | ok | cut (by the client) | 429 | 503 | error events | truncated | hangs | other | resent to the other replica | p99 s before / during / after | breaker transitions (replica 0) | Redis-tier breaker transitions (workers) | goroutines before → after | RSS MiB before → after | back whole in |\n")
	b.WriteString("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|---|---:|\n")
	var notes []string
	for _, w := range wins {
		var in []result
		for _, r := range res {
			if !r.start.Before(w.t0) && (w.t3.IsZero() || r.start.Before(w.t3)) {
				in = append(in, r)
			}
		}
		n := countOutcomes(in)
		other := len(in) - n[outOK] - n[outCut] - n[outRejected] - n[outNoWorker] - n[outStreamErr] - n[outTruncated] - n[outHang]
		what := w.f.what
		if w.note != "" {
			what += " (" + w.note + ")"
		}
		retried := 0
		for _, r := range in {
			if r.tries > 1 {
				retried++
			}
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %s / %s / %s | %s | %s | %.0f → %.0f | %s → %s | %s |\n",
			w.f.name, what, len(in), n[outOK], n[outCut], n[outRejected], n[outNoWorker], n[outStreamErr], n[outTruncated], n[outHang], other, retried,
			p99(res, w.t0, w.t1), p99(res, w.t1, w.t2), p99(res, w.t2, w.t3),
			transitions(w.mBefore, w.mEnd), tierTransitions(w.wBefore, w.wEnd), gauge(w.mIn, "go_goroutines"), gauge(w.mEnd, "go_goroutines"),
			mib(gauge(w.mIn, "process_resident_memory_bytes")), mib(gauge(w.mEnd, "process_resident_memory_bytes")),
			w.recovery.Round(100*time.Millisecond))
		if d := details(in, 4); d != "" {
			notes = append(notes, fmt.Sprintf("- **%s**: %s", w.f.name, d))
		}
		if d := shareDetails(w); d != "" {
			notes = append(notes, fmt.Sprintf("- **%s**: %s", w.f.name, d))
		}
		if w.err != nil {
			notes = append(notes, fmt.Sprintf("- **%s**: the harness failed: %v", w.f.name, w.err))
		}
	}
	sent := rec.sent.Load()
	fmt.Fprintf(&b, "\nEvery request sent ended in an outcome the client saw: %d sent, %d ended (%d still open would be hangs the deadline missed).\n", sent, len(res), sent-int64(len(res)))
	acc, comp, fail := idle1.sum("baton_requests_accepted_total", nil), idle1.sum("baton_requests_completed_total", nil), idle1.sum("baton_requests_failed_total", nil)
	fmt.Fprintf(&b, "Replica 0's counters at the end: accepted %.0f = completed %.0f + failed %.0f (%+.0f).\n", acc, comp, fail, acc-comp-fail)
	fmt.Fprintf(&b, "Replica 0 idle, before the load and 3s after it: goroutines %.0f → %.0f, RSS %s → %s MiB.\n",
		gauge(idle0, "go_goroutines"), gauge(idle1, "go_goroutines"),
		mib(gauge(idle0, "process_resident_memory_bytes")), mib(gauge(idle1, "process_resident_memory_bytes")))
	lookups, blocks := map[string]float64{}, map[string]float64{}
	for _, m := range tier {
		for k, v := range m.byLabels("baton_worker_store_lookups_total", "outcome") {
			lookups[k] += v
		}
		for k, v := range m.byLabels("baton_worker_store_blocks_total", "kind") {
			blocks[k] += v
		}
	}
	fmt.Fprintf(&b, "The shared tier in use (workers' counters since their last start): lookups %s; blocks %s.\n", kv(lookups), kv(blocks))
	if len(notes) > 0 {
		b.WriteString("\nWhat the clients saw go wrong, by fault (outcome, which load, message):\n\n")
		b.WriteString(strings.Join(notes, "\n"))
		b.WriteString("\n")
	}
	return b.String()
}

func kv(m map[string]float64) string {
	var parts []string
	for k, v := range m {
		parts = append(parts, fmt.Sprintf("%s %.0f", k, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// shareDetails says what replica 1 shared over a window, when its sharing
// lost anything or the fault was about Redis or the replicas: the entries
// it received from the others, the messages it missed, the entries it
// dropped. A replica restarted in the window counts from its start.
func shareDetails(w *window) string {
	if w.r1Before == nil || w.r1End == nil {
		return ""
	}
	delta := func(name string) float64 {
		after, before := w.r1End.sum(name, nil), w.r1Before.sum(name, nil)
		if after < before {
			return after // restarted: counted since
		}
		return after - before
	}
	received := w.r1End.sum("baton_replica_sync_entries_total", map[string]string{"direction": "received"}) -
		w.r1Before.sum("baton_replica_sync_entries_total", map[string]string{"direction": "received"})
	if received < 0 {
		received = w.r1End.sum("baton_replica_sync_entries_total", map[string]string{"direction": "received"})
	}
	missed, dropped := delta("baton_replica_sync_missed_messages_total"), delta("baton_replica_sync_dropped_entries_total")
	lost := delta("baton_replica_sync_lost_entries_total")
	name := w.f.name
	if missed == 0 && dropped == 0 && lost == 0 && !strings.HasPrefix(name, "replica-") && !strings.HasPrefix(name, "redis-") {
		return ""
	}
	return fmt.Sprintf("replica 1's sharing over the window: %.0f entries received from the others, %.0f messages missed from the stream, %.0f entries lost both ways, %.0f entries dropped (since its start, by reason: %s); sync up at the end: %.0f",
		received, missed, lost, dropped, formatByLabel(w.r1End.byLabels("baton_replica_sync_dropped_entries_total", "reason")),
		w.r1End.sum("baton_replica_sync_up", nil))
}

// formatByLabel renders counts by label value, "none" when empty.
func formatByLabel(m map[string]float64) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if m[k] > 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f", k, m[k]))
		}
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}
