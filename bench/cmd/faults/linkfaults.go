package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"time"
)

// The faults that damage what passes between the processes, through the
// link proxies in front of the workers: corrupt KV blocks in transit, and
// Watch events lost on their way to the schedulers.

// linkCounts are the link proxies' counters, summed.
type linkCounts struct{ pushed, flipped, watches, dropped int64 }

func (f *fleet) linkCounts(names ...string) linkCounts {
	if len(names) == 0 {
		names = f.names
	}
	var c linkCounts
	for _, n := range names {
		l := f.links[n]
		c.pushed += l.pushed.Load()
		c.flipped += l.flipped.Load()
		c.watches += l.watches.Load()
		c.dropped += l.dropped.Load()
	}
	return c
}

// mark is what a fault's check compares with: the links' counters and
// every replica's metrics when the fault began.
type mark struct {
	links    linkCounts
	dropped  map[string]int64 // Watch events dropped, by worker
	replicas []metrics
}

func (h *harness) setMark(ctx context.Context) {
	h.mark = mark{links: h.f.linkCounts(), dropped: map[string]int64{}, replicas: h.scrapeReplicas(ctx)}
	for _, n := range h.f.names {
		h.mark.dropped[n] = h.f.links[n].dropped.Load()
	}
}

// scrapeReplicas scrapes every serve replica (nil for one that does not
// answer).
func (h *harness) scrapeReplicas(ctx context.Context) []metrics {
	out := make([]metrics, len(h.f.bases))
	for i, base := range h.f.bases {
		out[i], _ = scrape(ctx, base)
	}
	return out
}

// replicaDelta sums, over the replicas, how much name's series matching
// match grew since the mark (a replica restarted since, or down then,
// counts from zero).
func (h *harness) replicaDelta(now []metrics, name string, match map[string]string) float64 {
	var d float64
	for i, m := range now {
		if m == nil {
			continue
		}
		var b float64
		if i < len(h.mark.replicas) {
			if old := h.mark.replicas[i]; old != nil && old.sum("process_start_time_seconds", nil) == m.sum("process_start_time_seconds", nil) {
				b = old.sum(name, match)
			}
		}
		d += m.sum(name, match) - b
	}
	return d
}

// workerDelta sums, over workers, how much name's series matching match
// grew in the window (a worker restarted in it counts from zero).
func workerDelta(w *window, workers []string, name string, match map[string]string) float64 {
	var d float64
	for _, n := range workers {
		a, b := w.wEnd[n].sum(name, match), w.wBefore[n].sum(name, match)
		if a < b {
			b = 0
		}
		d += a - b
	}
	return d
}

func (f *fleet) decodeNames() []string {
	var out []string
	for _, n := range f.names {
		if strings.HasPrefix(n, "d") {
			out = append(out, n)
		}
	}
	return out
}

// freshReq is a request over a new document sent while the links
// corrupted blocks, kept to be sent again once they no longer do.
type freshReq struct {
	body   []byte
	stream bool
	text   string
}

type freshLog struct {
	mu   sync.Mutex
	reqs []freshReq
}

// freshClients runs n looping clients, each sending requests over new
// documents, one after another, while the window lasts; if keep, it keeps
// those that succeeded, with their text, for replayFresh.
func freshClients(n int, keep bool) func(context.Context, *harness) {
	return func(ctx context.Context, h *harness) {
		c := newClient(h.f.clients, h.model, h.deadline, n, h.rec)
		c.keepText = true
		defer c.close()
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(i), 11))
				for ctx.Err() == nil {
					stream := r.IntN(2) == 0
					body := c.freshBody(r, stream, 16+r.IntN(49))
					res := c.do(context.WithoutCancel(ctx), "fresh", body, stream, false)
					if keep && res.outcome == outOK {
						h.fresh.mu.Lock()
						h.fresh.reqs = append(h.fresh.reqs, freshReq{body: body, stream: stream, text: res.text})
						h.fresh.mu.Unlock()
					}
				}
			})
		}
		wg.Wait()
	}
}

// replayFresh sends every kept fresh request again, 8 at a time, and
// checks that each gets the text it got before (outWrong otherwise). It
// counts in h.replayed how many it compared and how many differed.
func (h *harness) replayFresh(ctx context.Context) {
	var compared, differed int
	defer func() { h.replayed.compared, h.replayed.differed = compared, differed }()
	h.fresh.mu.Lock()
	reqs := h.fresh.reqs
	h.fresh.reqs = nil
	h.fresh.mu.Unlock()
	c := newClient(h.f.clients, h.model, h.deadline, 8, h.rec)
	defer c.close()
	var (
		wg  sync.WaitGroup
		mu  sync.Mutex
		sem = make(chan struct{}, 8)
	)
	for _, fr := range reqs {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			res := c.doCheck(context.WithoutCancel(ctx), "replay", fr.body, fr.stream, false, &fr.text)
			mu.Lock()
			defer mu.Unlock()
			if res.outcome == outOK || res.outcome == outWrong {
				compared++
			}
			if res.outcome == outWrong {
				differed++
			}
		})
	}
	wg.Wait()
}

// corruptTransfer: the links in front of the decode workers flip a byte
// in every second block pushed to them. The steady clients' documents are
// held by every decode worker after the first minute, so that little
// moves: fresh clients send documents nobody sent before, each pushed
// whole. Once the links are clean again, each fresh request is sent again
// and must get the same text.
func corruptTransfer(fresh int) fault {
	return fault{name: "corrupt-transfer",
		what: fmt.Sprintf("the links to both decode workers flip one byte in every second KV block pushed to them, after the sender's checksum; %d more clients send prompts over new documents, pushed whole; each is sent again once the links are clean, and must get the same text", fresh),
		inject: func(ctx context.Context, h *harness) (string, error) {
			h.setMark(ctx)
			h.corrupt(2)
			return "", nil
		},
		side: freshClients(fresh, true),
		recover: func(ctx context.Context, h *harness) error {
			h.corrupt(0)
			h.replayFresh(ctx)
			return nil
		},
		check: func(ctx context.Context, h *harness, w *window) (string, error) {
			note, flipped, rejected := h.corruptNote(ctx, w)
			switch {
			case flipped == 0:
				return note, errors.New("no block was corrupted: nothing was pushed through the links")
			case rejected == 0:
				return note, errors.New("the decode workers rejected no block")
			case h.replayed.compared == 0:
				return note, errors.New("no text was compared")
			}
			return note, nil
		},
	}
}

// corrupt has the links to the decode workers flip a byte in every nth
// block pushed (0: none).
func (h *harness) corrupt(n int) {
	for _, d := range h.f.decodeNames() {
		h.f.links[d].corrupt(n)
	}
}

// corruptNote says what the links corrupted since the mark, what the
// decode workers and the replicas counted, and what the replay found.
func (h *harness) corruptNote(ctx context.Context, w *window) (note string, flipped int64, rejected float64) {
	lc := h.f.linkCounts(h.f.decodeNames()...)
	flipped, pushed := lc.flipped-h.mark.links.flipped, lc.pushed-h.mark.links.pushed
	recv := map[string]string{"direction": "received"}
	rejected = workerDelta(w, h.f.decodeNames(), "baton_worker_transfer_blocks_total", map[string]string{"direction": "received", "outcome": "rejected"})
	accepted := workerDelta(w, h.f.decodeNames(), "baton_worker_transfer_blocks_total", map[string]string{"direction": "received", "outcome": "accepted"})
	broken := workerDelta(w, h.f.decodeNames(), "baton_worker_transfer_failures_total", recv)
	counted := h.replicaDelta(h.scrapeReplicas(ctx), "baton_transfer_blocks_total", map[string]string{"kind": "rejected"})
	note = fmt.Sprintf("links: %d blocks pushed while corrupting, %d flipped; decode workers: %.0f rejected, %.0f accepted, %.0f transfers broken off; replicas: %.0f rejected blocks counted; %d of %d texts equal to the replay's",
		pushed, flipped, rejected, accepted, broken, counted, h.replayed.compared-h.replayed.differed, h.replayed.compared)
	return note, flipped, rejected
}

// watchGap: every link drops one cache event from each Watch stream
// through it, every period: each replica, for each worker, sees a
// sequence number skipped, and must resubscribe for a fresh snapshot.
// The steady clients' prompts skip the prefill workers once the decode
// workers hold their documents, so fresh clients keep the prefill
// workers' caches, and their events, moving.
func watchGap(every time.Duration, fresh int) fault {
	return fault{name: "watch-gap",
		what: fmt.Sprintf("the links drop one cache event from each Watch stream through them (each replica's, on every worker) every %s: the subscriber sees a sequence number skipped; %d more clients send prompts over new documents, so that every worker's cache changes", every, fresh),
		inject: func(ctx context.Context, h *harness) (string, error) {
			h.setMark(ctx)
			for _, l := range h.f.links {
				l.dropWatch()
			}
			return "", nil
		},
		side: together(dropWatchEvery(every), freshClients(fresh, false)),
		recover: func(_ context.Context, h *harness) error {
			h.stopDrops()
			return nil
		},
		check: func(ctx context.Context, h *harness, w *window) (string, error) {
			note, dropped, gaps := h.watchNote(ctx)
			switch {
			case dropped == 0:
				return note, errors.New("no Watch event was dropped")
			case gaps == 0:
				return note, errors.New("no gap was detected")
			}
			return note, nil
		},
	}
}

// stopDrops cancels the Watch drops asked for and not yet done.
func (h *harness) stopDrops() {
	for _, l := range h.f.links {
		l.stopDrops()
	}
}

// watchNote says how many Watch events the links dropped since the mark,
// how many streams were opened, and the replicas' resyncs by reason.
func (h *harness) watchNote(ctx context.Context) (note string, dropped int64, gaps float64) {
	lc := h.f.linkCounts()
	dropped, opened := lc.dropped-h.mark.links.dropped, lc.watches-h.mark.links.watches
	now := h.scrapeReplicas(ctx)
	reasons := map[string]float64{}
	for _, reason := range []string{"gap", "stream", "unreachable"} {
		reasons[reason] = h.replicaDelta(now, "baton_kv_index_resyncs_total", map[string]string{"reason": reason})
	}
	var per []string
	for _, n := range h.f.names {
		per = append(per, fmt.Sprintf("%s %d", n, h.f.links[n].dropped.Load()-h.mark.dropped[n]))
	}
	note = fmt.Sprintf("links: %d events dropped (%s), %d Watch streams opened; replicas: resyncs %s", dropped, strings.Join(per, ", "), opened, resyncs(reasons))
	return note, dropped, reasons["gap"]
}

// dropWatchEvery has every link drop a cache event from each Watch
// stream every period, until ctx ends.
func dropWatchEvery(period time.Duration) func(context.Context, *harness) {
	return func(ctx context.Context, h *harness) {
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				for _, l := range h.f.links {
					l.dropWatch()
				}
			}
		}
	}
}

// reopened says when the replicas' Watch streams to each restarted
// worker were opened again after its restart: until then their index
// holds what the old process held.
func reopened(workers ...string) func(context.Context, *harness, *window) (string, error) {
	return func(_ context.Context, h *harness, _ *window) (string, error) {
		var parts []string
		for _, n := range workers {
			var ds []string
			for _, d := range h.f.links[n].watchesSince(h.f.started[n]) {
				ds = append(ds, fmt.Sprintf("%.1fs", d.Seconds()))
			}
			if len(ds) == 0 {
				ds = []string{"none"}
			}
			parts = append(parts, fmt.Sprintf("Watch streams to %s reopened %s after its restart", n, strings.Join(ds, ", ")))
		}
		return strings.Join(parts, "; "), nil
	}
}

func resyncs(m map[string]float64) string {
	var parts []string
	for k, v := range m {
		parts = append(parts, fmt.Sprintf("%s %.0f", k, v))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}
