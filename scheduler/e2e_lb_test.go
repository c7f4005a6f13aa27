package scheduler_test

import (
	"context"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/batonllm/baton/bench/haproxy"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/llamacpp/llamatest"
)

// startLB starts HAProxy in front of the replicas at addrs.
func startLB(t *testing.T, addrs ...string) *haproxy.Proxy {
	t.Helper()
	bin, err := haproxy.Binary("")
	if err != nil {
		t.Fatal(err)
	}
	p, err := haproxy.Start(bin, func(bind string) string { return haproxy.Replicas(bind, addrs) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Stop)
	return p
}

// serveLlamaOn serves a scheduler with cfg over srvs (as llamaFleetWith)
// on addr, which another scheduler may have held a moment ago.
func serveLlamaOn(t *testing.T, cfg scheduler.Config, srvs []*llamatest.Server, addr string) *scheduler.Scheduler {
	t.Helper()
	cfg.Workers, cfg.Pool = llamaWorkers(srvs), fastPool()
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	s, err := scheduler.New(cfg, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- s.Serve(l) }()
	t.Cleanup(func() {
		s.Close()
		if err := <-served; err != nil {
			t.Errorf("Serve returned %v after Close, want nil", err)
		}
	})
	return s
}

// TestReplicasBehindHAProxy: two replicas that share straight, behind a
// real HAProxy (round robin, health checks on /readyz), route as one:
// each document's questions go to the engine that holds it, whichever
// replica takes them. A replica drained while clients keep sending
// through the balancer (a rolling restart) costs no request; its
// replacement on the same address, back in the balancer, learns what was
// decided meanwhile and routes each document where the other does.
func TestReplicasBehindHAProxy(t *testing.T) {
	srvs := llamaServers(t, 2)
	peers := freeAddrs(t, 2)
	cfg := func(i int) scheduler.Config {
		return scheduler.Config{Strategy: "kv_aware", DrainDelay: 3 * haproxy.CheckInterval, DrainTimeout: 10 * time.Second,
			Replicas: scheduler.ReplicasConfig{Peers: scheduler.ReplicaPeersConfig{Listen: peers[i], Addresses: peers}}}
	}
	a, aAddr := llamaFleetWith(t, cfg(0), srvs)
	b, bAddr := llamaFleetWith(t, cfg(1), srvs)
	hc := httpClient(t)
	connected := func(addrs ...string) {
		eventually(t, 10*time.Second, func() error {
			for _, addr := range addrs {
				if n, _ := metric(scrape(t, hc, addr), "baton_replica_sync_peers"); n != 1 {
					return fmt.Errorf("%s sends to %g peers, want 1", addr, n)
				}
			}
			return nil
		})
	}
	connected(aAddr, bAddr)
	lb := startLB(t, aAddr, bAddr)
	c := oaClient(t, lb.Addr)
	okCount := func(addr string) float64 {
		n, _ := metric(scrape(t, hc, addr), "baton_requests_total", `outcome="ok"`)
		return n
	}
	// asOne asks question q of every document through the balancer and
	// wants each on home's engine, found cached.
	asOne := func(home []served, q int) {
		t.Helper()
		for d, s := range askAll(t, c, srvs, q) {
			if s.worker != home[d].worker || !s.hit() {
				t.Errorf("question %d of document %d went to %s (cached %d of %d), question 0 to %s",
					q, d, s.worker, s.cached, s.prompt, home[d].worker)
			}
		}
	}

	home := askAll(t, c, srvs, 0)
	for q := 1; q <= 3; q++ {
		asOne(home, q)
	}
	if na, nb := okCount(aAddr), okCount(bAddr); na == 0 || nb == 0 {
		t.Fatalf("the balancer sent %g requests to one replica and %g to the other, want both used", na, nb)
	}

	// A rolling restart: b drains while four clients keep asking.
	var sent, failed atomic.Int64
	var mu sync.Mutex
	var errs []string
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for n := 0; ctx.Err() == nil; n++ {
				rctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				_, err := c.Chat.Completions.New(rctx, docQuestion((g+n)%docs, 100+4*n+g))
				cancel()
				sent.Add(1)
				if err != nil {
					failed.Add(1)
					mu.Lock()
					errs = append(errs, err.Error())
					mu.Unlock()
				}
			}
		})
	}
	waitSent := func(n int64) {
		eventually(t, 30*time.Second, func() error {
			if s := sent.Load(); s < n {
				return fmt.Errorf("%d requests ended, want %d", s, n)
			}
			return nil
		})
	}
	waitSent(8)
	before := sent.Load()
	b.Drain()
	during := sent.Load() - before
	waitSent(sent.Load() + 16) // after b is gone
	stop()
	wg.Wait()
	t.Logf("%d requests through the balancer: %d ended while b drained", sent.Load(), during)
	if f := failed.Load(); f > 0 {
		t.Errorf("%d of %d requests failed while a replica drained behind the balancer: %v", f, sent.Load(), errs)
	}

	// b's replacement, on b's address: the balancer's checks take it back
	// and it learns, from a, what was decided while it was away.
	aServed := okCount(aAddr)
	b2 := serveLlamaOn(t, cfg(1), srvs, bAddr)
	waitSlots(t, b2, llamaWorkers(srvs))
	connected(aAddr, bAddr)
	learned := a.Index.Len()
	eventually(t, 10*time.Second, func() error {
		if n := b2.Index.Len(); n < learned {
			return fmt.Errorf("the replacement's index holds %d blocks, a's %d", n, learned)
		}
		return nil
	})
	for q := 4; okCount(bAddr) == 0; q++ {
		if q > 40 {
			t.Fatalf("the replacement served nothing of %d questions through the balancer", (q-4)*docs)
		}
		asOne(home, q)
	}
	if okCount(aAddr) == aServed {
		t.Errorf("the balancer sent every question to the replacement")
	}
}
