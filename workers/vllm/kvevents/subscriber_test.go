package kvevents_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

// waitFor bounds every wait of these tests: the machine may be loaded.
const waitFor = 10 * time.Second

func newPublisher(t *testing.T, cfg kveventstest.PublisherConfig) *kveventstest.Publisher {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://127.0.0.1:0"
	}
	if cfg.Topic == "" {
		cfg.Topic = "kv@w1@m"
	}
	p, err := kveventstest.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func newSubscriber(t *testing.T, cfg kvevents.SubscriberConfig) *kvevents.Subscriber {
	t.Helper()
	if cfg.Topic == "" {
		cfg.Topic = "kv@w1@m"
	}
	cfg.RedialMin, cfg.RedialMax = 10*time.Millisecond, 50*time.Millisecond
	s, err := kvevents.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func waitSubscribed(t *testing.T, p *kveventstest.Publisher) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitFor)
	defer cancel()
	if err := p.WaitSubscribed(ctx); err != nil {
		t.Fatal(err)
	}
}

// recv returns the subscriber's next n messages.
func recv(t *testing.T, s *kvevents.Subscriber, n int) []kvevents.Message {
	t.Helper()
	var got []kvevents.Message
	timeout := time.After(waitFor)
	for len(got) < n {
		select {
		case m, ok := <-s.Messages():
			if !ok {
				t.Fatalf("messages closed after %d of %d", len(got), n)
			}
			got = append(got, m)
		case <-timeout:
			t.Fatalf("got %d messages of %d: %+v; stats %+v", len(got), n, got, s.Stats())
		}
	}
	return got
}

// summary renders messages as "seq", "kveventstest.TokenRun(replayed)", "reset@seq".
func summary(ms []kvevents.Message) string {
	var parts []string
	for _, m := range ms {
		switch {
		case m.Reset:
			parts = append(parts, fmt.Sprintf("reset@%d", m.Seq))
		case m.Replayed:
			parts = append(parts, fmt.Sprintf("%d(replayed)", m.Seq))
		default:
			parts = append(parts, fmt.Sprint(m.Seq))
		}
	}
	return strings.Join(parts, " ")
}

// stampBatch is a batch told apart by its timestamp.
func stampBatch(i int, hashes []kvevents.Hash) kvevents.Batch {
	return kvevents.Batch{TS: float64(i), HasDPRank: true, Events: []kvevents.Event{
		&kvevents.BlockStored{BlockHashes: hashes, TokenIDs: kveventstest.TokenRun(i, 2*len(hashes)), BlockSize: 2, Medium: "GPU"},
		&kvevents.BlockRemoved{BlockHashes: hashes[:1], Medium: "GPU"},
	}}
}

func publish(t *testing.T, p *kveventstest.Publisher, b kvevents.Batch) {
	t.Helper()
	if _, err := p.Publish(b); err != nil {
		t.Fatal(err)
	}
}

func drop(t *testing.T, p *kveventstest.Publisher, b kvevents.Batch) {
	t.Helper()
	if _, err := p.Drop(b); err != nil {
		t.Fatal(err)
	}
}

func TestSubscriberDeliversInOrder(t *testing.T) {
	for _, enc := range encodings {
		for name, hashes := range map[string][]kvevents.Hash{
			"int hashes":   kveventstest.IntHashes(1, 2),
			"bytes hashes": kveventstest.BytesHashes("sha256-a", "sha256-b"),
		} {
			t.Run(enc.String()+"/"+name, func(t *testing.T) {
				p := newPublisher(t, kveventstest.PublisherConfig{Encoding: enc})
				s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint()})
				waitSubscribed(t, p)
				var want []kvevents.Batch
				for i := range 5 {
					want = append(want, stampBatch(i, hashes))
					publish(t, p, want[i])
				}
				got := recv(t, s, 5)
				if sum := summary(got); sum != "0 1 2 3 4" {
					t.Errorf("messages %s, want 0 1 2 3 4", sum)
				}
				for i, m := range got {
					if diff := cmp.Diff(want[i], m.Batch, cmpHash); diff != "" {
						t.Errorf("batch %d (-want +got):\n%s", i, diff)
					}
				}
				if st := s.Stats(); st.Batches != 5 || st.Gaps != 0 {
					t.Errorf("stats %+v, want 5 batches and no gap", st)
				}
			})
		}
	}
}

// TestSubscriberReleasedMessages: a receiver that releases each message
// once done gets every batch intact, its memory reused for the next ones.
func TestSubscriberReleasedMessages(t *testing.T) {
	p := newPublisher(t, kveventstest.PublisherConfig{Encoding: kveventstest.TaggedMaps})
	s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint()})
	waitSubscribed(t, p)
	// One batch at a time, so that each is decoded after the last's
	// release, into its memory.
	for i := range 20 {
		want := stampBatch(i, kveventstest.IntHashes(uint64(3*i+1), uint64(3*i+2)))
		publish(t, p, want)
		m := recv(t, s, 1)[0]
		if diff := cmp.Diff(want, m.Batch, cmpHash); diff != "" {
			t.Fatalf("batch %d (-want +got):\n%s", i, diff)
		}
		m.Release()
	}
}

// TestSubscriberStreams: the streams the subscriber reads itself, over
// tcp and ipc, deliver every batch in order, on Messages or to Handle.
func TestSubscriberStreams(t *testing.T) {
	for _, tc := range []struct {
		name     string
		endpoint func(t *testing.T) string
		handle   bool
	}{
		{"tcp", func(*testing.T) string { return "tcp://" + freeAddr(t) }, false},
		{"ipc", func(t *testing.T) string { return "ipc://" + t.TempDir() + "/kv.sock" }, false},
		{"tcp/handle", func(*testing.T) string { return "tcp://" + freeAddr(t) }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ep := tc.endpoint(t)
			p := newPublisher(t, kveventstest.PublisherConfig{Endpoint: ep})
			cfg := kvevents.SubscriberConfig{Endpoint: ep}
			handled := make(chan kvevents.Message, 5)
			if tc.handle {
				cfg.Handle = func(m kvevents.Message) { handled <- m }
			}
			s := newSubscriber(t, cfg)
			waitSubscribed(t, p)
			var want []kvevents.Batch
			for i := range 5 {
				want = append(want, stampBatch(i, kveventstest.IntHashes(uint64(2*i+1), uint64(2*i+2))))
				publish(t, p, want[i])
			}
			var got []kvevents.Message
			if tc.handle {
				for range 5 {
					select {
					case m := <-handled:
						got = append(got, m)
					case <-time.After(waitFor):
						t.Fatalf("%d messages handled of 5", len(got))
					}
				}
			} else {
				got = recv(t, s, 5)
			}
			if sum := summary(got); sum != "0 1 2 3 4" {
				t.Errorf("messages %s, want 0 1 2 3 4", sum)
			}
			for i, m := range got {
				if diff := cmp.Diff(want[i], m.Batch, cmpHash); diff != "" {
					t.Errorf("batch %d (-want +got):\n%s", i, diff)
				}
			}
		})
	}
}

func TestSubscriberReplaysGaps(t *testing.T) {
	for _, topicFrame := range []bool{false, true} {
		t.Run(fmt.Sprintf("replay topic frame %v", topicFrame), func(t *testing.T) {
			p := newPublisher(t, kveventstest.PublisherConfig{Replay: true, ReplayTopic: topicFrame})
			s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint()})
			waitSubscribed(t, p)
			publish(t, p, stampBatch(0, kveventstest.IntHashes(1)))
			drop(t, p, stampBatch(1, kveventstest.IntHashes(2)))
			drop(t, p, stampBatch(2, kveventstest.IntHashes(3)))
			publish(t, p, stampBatch(3, kveventstest.IntHashes(4)))
			got := recv(t, s, 4)
			if sum, want := summary(got), "0 1(replayed) 2(replayed) 3"; sum != want {
				t.Errorf("messages %s, want %s", sum, want)
			}
			if diff := cmp.Diff(stampBatch(2, kveventstest.IntHashes(3)), got[2].Batch, cmpHash); diff != "" {
				t.Errorf("replayed batch (-want +got):\n%s", diff)
			}
			if st := s.Stats(); st.Gaps != 1 || st.Replays != 1 || st.Resets != 0 {
				t.Errorf("stats %+v, want a gap replayed", st)
			}
		})
	}
}

func TestSubscriberResetsUnreplayableGaps(t *testing.T) {
	t.Run("no replay socket", func(t *testing.T) {
		p := newPublisher(t, kveventstest.PublisherConfig{})
		s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint()})
		waitSubscribed(t, p)
		publish(t, p, stampBatch(0, kveventstest.IntHashes(1)))
		drop(t, p, stampBatch(1, kveventstest.IntHashes(2)))
		publish(t, p, stampBatch(2, kveventstest.IntHashes(3)))
		if sum, want := summary(recv(t, s, 3)), "0 reset@2 2"; sum != want {
			t.Errorf("messages %s, want %s", sum, want)
		}
		if st := s.Stats(); st.Gaps != 1 || st.Resets != 1 || st.ReplayFailures != 0 {
			t.Errorf("stats %+v, want a gap reset", st)
		}
	})
	t.Run("replay buffer lost the batches", func(t *testing.T) {
		p := newPublisher(t, kveventstest.PublisherConfig{Replay: true})
		s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint()})
		waitSubscribed(t, p)
		publish(t, p, stampBatch(0, kveventstest.IntHashes(1)))
		drop(t, p, stampBatch(1, kveventstest.IntHashes(2)))
		drop(t, p, stampBatch(2, kveventstest.IntHashes(3)))
		p.ForgetBefore(2)
		publish(t, p, stampBatch(3, kveventstest.IntHashes(4)))
		if sum, want := summary(recv(t, s, 3)), "0 reset@3 3"; sum != want {
			t.Errorf("messages %s, want %s", sum, want)
		}
		if st := s.Stats(); st.ReplayFailures != 1 || st.Resets != 1 {
			t.Errorf("stats %+v, want a failed replay and a reset", st)
		}
	})
	t.Run("replay socket down", func(t *testing.T) {
		p := newPublisher(t, kveventstest.PublisherConfig{})
		s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint(),
			ReplayEndpoint: "tcp://" + freeAddr(t), ReplayTimeout: 200 * time.Millisecond})
		waitSubscribed(t, p)
		publish(t, p, stampBatch(0, kveventstest.IntHashes(1)))
		drop(t, p, stampBatch(1, kveventstest.IntHashes(2)))
		publish(t, p, stampBatch(2, kveventstest.IntHashes(3)))
		if sum, want := summary(recv(t, s, 3)), "0 reset@2 2"; sum != want {
			t.Errorf("messages %s, want %s", sum, want)
		}
	})
}

func TestSubscriberReplaysFromStart(t *testing.T) {
	p := newPublisher(t, kveventstest.PublisherConfig{Replay: true})
	// Published before anyone subscribed: only the replay buffer has them.
	publish(t, p, stampBatch(0, kveventstest.IntHashes(1)))
	publish(t, p, stampBatch(1, kveventstest.IntHashes(2)))
	s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint(), ReplayEndpoint: p.ReplayEndpoint(),
		ReplayFromStart: true})
	waitSubscribed(t, p)
	publish(t, p, stampBatch(2, kveventstest.IntHashes(3)))
	if sum, want := summary(recv(t, s, 3)), "0(replayed) 1(replayed) 2"; sum != want {
		t.Errorf("messages %s, want %s", sum, want)
	}
}

// freeAddr returns a loopback address nothing listens on (for a moment).
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

func TestSubscriberReconnects(t *testing.T) {
	addr := "tcp://" + freeAddr(t)
	p := newPublisher(t, kveventstest.PublisherConfig{Endpoint: addr})
	s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: addr})
	waitSubscribed(t, p)
	for i := range 3 {
		publish(t, p, stampBatch(i, kveventstest.IntHashes(1)))
	}
	recv(t, s, 3)

	// The connection breaks; the same engine comes back where it was.
	p.Close()
	p = newPublisher(t, kveventstest.PublisherConfig{Endpoint: addr, FirstSeq: 3})
	waitSubscribed(t, p)
	publish(t, p, stampBatch(3, kveventstest.IntHashes(1)))
	if sum := summary(recv(t, s, 1)); sum != "3" {
		t.Errorf("after reconnecting: %s, want 3", sum)
	}

	// The engine restarts: its numbering starts again.
	p.Close()
	p = newPublisher(t, kveventstest.PublisherConfig{Endpoint: addr})
	waitSubscribed(t, p)
	publish(t, p, stampBatch(0, kveventstest.IntHashes(1)))
	if sum, want := summary(recv(t, s, 2)), "reset@0 0"; sum != want {
		t.Errorf("after a restart: %s, want %s", sum, want)
	}
	if st := s.Stats(); st.Reconnects < 2 || st.Restarts != 1 || st.Resets != 1 {
		t.Errorf("stats %+v, want 2 reconnects, a restart and its reset", st)
	}
}

func TestSubscriberBinds(t *testing.T) {
	addr := "tcp://" + freeAddr(t)
	s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: addr, Mode: kvevents.Bind})
	for round := range 2 {
		// The engine connects out, goes away and connects again.
		p := newPublisher(t, kveventstest.PublisherConfig{Endpoint: addr, Connect: true, FirstSeq: uint64(2 * round)})
		waitSubscribed(t, p)
		publish(t, p, stampBatch(2*round, kveventstest.IntHashes(1)))
		publish(t, p, stampBatch(2*round+1, kveventstest.IntHashes(1)))
		want := fmt.Sprintf("%d %d", 2*round, 2*round+1)
		if sum := summary(recv(t, s, 2)); sum != want {
			t.Errorf("round %d: %s, want %s", round, sum, want)
		}
		p.Close()
	}
}

func TestSubscriberSurvivesBadInput(t *testing.T) {
	p := newPublisher(t, kveventstest.PublisherConfig{})
	s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint()})
	waitSubscribed(t, p)
	topic := []byte("kv@w1@m")
	sendFrames := func(frames ...[]byte) {
		t.Helper()
		if err := p.SendFrames(frames...); err != nil {
			t.Fatal(err)
		}
	}
	publish(t, p, stampBatch(0, kveventstest.IntHashes(1)))
	sendFrames(topic, []byte{0, 0, 0, 0, 0, 0, 0, 9})                     // two frames
	sendFrames(topic, []byte{0, 0, 1}, []byte{0x90})                      // short sequence number
	sendFrames(topic, []byte{0, 0, 0, 0, 0, 0, 0, 9}, nil, nil)           // four frames
	if _, err := p.PublishPayload([]byte{0xc1, 0xff}, true); err != nil { // seq 1: malformed msgpack
		t.Fatal(err)
	}
	truncated := kveventstest.MustEncode(stampBatch(2, kveventstest.IntHashes(1)), kveventstest.ArrayLike)
	if _, err := p.PublishPayload(truncated[:len(truncated)/2], true); err != nil { // seq 2
		t.Fatal(err)
	}
	unknown := kvevents.Batch{TS: 3, Events: []kvevents.Event{kveventstest.Unknown{Name: "BlockTransferred"},
		&kvevents.AllBlocksCleared{}}}
	publish(t, p, unknown) // seq 3
	publish(t, p, stampBatch(4, kveventstest.IntHashes(1)))

	got := recv(t, s, 3)
	if sum, want := summary(got), "0 3 4"; sum != want {
		t.Errorf("messages %s, want %s", sum, want)
	}
	if !errors.Is(got[1].Err, kvevents.ErrUnknownTag) || len(got[1].Batch.Events) != 1 {
		t.Errorf("batch 3: err %v, %d events; want ErrUnknownTag and the cleared event", got[1].Err, len(got[1].Batch.Events))
	}
	st := s.Stats()
	if st.BadFrames != 3 || st.DecodeErrors != 2 || st.UnknownTags != 1 || st.Gaps != 0 || st.Resets != 0 {
		t.Errorf("stats %+v, want 3 bad frames, 2 decode errors, 1 unknown tag, no gap", st)
	}
}

func TestSubscriberClose(t *testing.T) {
	p := newPublisher(t, kveventstest.PublisherConfig{})
	s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint(), Buffer: 1})
	waitSubscribed(t, p)
	// Nobody reads: the subscriber blocks on its full channel, and Close
	// must still stop it.
	for i := range 20 {
		publish(t, p, stampBatch(i, kveventstest.IntHashes(1)))
	}
	// The first batch fills the channel; the second, counted, waits to
	// be sent.
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	timeout := time.After(waitFor)
	for s.Stats().Batches < 2 {
		select {
		case <-tick.C:
		case <-timeout:
			t.Fatalf("%d batches received, want 2", s.Stats().Batches)
		}
	}
	done := make(chan struct{})
	go func() {
		s.Close()
		s.Close() // idempotent
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(waitFor):
		t.Fatal("Close did not return")
	}
	for range s.Messages() {
	}
}

func TestSubscriberConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		cfg  kvevents.SubscriberConfig
		want string // in the error; "" for valid
	}{
		{"connect", kvevents.SubscriberConfig{Endpoint: "tcp://10.0.0.7:5557"}, ""},
		{"bind with replay", kvevents.SubscriberConfig{Endpoint: "tcp://*:5557", Mode: kvevents.Bind,
			ReplayEndpoint: "tcp://10.0.0.7:5558"}, ""},
		{"no endpoint", kvevents.SubscriberConfig{}, "endpoint"},
		{"no transport", kvevents.SubscriberConfig{Endpoint: "10.0.0.7:5557"}, "endpoint"},
		{"unknown transport", kvevents.SubscriberConfig{Endpoint: "udp://10.0.0.7:5557"}, "endpoint"},
		{"bad replay endpoint", kvevents.SubscriberConfig{Endpoint: "tcp://a:1", ReplayEndpoint: "a:2"}, "replay_endpoint"},
		{"unknown mode", kvevents.SubscriberConfig{Endpoint: "tcp://a:1", Mode: 7}, "mode"},
		{"backoff inverted", kvevents.SubscriberConfig{Endpoint: "tcp://a:1", RedialMin: time.Second,
			RedialMax: time.Millisecond}, "redial_min"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("Validate() = %v, want nil", err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
				t.Errorf("Validate() = %v, want an error naming %q", err, tt.want)
			}
			if tt.want != "" {
				if _, err := kvevents.New(tt.cfg); err == nil {
					t.Error("New accepted an invalid config")
				}
			}
		})
	}
}

// TestSubscriberDropsOtherRanks: a subscription to rank 1 delivers the
// batches stamped 1 and unstamped ones, and drops and counts those
// stamped with another rank, in both encodings.
func TestSubscriberDropsOtherRanks(t *testing.T) {
	for _, enc := range encodings {
		t.Run(enc.String(), func(t *testing.T) {
			p := newPublisher(t, kveventstest.PublisherConfig{Encoding: enc})
			s := newSubscriber(t, kvevents.SubscriberConfig{Endpoint: p.Endpoint(), DPRank: 1, CheckDPRank: true})
			waitSubscribed(t, p)
			for i, rank := range []int64{1, 0, 2, -1, 1} {
				b := stampBatch(i, kveventstest.IntHashes(uint64(i+1)))
				b.DPRank, b.HasDPRank = rank, rank >= 0
				publish(t, p, b)
			}
			got := recv(t, s, 3)
			if sum, want := summary(got), "0 3 4"; sum != want {
				t.Errorf("messages %s, want %s", sum, want)
			}
			if st := s.Stats(); st.WrongRank != 2 || st.Batches != 3 || st.Gaps != 0 || st.Resets != 0 {
				t.Errorf("stats %+v, want 2 of another rank, 3 batches, no gap", st)
			}
		})
	}
}
