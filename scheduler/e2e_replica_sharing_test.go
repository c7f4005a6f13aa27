package scheduler_test

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
	"github.com/batonllm/baton/workers/llamacpp/llamatest"
)

// sharingReplica starts a kv_aware scheduler over srvs that shares with
// the other replicas through the Redis at redisAddr.
func sharingReplica(t *testing.T, srvs []*llamatest.Server, redisAddr string) (*scheduler.Scheduler, string) {
	t.Helper()
	return llamaFleetWith(t, scheduler.Config{Strategy: "kv_aware",
		Replicas: scheduler.ReplicasConfig{Redis: kvstore.RedisConfig{Addr: redisAddr}}}, srvs)
}

// TestReplicasShareLearned: what one replica learns of engines that
// publish no KV events, by routing to them, reaches the other replica's
// index, which routes the same documents to the same engines; with the
// replicas' Redis killed, no request fails, and once it is back they
// share again.
func TestReplicasShareLearned(t *testing.T) {
	rs := redistest.Start(t)
	srvs := llamaServers(t, 2)
	a, aAddr := sharingReplica(t, srvs, rs.Addr())
	b, bAddr := sharingReplica(t, srvs, rs.Addr())
	ca, cb := oaClient(t, aAddr), oaClient(t, bAddr)
	hc := httpClient(t)

	if n := b.Index.Len(); n != 0 {
		t.Fatalf("b's index holds %d blocks before any request", n)
	}
	home := askAll(t, ca, srvs, 0)
	eventually(t, 10*time.Second, func() error {
		if na, nb := a.Index.Len(), b.Index.Len(); nb != na {
			return fmt.Errorf("b's index holds %d blocks, a's %d; b served nothing", nb, na)
		}
		return nil
	})
	for d, s := range askAll(t, cb, srvs, 1) {
		if s.worker != home[d].worker || !s.hit() {
			t.Errorf("document %d: b sent question 1 to %s (cached %d of %d), a sent question 0 to %s",
				d, s.worker, s.cached, s.prompt, home[d].worker)
		}
	}
	text := scrape(t, hc, bAddr)
	if got, _ := metric(text, "baton_replica_sync_entries_total", `direction="received"`); got < docs {
		t.Errorf("b received %g entries, want at least %d", got, docs)
	}

	// Redis lost: every request is served.
	rs.Stop()
	for q := 2; q < 4; q++ {
		askAll(t, ca, srvs, q)
		askAll(t, cb, srvs, q)
	}
	eventually(t, 10*time.Second, func() error {
		if up, _ := metric(scrape(t, hc, aAddr), "baton_replica_sync_up"); up != 0 {
			return fmt.Errorf("a's baton_replica_sync_up = %g with Redis down, want 0", up)
		}
		return nil
	})

	// Back, empty: a's decisions reach b again.
	rs.Restart()
	received := func() float64 {
		v, _ := metric(scrape(t, hc, bAddr), "baton_replica_sync_entries_total", `direction="received"`)
		return v
	}
	before := received()
	eventually(t, 20*time.Second, func() error {
		chat(t, ca, docQuestion(0, 9))
		if n := received(); n <= before {
			return fmt.Errorf("b received %g entries, as many as before Redis restarted", n)
		}
		return nil
	})
}

// TestReplicaKilledNewOneCatchesUp: a replica killed while the others
// share costs no request of theirs, and a replica that joins later
// replays what the others learned before it serves anything.
func TestReplicaKilledNewOneCatchesUp(t *testing.T) {
	rs := redistest.Start(t)
	srvs := llamaServers(t, 2)
	a, aAddr := sharingReplica(t, srvs, rs.Addr())
	b, bAddr := sharingReplica(t, srvs, rs.Addr())
	home := askAll(t, oaClient(t, aAddr), srvs, 0)
	eventually(t, 10*time.Second, func() error {
		if na, nb := a.Index.Len(), b.Index.Len(); nb != na {
			return fmt.Errorf("b's index holds %d blocks, a's %d", nb, na)
		}
		return nil
	})
	learned := a.Index.Len()

	a.Close() // killed: b goes on alone
	cb := oaClient(t, bAddr)
	for d, s := range askAll(t, cb, srvs, 1) {
		if s.worker != home[d].worker || !s.hit() {
			t.Errorf("document %d: b sent question 1 to %s (cached %d of %d) after a died; a had sent question 0 to %s",
				d, s.worker, s.cached, s.prompt, home[d].worker)
		}
	}

	c, _ := sharingReplica(t, srvs, rs.Addr())
	eventually(t, 10*time.Second, func() error {
		if n := c.Index.Len(); n < learned {
			return fmt.Errorf("the new replica's index holds %d blocks before serving, a had learned %d", n, learned)
		}
		return nil
	})
}

// freeAddrs returns n loopback addresses whose ports were free a moment
// ago.
func freeAddrs(t *testing.T, n int) []string {
	t.Helper()
	var addrs []string
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrs = append(addrs, l.Addr().String())
		defer l.Close()
	}
	return addrs
}

// TestReplicasSharePeers: replicas that send their decisions straight to
// each other (replicas.peers, no Redis) route as one, as through Redis;
// with Redis too, each decision comes both ways and is applied once; a
// replica that joins later learns what the others decided before it.
// Without Redis the replicas hold a shared secret (secret_file).
func TestReplicasSharePeers(t *testing.T) {
	for _, withRedis := range []bool{false, true} {
		t.Run(fmt.Sprintf("redis=%v", withRedis), func(t *testing.T) {
			srvs := llamaServers(t, 2)
			addrs := freeAddrs(t, 3) // the third joins later
			var rc kvstore.RedisConfig
			var secret string
			if withRedis {
				rc.Addr = redistest.Start(t).Addr()
			} else {
				secret = filepath.Join(t.TempDir(), "peers-secret")
				if err := os.WriteFile(secret, []byte("the replicas' shared secret\n"), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			replica := func(i int) (*scheduler.Scheduler, string) {
				return llamaFleetWith(t, scheduler.Config{Strategy: "kv_aware", Replicas: scheduler.ReplicasConfig{
					Redis: rc, Peers: scheduler.ReplicaPeersConfig{Listen: addrs[i], Addresses: addrs, SecretFile: secret}}}, srvs)
			}
			a, aAddr := replica(0)
			b, bAddr := replica(1)
			hc := httpClient(t)
			eventually(t, 10*time.Second, func() error {
				for _, addr := range []string{aAddr, bAddr} {
					if n, _ := metric(scrape(t, hc, addr), "baton_replica_sync_peers"); n != 1 {
						return fmt.Errorf("%s sends to %g peers, want 1", addr, n)
					}
				}
				return nil
			})
			home := askAll(t, oaClient(t, aAddr), srvs, 0)
			eventually(t, 10*time.Second, func() error {
				if na, nb := a.Index.Len(), b.Index.Len(); nb != na {
					return fmt.Errorf("b's index holds %d blocks, a's %d", nb, na)
				}
				return nil
			})
			for d, s := range askAll(t, oaClient(t, bAddr), srvs, 1) {
				if s.worker != home[d].worker || !s.hit() {
					t.Errorf("document %d: b sent question 1 to %s (cached %d of %d), a sent question 0 to %s",
						d, s.worker, s.cached, s.prompt, home[d].worker)
				}
			}
			via := []string{`direction="received"`}
			if !withRedis {
				via = append(via, `via="peer"`) // with Redis, each comes by the way that is first
			}
			if got, _ := metric(scrape(t, hc, bAddr), "baton_replica_sync_entries_total", via...); got < docs {
				t.Errorf("b received %g entries (%v), want at least %d", got, via, docs)
			}
			if withRedis {
				eventually(t, 10*time.Second, func() error {
					peer, _ := metric(scrape(t, hc, bAddr), "baton_replica_sync_entries_total", `direction="received"`)
					dups, _ := metric(scrape(t, hc, bAddr), "baton_replica_sync_duplicate_entries_total")
					sent, _ := metric(scrape(t, hc, aAddr), "baton_replica_sync_entries_total", `direction="sent"`, `via="redis"`)
					if dups+peer != 2*sent || sent == 0 {
						return fmt.Errorf("b applied %g entries and skipped %g second copies, of %g a sent each way", peer, dups, sent)
					}
					return nil
				})
			}
			learned := a.Index.Len()
			c, _ := replica(2)
			eventually(t, 20*time.Second, func() error {
				if n := c.Index.Len(); n < learned {
					return fmt.Errorf("the replica that joined holds %d blocks, a had learned %d", n, learned)
				}
				return nil
			})
		})
	}
}

// TestReplicasShareScrapes: three replicas sharing straight
// (replicas.peers) relay their scrapes of llama-servers' metrics to each
// other, so most of each replica's turns are skipped and the engines
// serve about one replica's scrapes (each replica still reads every
// engine's slots before it serves: llamaFleetWith waits for them). With
// share_load false, each replica scrapes every engine itself.
func TestReplicasShareScrapes(t *testing.T) {
	for _, share := range []bool{true, false} {
		t.Run(fmt.Sprintf("share_load=%v", share), func(t *testing.T) {
			srvs := llamaServers(t, 2)
			addrs := freeAddrs(t, 3)
			hc := httpClient(t)
			var reps []string
			for i := range addrs {
				_, addr := llamaFleetWith(t, scheduler.Config{Strategy: "kv_aware", Replicas: scheduler.ReplicasConfig{
					Peers: scheduler.ReplicaPeersConfig{Listen: addrs[i], Addresses: addrs, ShareLoad: &share}}}, srvs)
				reps = append(reps, addr)
			}
			// Past the replicas' start, when turns may collide, over
			// some hundred turns of the workers' 20ms interval.
			count := func() (ok, skipped, relayed float64) {
				for _, addr := range reps {
					text := scrape(t, hc, addr)
					o, _ := metric(text, "baton_engine_scrapes_total", `outcome="ok"`)
					s, _ := metric(text, "baton_engine_scrapes_total", `outcome="skipped"`)
					r, _ := metric(text, "baton_engine_scrapes_total", `outcome="relayed"`)
					ok, skipped, relayed = ok+o, skipped+s, relayed+r
				}
				return ok, skipped, relayed
			}
			eventually(t, 10*time.Second, func() error {
				if ok, skipped, _ := count(); ok+skipped < 200 {
					return fmt.Errorf("%g turns so far", ok+skipped)
				}
				return nil
			})
			ok0, skipped0, relayed0 := count()
			eventually(t, 20*time.Second, func() error {
				if ok, skipped, _ := count(); ok+skipped-ok0-skipped0 < 600 {
					return fmt.Errorf("%g turns since", ok+skipped-ok0-skipped0)
				}
				return nil
			})
			ok, skipped, relayed := count()
			ok, skipped, relayed = ok-ok0, skipped-skipped0, relayed-relayed0
			t.Logf("three replicas, two engines: %g scrapes, %g turns skipped, %g reports relayed", ok, skipped, relayed)
			switch {
			case share && ok > (ok+skipped)/2:
				t.Errorf("%g of %g turns scraped; want most skipped, each engine scraped by about one replica", ok, ok+skipped)
			case share && relayed < ok:
				t.Errorf("%g reports relayed of %g scrapes, each of which goes to two replicas", relayed, ok)
			case !share && (skipped > 0 || relayed > 0):
				t.Errorf("share_load false: %g turns skipped, %g reports relayed", skipped, relayed)
			}
		})
	}
}
