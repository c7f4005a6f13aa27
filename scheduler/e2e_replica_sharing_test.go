package scheduler_test

import (
	"fmt"
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
