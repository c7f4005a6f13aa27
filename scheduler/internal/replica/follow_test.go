package replica

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

// throughClient makes newPeer's Sharers send and follow through their
// go-redis client, as over TLS or to a cluster.
var throughClient bool

func viaClient(t *testing.T) {
	throughClient = true
	t.Cleanup(func() { throughClient = false })
}

// The tests of sharing, through the go-redis client rather than the
// Sharer's own connections.
func TestShareThroughClient(t *testing.T)       { viaClient(t); TestShare(t) }
func TestJoinReplaysThroughClient(t *testing.T) { viaClient(t); TestJoinReplays(t) }
func TestRedisLostThroughClient(t *testing.T)   { viaClient(t); TestRedisLost(t) }

// TestPollAppliesOnCaller: what has reached the follower's connection is
// applied by the goroutine that polls, with no other reading it; the
// follower then asks for the next messages and applies those too.
func TestPollAppliesOnCaller(t *testing.T) {
	srv := redistest.Start(t)
	a := newPeer(t, srv.Addr(), "a", nil)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	t.Cleanup(func() { client.Close() })
	var applied []Entry
	s := &Sharer{cfg: Config{Client: client, ID: "b", Stream: "test:" + t.Name(), Apply: func(e Entry) { applied = append(applied, e) }}.withDefaults(), origins: map[string]*origin{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	defer s.cancel()
	f := newFollower(s, client)
	if f == nil {
		t.Skip("no connections of the Sharer's own on this system")
	}
	s.f = f
	conn, _, err := f.dial("0-0")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	want := []Entry{{Worker: "w0", Keys: []uint64{1, 2, 3}}, {Worker: "w1", Keys: []uint64{4}}}
	for i, e := range want {
		a.Publish(e)
		deadline := time.Now().Add(10 * time.Second)
		for len(applied) < i+1 && time.Now().Before(deadline) {
			s.Poll()
			time.Sleep(time.Millisecond)
		}
	}
	if diff := cmp.Diff(want, applied, ignoreSeq); diff != "" {
		t.Errorf("applied by polling (-want +got):\n%s", diff)
	}
}

// TestSharePasswordDB: the Sharer's own connections authenticate and
// select the client's database, as its go-redis client does.
func TestSharePasswordDB(t *testing.T) {
	srv := redistest.StartWith(t, redistest.Options{Password: "s3cret"})
	mk := func(id string) *peer {
		client := redis.NewClient(&redis.Options{Addr: srv.Addr(), Password: "s3cret", DB: 3})
		t.Cleanup(func() { client.Close() })
		p := &peer{applied: make(chan Entry, 16), dropped: map[string]int{}}
		s, err := New(Config{Client: client, ID: id, Stream: "test:" + t.Name(), Observer: p, Apply: func(e Entry) { p.applied <- e }})
		if err != nil {
			t.Fatal(err)
		}
		if s.f == nil && ownConnections {
			t.Fatal("no follower of a plain TCP client with a password")
		}
		t.Cleanup(func() { s.Close() })
		p.Sharer = s
		return p
	}
	a, b := mk("a"), mk("b")
	b.none(t, a)
	e := Entry{Worker: "w", Keys: []uint64{7, 8}}
	a.Publish(e)
	b.expect(t, e)
	check := redis.NewClient(&redis.Options{Addr: srv.Addr(), Password: "s3cret", DB: 3})
	defer check.Close()
	if n, err := check.XLen(context.Background(), "test:"+t.Name()).Result(); err != nil || n < 2 {
		t.Errorf("the stream in database 3 holds %d messages (%v), want 2 or more", n, err)
	}
	if d, _, _ := a.stats(); len(d) > 0 {
		t.Errorf("a dropped %v", d)
	}
}

// FuzzParseRESP: any bytes parse to a value, a wait for more, or an
// error; never a panic, nor more bytes than given.
func FuzzParseRESP(f *testing.F) {
	f.Add([]byte("*1\r\n*2\r\n$3\r\nkey\r\n*1\r\n*2\r\n$3\r\n1-0\r\n*2\r\n$1\r\nr\r\n$1\r\na\r\n"))
	f.Add([]byte("*-1\r\n"))
	f.Add([]byte("-ERR wrong\r\n"))
	f.Add([]byte("$5\r\nab"))
	f.Add([]byte(":12\r\n+OK\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		_, n, err := parseRESP(b)
		if n < 0 || n > len(b) || (err != nil && n != 0) {
			t.Fatalf("parseRESP(%q) took %d bytes, err %v", b, n, err)
		}
	})
}

// A Publish whose own write finds its deadline passed before a byte is
// written (its goroutine not run in time, on a busy machine) keeps the
// connection and hands the message to the sender: the other replica gets
// every message, none is counted lost, and sharing never goes down.
func TestPublishLateKeepsConnection(t *testing.T) {
	addr := redistest.Start(t).Addr()
	a := newPeer(t, addr, "a", func(c *Config) { c.publishWait = -time.Second })
	b := newPeer(t, addr, "b", nil)
	b.none(t, a)
	var want []Entry
	for i := range uint64(200) {
		e := Entry{Worker: fmt.Sprint("w", i%3), Keys: []uint64{i, i + 1}}
		want = append(want, e)
		a.Publish(e)
	}
	b.expect(t, want...)
	dropped, _, ups := a.stats()
	for _, up := range ups {
		if !up {
			t.Errorf("a's sharing went down (ups %v)", ups)
			break
		}
	}
	if len(dropped) != 0 {
		t.Errorf("a dropped %v, want nothing", dropped)
	}
}

// TestDialSaysWhyRedisRefused: a Redis that turns the connection away
// is an error at the dial that carries its reason, whether the server
// closed before or after the client's first write; not a connection
// that breaks on the first message with a broken pipe.
func TestDialSaysWhyRedisRefused(t *testing.T) {
	addr := redistest.ProtectedMode(t)
	for i := range 50 {
		conn, err := dialRedis(t.Context(), addr, nil, 0)
		if err == nil {
			conn.Close()
			t.Fatalf("dial %d: connected to a Redis that refuses", i)
		}
		if !strings.Contains(err.Error(), "DENIED Redis is running in protected mode") {
			t.Fatalf("dial %d: %v, want Redis's reason", i, err)
		}
	}
}

// TestSharerLogsWhyRedisRefused: the one line a Sharer logs when Redis is
// unreachable names Redis's reason.
func TestSharerLogsWhyRedisRefused(t *testing.T) {
	if !ownConnections {
		t.Skip("the go-redis client's own handshake reports the reason")
	}
	addr := redistest.ProtectedMode(t)
	logs := make(chan string, 16)
	client := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	t.Cleanup(func() { client.Close() })
	s, err := New(Config{Client: client, ID: "a", Stream: "test:" + t.Name(),
		Logger: slog.New(&lineHandler{lines: logs}), Apply: func(Entry) {}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	s.Publish(Entry{Worker: "w", Keys: []uint64{1}})
	select {
	case line := <-logs:
		if !strings.Contains(line, "redis unreachable") || !strings.Contains(line, "protected mode") {
			t.Errorf("logged %q, want Redis unreachable and its reason", line)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("nothing logged of a Redis that refuses")
	}
}

// lineHandler sends each record, with its attributes, as a line.
type lineHandler struct{ lines chan string }

func (h *lineHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *lineHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *lineHandler) WithGroup(string) slog.Handler            { return h }
func (h *lineHandler) Handle(_ context.Context, r slog.Record) error {
	line := r.Message
	r.Attrs(func(a slog.Attr) bool {
		line += " " + a.String()
		return true
	})
	select {
	case h.lines <- line:
	default:
	}
	return nil
}
