package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"
)

// fault is one injection: inject starts it, recover ends it, and side,
// if not nil, adds load of its own while it lasts. check, if not nil,
// runs after the window and says what the fault's own counters show (for
// the table), with an error if they show it was not exercised.
type fault struct {
	name    string
	what    string // how it is injected, for the table
	inject  func(ctx context.Context, h *harness) (note string, err error)
	recover func(ctx context.Context, h *harness) error
	side    func(ctx context.Context, h *harness)
	check   func(ctx context.Context, h *harness, w *window) (note string, err error)
}

// waitInFlight waits (up to 3s) until worker has sequences running or
// waiting by its own /metrics, or either replica counts calls in flight
// on it, so that a kill lands mid-call, and says how many.
func (h *harness) waitInFlight(ctx context.Context, worker string) string {
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		if m, err := scrape(ctx, h.f.metrics[worker]); err == nil {
			if n := m.sum("baton_worker_sequences", nil); n > 0 {
				return fmt.Sprintf("%.0f sequences on %s at the kill", n, worker)
			}
		}
		for _, base := range h.f.bases {
			if m, err := scrape(ctx, base); err == nil {
				if n := m.sum("baton_worker_in_flight", map[string]string{"worker": worker}); n > 0 {
					return fmt.Sprintf("%.0f calls in flight on %s at the kill", n, worker)
				}
			}
		}
	}
	return "nothing seen in flight on " + worker + " within 3s"
}

func (h *harness) kill(ctx context.Context, worker string) string {
	note := h.waitInFlight(ctx, worker)
	h.f.workers[worker].kill()
	return note
}

func killWorker(worker string) func(context.Context, *harness) (string, error) {
	return func(ctx context.Context, h *harness) (string, error) { return h.kill(ctx, worker), nil }
}

func restartWorker(worker string) func(context.Context, *harness) error {
	return func(_ context.Context, h *harness) error { return h.f.restartWorker(worker, h.f.timeScale) }
}

func noop(context.Context, *harness) error { return nil }

// cutClients sends n streamed requests spread over the window, each
// closing its stream after the first token.
func cutClients(n int) func(context.Context, *harness) {
	return func(ctx context.Context, h *harness) {
		c := newClient(h.f.clients, h.model, h.deadline, 64, h.rec)
		defer c.close()
		var wg sync.WaitGroup
		gap := h.during / time.Duration(n) / 2 // over the window's first half
		for i := range n {
			if ctx.Err() != nil {
				break
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(uint64(i), 3))
				c.do(context.WithoutCancel(ctx), "cut", c.body(r, true, 64), true, true)
			}()
			time.Sleep(gap)
		}
		wg.Wait()
	}
}

// cutThenServe opens cut streams at once, each long (2,000 tokens asked)
// and closed by its client after its first token, then sends after
// ordinary requests, 32 at a time: the clients' hang-ups must leave the
// fleet whole for those that follow.
func cutThenServe(cut, after int) func(context.Context, *harness) {
	return func(ctx context.Context, h *harness) {
		c := newClient(h.f.clients, h.model, h.deadline, cut, h.rec)
		defer c.close()
		var wg sync.WaitGroup
		for i := range cut {
			wg.Go(func() {
				r := rand.New(rand.NewPCG(uint64(i), 5))
				c.do(context.WithoutCancel(ctx), "cut", c.body(r, true, 2000), true, true)
			})
		}
		wg.Wait()
		sem := make(chan struct{}, 32)
		for i := range after {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				r := rand.New(rand.NewPCG(uint64(i), 6))
				stream := i%2 == 0
				c.do(context.WithoutCancel(ctx), "after-cut", c.body(r, stream, 16), stream, false)
			})
		}
		wg.Wait()
	}
}

// together runs sides at once.
func together(sides ...func(context.Context, *harness)) func(context.Context, *harness) {
	return func(ctx context.Context, h *harness) {
		var wg sync.WaitGroup
		for _, side := range sides {
			wg.Go(func() { side(ctx, h) })
		}
		wg.Wait()
	}
}

// burst runs n looping clients while the window lasts.
func burst(n int) func(context.Context, *harness) {
	return func(ctx context.Context, h *harness) {
		c := newClient(h.f.clients, h.model, h.deadline, n, h.rec)
		defer c.close()
		var wg sync.WaitGroup
		for i := range n {
			wg.Add(1)
			go c.loop(ctx, uint64(1000+i), "burst", &wg)
		}
		wg.Wait()
	}
}

// What the clients do when a replica goes away, as the faults say it:
// clientsRetry of the clients that alternate between the replicas,
// lbRetries of HAProxy in front of them (-lb).
const (
	clientsRetry = "; clients retry connection errors on the other replica"
	lbRetries    = "; HAProxy takes it out at its first failed /readyz check and tries a refused connection again on the other"
)

func allFaults(prefill, decode int) []fault {
	capacity := decode * maxInFlight
	return []fault{
		{name: "prefill-kill", what: "SIGKILL prefill worker p0 with calls in flight; restarted at the window's end",
			inject: killWorker("p0"), recover: restartWorker("p0"), check: reopened("p0")},
		{name: "decode-kill", what: "SIGKILL decode worker d0 with streams in flight; restarted at the window's end",
			inject: killWorker("d0"), recover: restartWorker("d0"), check: reopened("d0")},
		decodeKillTransfer(4, 500*time.Millisecond),
		{name: "slow-worker", what: "decode worker d1 restarted (SIGTERM, drained) at --time-scale ÷10; back to normal after",
			inject: func(_ context.Context, h *harness) (string, error) {
				h.f.workers["d1"].stop(10 * time.Second)
				return "", h.f.restartWorker("d1", h.f.timeScale/10)
			},
			recover: func(_ context.Context, h *harness) error {
				h.f.workers["d1"].stop(10 * time.Second)
				return h.f.restartWorker("d1", h.f.timeScale)
			}},
		{name: "black-hole", what: "decode worker d1 SIGKILLed and its port taken by a listener that accepts and never answers",
			inject: func(ctx context.Context, h *harness) (string, error) {
				note := h.kill(ctx, "d1")
				var err error
				h.hole, err = newBlackHole(h.f.addrs["d1"])
				return note, err
			},
			recover: func(_ context.Context, h *harness) error {
				h.hole.close()
				return h.f.restartWorker("d1", h.f.timeScale)
			},
			check: reopened("d1")},
		{name: "redis-down", what: "SIGKILL redis-server; restarted empty on the same port",
			inject: func(_ context.Context, h *harness) (string, error) {
				h.f.redis.kill()
				return "", nil
			},
			recover: func(_ context.Context, h *harness) error { return h.f.startRedis() }},
		{name: "redis-slow", what: "a proxy in front of Redis holds every chunk 250ms, each way",
			inject: func(_ context.Context, h *harness) (string, error) {
				h.f.redisPx.setDelay(250 * time.Millisecond)
				return "", nil
			},
			recover: func(_ context.Context, h *harness) error { h.f.redisPx.setDelay(0); return nil }},
		corruptTransfer(4),
		watchGap(2*time.Second, 2),
		{name: "scheduler-restart", what: "serve replica 1 SIGTERMed (drain), down for the window, then restarted" + clientsRetry,
			inject: func(_ context.Context, h *harness) (string, error) {
				h.f.scheds[1].stop(15 * time.Second)
				return "", nil
			},
			recover: func(ctx context.Context, h *harness) error { return h.f.startScheduler(ctx, 1) }},
		{name: "replica-kill", what: "serve replica 1 SIGKILLed while the replicas share through Redis and straight, down for the window, then restarted (it replays what replica 0 shared)" + clientsRetry,
			inject: func(_ context.Context, h *harness) (string, error) {
				h.f.scheds[1].kill()
				return "", nil
			},
			recover: func(ctx context.Context, h *harness) error { return h.f.startScheduler(ctx, 1) }},
		{name: "replica-partition", what: "serve replica 1 cut off from what the replicas share (its connections to Redis and to and from the other replica closed and refused) while both serve; then the links restored",
			inject: func(_ context.Context, h *harness) (string, error) {
				h.f.partition(1, true)
				return "", nil
			},
			recover: func(_ context.Context, h *harness) error { h.f.partition(1, false); return nil }},
		{name: "cut-500", what: "500 clients each close their stream after its first token",
			inject: func(context.Context, *harness) (string, error) { return "", nil }, recover: noop, side: cutClients(500)},
		{name: "cut-200-then-400", what: "200 streams opened at once, each closed by its client after its first token; then 400 ordinary requests, 32 at a time",
			inject: func(context.Context, *harness) (string, error) { return "", nil }, recover: noop, side: cutThenServe(200, 400)},
		{name: "burst-3x", what: fmt.Sprintf("%d more looping clients: 3× the decode pool's %d in-flight slots", 3*capacity, capacity),
			inject: func(context.Context, *harness) (string, error) { return "", nil }, recover: noop, side: burst(3 * capacity)},
		{name: "combined", what: "at once: SIGKILL p0 and d0, SIGKILL redis-server, serve replica 1 down, 100 clients cutting, corrupt-transfer's links and fresh clients, watch-gap's drops; all restored together",
			inject: func(ctx context.Context, h *harness) (string, error) {
				h.setMark(ctx)
				note := h.kill(ctx, "p0") + "; " + h.kill(ctx, "d0")
				h.f.redis.kill()
				h.f.scheds[1].stop(15 * time.Second)
				h.corrupt(2)
				for _, l := range h.f.links {
					l.dropWatch()
				}
				return note, nil
			},
			recover: func(ctx context.Context, h *harness) error {
				h.corrupt(0)
				h.stopDrops()
				defer h.replayFresh(ctx)
				for _, step := range []func() error{
					h.f.startRedis,
					func() error { return h.f.restartWorker("p0", h.f.timeScale) },
					func() error { return h.f.restartWorker("d0", h.f.timeScale) },
					func() error { return h.f.startScheduler(ctx, 1) },
				} {
					if err := step(); err != nil {
						return err
					}
				}
				return nil
			},
			side: together(cutClients(100), freshClients(4, true), dropWatchEvery(2*time.Second)),
			check: func(ctx context.Context, h *harness, w *window) (string, error) {
				corrupt, _, _ := h.corruptNote(ctx, w)
				watch, _, _ := h.watchNote(ctx)
				again, _ := reopened("p0", "d0")(ctx, h, w)
				return corrupt + "; " + watch + "; " + again, nil
			}},
	}
}
