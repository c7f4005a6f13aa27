// Package replica shares what each scheduler replica commits with the
// other replicas in front of the same fleet, through a Redis stream: the
// blocks a replica's decisions predict a worker will hold reach every
// other replica within milliseconds, and are applied to its KV index as
// its own predictions are. Sharing is off the hot path and loss-tolerant:
// Publish never blocks (a full queue drops, counted), a message Redis did
// not take is dropped (counted, and seen by the others as a gap in the
// sender's sequence numbers), and while Redis is down every replica keeps
// routing on what it knows alone. The stream is capped (MaxLen), which
// bounds Redis's memory; a replica that joins replays its newest
// messages (Replay) before it follows the rest.
package replica

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Entry is one committed decision: Worker will hold the blocks Keys
// (chained block keys, in order).
type Entry struct {
	Worker string
	Keys   []uint64
	// Pending is how many of Keys the deciding replica found the worker
	// without: the request's prefill. Negative: unknown (a message of the
	// first format).
	Pending int
	// At is when the decision was made, in Unix nanoseconds on the
	// deciding replica's clock; 0 with Pending unknown.
	At int64
}

// Config configures a Sharer. The zero value of every field but Client and
// Apply means its default.
type Config struct {
	// Client is the Redis the replicas share (the shared KV tier's server
	// will do). Required. The Sharer does not close it.
	Client redis.UniversalClient
	// Stream is the Redis stream's key. Default "baton:replica:commits".
	// Replicas in front of different fleets need different streams.
	Stream string
	// ID names this replica in its messages, so that it skips its own.
	// Default: 16 random hex digits.
	ID string
	// MaxLen caps the stream (approximately, as XADD MAXLEN ~ does).
	// Default 10,000 messages: at a message a millisecond, 10 s of
	// history.
	MaxLen int64
	// Replay is how many of the newest messages a replica applies when
	// it starts. Default 1,000; negative: none.
	Replay int64
	// MaxBatch is the most entries one message carries. Default 256.
	MaxBatch int
	// Queue is how many entries wait to be sent at most; Publish drops
	// past it. Default 8,192: four seconds at 2,000 commits a second.
	Queue int
	// Apply applies an entry another replica committed. It is called
	// from the Sharer's reading goroutine, one entry at a time, and must
	// not block for long. Required.
	Apply func(Entry)
	// Logger hears one line each time Redis becomes unreachable or
	// reachable again. Default: discarded.
	Logger *slog.Logger
	// Observer hears what the Sharer does, for metrics. Default: none.
	Observer Observer

	// throughClient has the Sharer send and follow through Client even
	// where it could reach the server itself (tests).
	throughClient bool
	// publishWait bounds Publish's own write; default the constant
	// publishWait (tests: a negative one has each of those writes find
	// its deadline passed, as on a machine too busy to run it in time).
	publishWait time.Duration
}

// Observer hears what a Sharer does. Its methods are called from the
// Sharer's goroutines and from Publish's caller; they must not block.
type Observer interface {
	// Sent: a message of n entries and the given bytes was added to the
	// stream.
	Sent(entries, bytes int)
	// Received: a message of another replica's, of n entries and bytes,
	// was applied lag after the first of its entries was published: how
	// long the others routed without knowing of that decision.
	Received(entries, bytes int, lag time.Duration)
	// Dropped: n entries were not shared, for reason "queue_full" or
	// "redis_error".
	Dropped(reason string, n int)
	// Gap: n messages of another replica's were missed (lost before
	// Redis, or trimmed from the stream before they were read).
	Gap(n int)
	// Up: Redis became reachable (true) or unreachable (false).
	Up(up bool)
}

const (
	defaultStream   = "baton:replica:commits"
	defaultMaxLen   = 10_000
	defaultReplay   = 1_000
	defaultMaxBatch = 256
	defaultQueue    = 8_192
	// readBlock is how long one XREAD waits for a message; Close waits
	// for it at most.
	readBlock = 500 * time.Millisecond
	// callTimeout bounds one XADD.
	callTimeout = time.Second
	// retryMin and retryMax bound the backoff while Redis is down.
	retryMin = 50 * time.Millisecond
	retryMax = 2 * time.Second
	// maxOrigins bounds the senders whose sequence numbers are tracked;
	// past it the least recently heard is forgotten.
	maxOrigins = 1024
)

func (c Config) withDefaults() Config {
	if c.Stream == "" {
		c.Stream = defaultStream
	}
	if c.publishWait == 0 {
		c.publishWait = publishWait
	}
	if c.ID == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		c.ID = hex.EncodeToString(b[:])
	}
	if c.MaxLen <= 0 {
		c.MaxLen = defaultMaxLen
	}
	if c.Replay == 0 {
		c.Replay = defaultReplay
	}
	if c.MaxBatch <= 0 {
		c.MaxBatch = defaultMaxBatch
	}
	if c.Queue <= 0 {
		c.Queue = defaultQueue
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Observer == nil {
		c.Observer = nopObserver{}
	}
	return c
}

// queued is an entry waiting to be sent, published at (Unix
// nanoseconds).
type queued struct {
	e  Entry
	at int64
}

// Sharer publishes this replica's committed entries and applies the other
// replicas'. New starts its two goroutines; Close stops them.
type Sharer struct {
	cfg    Config
	queue  chan queued
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	upMu sync.Mutex
	up   bool // as last reported

	f    *follower // nil: the stream is followed through Client
	pipe pipe      // with f, the sender's connection
}

// New starts a Sharer.
func New(cfg Config) (*Sharer, error) {
	if cfg.Client == nil {
		return nil, errors.New("replica: a Redis client is required")
	}
	if cfg.Apply == nil {
		return nil, errors.New("replica: Apply is required")
	}
	cfg = cfg.withDefaults()
	s := &Sharer{cfg: cfg, queue: make(chan queued, cfg.Queue), up: true}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if !cfg.throughClient {
		s.f = newFollower(s, cfg.Client)
	}
	s.wg.Add(2)
	if s.f != nil {
		go s.sendPiped()
	} else {
		go s.send()
	}
	go s.read()
	return s, nil
}

// ID is the replica's id in its messages.
func (s *Sharer) ID() string { return s.cfg.ID }

// Publish shares e: with a connection of the Sharer's own (see
// follower) it writes e's message at once when nothing waits to be sent,
// for at most publishWait; otherwise it queues e for the sending
// goroutine. It copies what it keeps of e.Keys and never blocks for
// long. An entry without keys is not shared.
func (s *Sharer) Publish(e Entry) {
	if len(e.Keys) == 0 || e.Worker == "" {
		return
	}
	now := time.Now().UnixNano()
	if s.f != nil && len(s.queue) == 0 && s.pipe.mu.TryLock() {
		// Written now, on the decision's goroutine: the sender's would
		// wait to be scheduled, which in a burst takes milliseconds.
		one := [1]Entry{e}
		ok := s.write(one[:], now, s.cfg.publishWait, false)
		s.pipe.mu.Unlock()
		if ok {
			return
		}
	}
	e.Keys = append([]uint64(nil), e.Keys...)
	select {
	case s.queue <- queued{e, now}:
	default:
		s.cfg.Observer.Dropped("queue_full", 1)
	}
}

// Poll applies, on the calling goroutine, the other replicas' messages
// that have reached this replica and wait to be read; it never waits.
// A scheduler calls it before each decision: while a burst of requests
// keeps every processor busy, the goroutine that reads the stream may
// not run for milliseconds, and decisions made meanwhile would not know
// of the others' latest. Without a connection it reads itself (Redis
// over TLS, a cluster) it does nothing.
func (s *Sharer) Poll() {
	if s.f != nil {
		s.f.poll()
	}
}

// Close stops sharing; entries still queued are dropped. It is idempotent.
func (s *Sharer) Close() error {
	s.cancel()
	s.wg.Wait()
	return nil
}

// setUp records whether Redis answered, logging and reporting a change.
func (s *Sharer) setUp(up bool, err error) {
	s.upMu.Lock()
	changed := s.up != up
	s.up = up
	s.upMu.Unlock()
	if !changed {
		return
	}
	s.cfg.Observer.Up(up)
	if up {
		s.cfg.Logger.Info("replica sharing: redis reachable again", "stream", s.cfg.Stream)
	} else {
		s.cfg.Logger.Warn("replica sharing: redis unreachable; routing on this replica's own knowledge", "stream", s.cfg.Stream, "err", err)
	}
}

// send sends each entry as soon as the message before it was added,
// with every entry queued meanwhile (up to MaxBatch a message): batches
// fill while Redis answers, never by waiting, so that in a burst of
// decisions a fraction of a millisecond apart the others hear of each
// one within an XADD and an XREAD.
func (s *Sharer) send() {
	defer s.wg.Done()
	var seq uint64
	batch := make([]Entry, 0, s.cfg.MaxBatch)
	var first int64 // when the batch's first entry was published
	var buf []byte
	flush := func() {
		seq++
		buf = encode(buf[:0], batch)
		ctx, cancel := context.WithTimeout(s.ctx, callTimeout)
		err := s.cfg.Client.XAdd(ctx, &redis.XAddArgs{
			Stream: s.cfg.Stream, MaxLen: s.cfg.MaxLen, Approx: true,
			Values: []any{"r", s.cfg.ID, "s", seq, "t", first, "d", buf},
		}).Err()
		cancel()
		switch {
		case err == nil:
			s.cfg.Observer.Sent(len(batch), len(buf))
			s.setUp(true, nil)
		case s.ctx.Err() != nil:
		default:
			// The others see the gap in seq.
			s.cfg.Observer.Dropped("redis_error", len(batch))
			s.setUp(false, err)
		}
		clear(batch)
		batch = batch[:0]
	}
	for {
		select {
		case <-s.ctx.Done():
			return
		case q := <-s.queue:
			batch, first = append(batch, q.e), q.at
		}
		batch = s.fill(batch)
		flush()
	}
}

// fill appends to batch the entries queued, up to MaxBatch, without
// waiting for more.
func (s *Sharer) fill(batch []Entry) []Entry {
	for len(batch) < s.cfg.MaxBatch {
		select {
		case q := <-s.queue:
			batch = append(batch, q.e)
		default:
			return batch
		}
	}
	return batch
}

// origin is what the reader knows of another replica's messages.
type origin struct {
	seq  uint64
	seen time.Time
}

// read applies the other replicas' messages: first the newest Replay of
// them, then each as it comes.
func (s *Sharer) read() {
	defer s.wg.Done()
	origins := make(map[string]*origin)
	last := ""
	backoff := retryMin
	for s.ctx.Err() == nil {
		var err error
		switch {
		case last == "":
			last, err = s.replay(origins)
		case s.f != nil:
			last, err = s.f.follow(origins, last)
		default:
			last, err = s.follow(origins, last)
		}
		if err == nil {
			backoff = retryMin
			continue
		}
		if s.ctx.Err() != nil {
			return
		}
		s.setUp(false, err)
		select {
		case <-s.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, retryMax)
	}
}

// replay applies the newest Replay messages and returns the id to follow
// the stream from.
func (s *Sharer) replay(origins map[string]*origin) (string, error) {
	if s.cfg.Replay < 0 {
		return "$", nil
	}
	msgs, err := s.cfg.Client.XRevRangeN(s.ctx, s.cfg.Stream, "+", "-", s.cfg.Replay).Result()
	if err != nil {
		return "", err
	}
	s.setUp(true, nil)
	if len(msgs) == 0 {
		return "0-0", nil
	}
	for i := len(msgs) - 1; i >= 0; i-- {
		s.apply(msgs[i], origins, false)
	}
	return msgs[0].ID, nil
}

// follow waits for the messages after last, applies them and returns the
// id of the newest.
func (s *Sharer) follow(origins map[string]*origin, last string) (string, error) {
	res, err := s.cfg.Client.XRead(s.ctx, &redis.XReadArgs{
		Streams: []string{s.cfg.Stream, last}, Count: 512, Block: readBlock,
	}).Result()
	if errors.Is(err, redis.Nil) {
		s.setUp(true, nil)
		return last, nil // nothing new
	}
	if err != nil {
		return last, err
	}
	s.setUp(true, nil)
	for _, st := range res {
		for _, m := range st.Messages {
			s.apply(m, origins, true)
			last = m.ID
		}
	}
	return last, nil
}

// apply applies m unless this replica sent it, counting gaps in its
// sender's sequence when gaps is true.
func (s *Sharer) apply(m redis.XMessage, origins map[string]*origin, gaps bool) {
	from, _ := m.Values["r"].(string)
	s.applyFields(m.ID, from, str(m.Values["s"]), str(m.Values["t"]), []byte(str(m.Values["d"])), origins, gaps)
}

// applyFields is apply of a message's fields: its sender, sequence
// number, first commit's time and data, which it does not keep.
func (s *Sharer) applyFields(id, from, sq, t string, data []byte, origins map[string]*origin, gaps bool) {
	if from == s.cfg.ID || from == "" {
		return
	}
	seq, _ := strconv.ParseUint(sq, 10, 64)
	published, _ := strconv.ParseInt(t, 10, 64)
	now := time.Now()
	o := origins[from]
	switch {
	case o == nil:
		if len(origins) >= maxOrigins {
			forgetOldest(origins)
		}
		origins[from] = &origin{seq: seq, seen: now}
	default:
		if gaps && seq > o.seq+1 {
			s.cfg.Observer.Gap(int(seq - o.seq - 1))
		}
		if seq > o.seq {
			o.seq = seq
		}
		o.seen = now
	}
	n, err := decode(data, s.cfg.Apply)
	if err != nil {
		s.cfg.Logger.Debug("replica sharing: bad message skipped", "id", id, "from", from, "err", err)
		return
	}
	s.cfg.Observer.Received(n, len(data), now.Sub(time.Unix(0, published)))
}

func forgetOldest(origins map[string]*origin) {
	var oldest string
	var at time.Time
	for id, o := range origins {
		if oldest == "" || o.seen.Before(at) {
			oldest, at = id, o.seen
		}
	}
	delete(origins, oldest)
}

func str(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case nil:
		return ""
	}
	return fmt.Sprint(v)
}

// The first byte of every message's data: formatKeys's entries carry a
// worker and its keys; formatPending's, also the request's prefill and the
// decision's time. encode writes formatPending; decode reads both.
const (
	formatKeys    = 1
	formatPending = 2
)

// encode appends the entries to b: a version byte, then per entry the
// worker's name (uvarint length, bytes), its keys (uvarint count, 8 bytes
// each, little endian: block keys are uniform 64-bit hashes, which
// varints would lengthen), its pending blocks plus one (uvarint; 0:
// unknown) and the decision's time (uvarint Unix nanoseconds).
func encode(b []byte, entries []Entry) []byte {
	b = append(b, formatPending)
	for _, e := range entries {
		b = binary.AppendUvarint(b, uint64(len(e.Worker)))
		b = append(b, e.Worker...)
		b = binary.AppendUvarint(b, uint64(len(e.Keys)))
		for _, k := range e.Keys {
			b = binary.LittleEndian.AppendUint64(b, k)
		}
		b = binary.AppendUvarint(b, uint64(max(e.Pending+1, 0)))
		b = binary.AppendUvarint(b, uint64(max(e.At, 0)))
	}
	return b
}

// maxKeys bounds the keys of one decoded entry: a million blocks is a
// prompt of 16 million tokens.
const maxKeys = 1 << 20

// decode calls apply with each entry of b and returns how many there
// were. A malformed message is an error; the entries before the fault
// were applied.
func decode(b []byte, apply func(Entry)) (int, error) {
	if len(b) == 0 || b[0] != formatKeys && b[0] != formatPending {
		return 0, errors.New("unknown format")
	}
	pending := b[0] == formatPending
	b = b[1:]
	n := 0
	// uvarint reads one uvarint of at most limit off b.
	uvarint := func(limit uint64) (uint64, bool) {
		v, k := binary.Uvarint(b)
		if k <= 0 || v > limit {
			return 0, false
		}
		b = b[k:]
		return v, true
	}
	for len(b) > 0 {
		l, ok := uvarint(uint64(len(b)))
		if !ok || l > uint64(len(b)) {
			return n, errors.New("truncated worker name")
		}
		worker := string(b[:l])
		b = b[l:]
		c, ok := uvarint(maxKeys)
		if !ok || c*8 > uint64(len(b)) {
			return n, errors.New("truncated keys")
		}
		keys := make([]uint64, c)
		for i := range keys {
			keys[i] = binary.LittleEndian.Uint64(b[8*i:])
		}
		b = b[8*c:]
		e := Entry{Worker: worker, Keys: keys, Pending: -1}
		if pending {
			p, ok1 := uvarint(c + 1)
			at, ok2 := uvarint(math.MaxInt64)
			if !ok1 || !ok2 {
				return n, errors.New("bad pending blocks or decision time")
			}
			if p > 0 {
				e.Pending, e.At = int(p)-1, int64(at)
			}
		}
		apply(e)
		n++
	}
	return n, nil
}

type nopObserver struct{}

func (nopObserver) Sent(int, int)                    {}
func (nopObserver) Received(int, int, time.Duration) {}
func (nopObserver) Dropped(string, int)              {}
func (nopObserver) Gap(int)                          {}
func (nopObserver) Up(bool)                          {}
