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
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/transfer/kvstore"
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
	// Seq numbers the deciding replica's entries from 1, as Publish sets
	// it: an entry that reaches a replica both straight from its sender
	// and through the stream is applied once. 0 in messages of the
	// formats before formatSeq.
	Seq uint64
}

// Config configures a Sharer. The zero value of every field but Apply, and
// Client or Listen, means its default.
type Config struct {
	// Client is the Redis the replicas share (the shared KV tier's server
	// will do): a stream every replica adds its decisions to and follows,
	// from which a replica that starts replays the newest. Required
	// unless Listen is set. The Sharer does not close it.
	Client redis.UniversalClient
	// Listen, when set, is the host:port where the Sharer takes the
	// other replicas' decisions straight from them (peers.go), one hop
	// instead of two; SetPeers says where the others listen. With Client
	// too, every decision goes both ways and is applied once, whichever
	// comes first.
	Listen string
	// Secret, when set, is what the replicas must all hold to send each
	// other decisions straight: a replica that cannot prove it holds it
	// is neither sent to nor read from (peers.go). Nil: any replica that
	// reaches Listen and names the same stream is taken at its word.
	Secret []byte
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
	// it starts and, with Listen, how many of its own newest decisions it
	// sends a peer as it connects to it (which then learns what was
	// decided before it started, without Redis too). Default 1,000;
	// negative: none.
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
	// ApplyLoad, if set, applies an engine's load report another replica
	// relayed (PublishLoad). It is called from the goroutine reading that
	// replica's connection, or from Poll's caller, and must not block.
	ApplyLoad func(Load)
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
	// stream (via ViaRedis) or written to a peer (ViaPeer).
	Sent(via string, entries, bytes int)
	// Received: a message of another replica's, of n entries not applied
	// before and the given bytes, came via ViaRedis or ViaPeer and was
	// applied lag after the first of its entries was published: how long
	// this replica routed without knowing of that decision.
	Received(via string, entries, bytes int, lag time.Duration)
	// Dropped: n entries were not shared, for reason "queue_full" or
	// "redis_error" (through the stream), or "peer_error" (to one peer).
	Dropped(reason string, n int)
	// Gap: n messages of another replica's were missed from the stream
	// (lost before Redis, or trimmed before they were read); their
	// entries may have come straight from it, which Lost tells.
	Gap(n int)
	// Up: Redis became reachable (true) or unreachable (false).
	Up(up bool)
	// Peers: n other replicas take this one's decisions straight from
	// it now.
	Peers(n int)
	// Duplicates: n entries came a second way and were not applied
	// again.
	Duplicates(n int)
	// Refused: a connection to Listen was closed before anything it
	// sent was applied, for reason RefusedGreeting, RefusedStream or
	// RefusedSecret.
	Refused(reason string)
	// Lost: n decisions of another replica's came neither way (through
	// the stream nor straight), found once 4,096 newer decisions of the
	// same replica have: what Gap counts of the stream alone, less what
	// the peers brought.
	Lost(n int)
	// Loads: a load report of the given bytes was relayed to a peer
	// (direction "sent") or taken from one ("received").
	Loads(direction string, n, bytes int)
	// Unseen: a decision of another replica's, made before this
	// replica's latest Poll (its latest pick), was applied after it: that
	// pick decided without it, made by then d before.
	Unseen(d time.Duration)
}

// Why a connection to Listen was refused, for Observer.
const (
	RefusedGreeting = "greeting" // not a replica's greeting, or none in time
	RefusedStream   = "stream"   // a replica of another fleet (stream)
	RefusedSecret   = "secret"   // no proof of the shared secret
)

// The ways a message comes, for Observer.
const (
	ViaRedis = "redis"
	ViaPeer  = "peer"
)

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

	entrySeq  atomic.Uint64 // the last Entry.Seq given
	originsMu sync.Mutex
	origins   map[string]*origin // what is known of each other replica's messages

	peers *peers // nil without Listen

	// polled is when Poll last returned (Unix nanoseconds): a decision
	// made elsewhere before it and applied after it was not known to the
	// pick that followed (Observer.Unseen).
	polled atomic.Int64
}

// New starts a Sharer.
func New(cfg Config) (*Sharer, error) {
	if cfg.Client == nil && cfg.Listen == "" {
		return nil, errors.New("replica: a Redis client or a peer listener is required")
	}
	if cfg.Apply == nil {
		return nil, errors.New("replica: Apply is required")
	}
	cfg = cfg.withDefaults()
	s := &Sharer{cfg: cfg, queue: make(chan queued, cfg.Queue), up: true, origins: make(map[string]*origin)}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if cfg.Listen != "" {
		var err error
		if s.peers, err = listenPeers(s); err != nil {
			s.cancel()
			return nil, err
		}
	}
	if cfg.Client == nil {
		return s, nil
	}
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
	e.Seq = s.entrySeq.Add(1)
	now := time.Now().UnixNano()
	if s.peers != nil {
		s.peers.publish(e, now)
	}
	if s.cfg.Client == nil {
		return
	}
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
	if s.peers != nil {
		s.peers.poll()
	}
	s.polled.Store(time.Now().UnixNano())
}

// SetPeers says where the other replicas listen (host:port each; this
// replica's own address may be among them, and is recognised): the
// Sharer sends each of its decisions to each of them as it commits,
// reconnecting to one that goes away, and stops sending to those no
// longer listed. Without Listen it does nothing.
func (s *Sharer) SetPeers(addrs []string) {
	if s.peers != nil {
		s.peers.set(addrs)
	}
}

// ListenAddr is the address the Sharer takes the others' decisions on
// (Listen's, with the port chosen if it was 0), or "" without Listen.
func (s *Sharer) ListenAddr() string {
	if s.peers == nil {
		return ""
	}
	return s.peers.ln.Addr().String()
}

// Close stops sharing; entries still queued are dropped. It is idempotent.
func (s *Sharer) Close() error {
	s.cancel()
	if s.peers != nil {
		s.peers.close()
	}
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
			s.cfg.Observer.Sent(ViaRedis, len(batch), len(buf))
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

// origin is what is known of another replica's messages and entries.
type origin struct {
	seq  uint64 // the newest message read from the stream
	seen time.Time
	// lo is the oldest entry applied and hi the newest (0: none yet); bit
	// (n mod dedupWindow) of applied says whether entry n, for
	// hi-n < dedupWindow, was.
	lo, hi  uint64
	applied [dedupWindow / 64]uint64
}

// dedupWindow is how many of a replica's newest entries are remembered as
// applied: an entry that comes a second way later than that is taken for
// one already applied, and one from lo on that has come neither way by
// then is counted lost.
const dedupWindow = 4096

// fresh reports whether entry n has not been applied yet, and marks it
// applied. Entries without a number (earlier formats) are always fresh.
// lost is how many entries, from the oldest applied on, the window moved
// past without their having come either way.
func (o *origin) fresh(n uint64) (fresh bool, lost int) {
	if n == 0 {
		return true, 0
	}
	switch {
	case o.hi == 0:
		o.lo, o.hi = n, n
	case n > o.hi:
		if n-o.hi >= dedupWindow {
			// The whole window leaves, and the entries between it and
			// n's window were never seen.
			for m := max(o.lo, o.hi-min(o.hi, dedupWindow-1)); m <= o.hi; m++ {
				if !o.has(m) {
					lost++
				}
			}
			lost += int(n - dedupWindow - o.hi)
			clear(o.applied[:])
		} else {
			// Each slot taken over held the entry dedupWindow before.
			for m := o.hi + 1; m <= n; m++ {
				if m > dedupWindow && m-dedupWindow >= o.lo && !o.has(m) {
					lost++
				}
				o.applied[m%dedupWindow/64] &^= 1 << (m % 64)
			}
		}
		o.hi = n
	case o.hi-n >= dedupWindow, o.has(n):
		return false, 0
	}
	o.lo = min(o.lo, n)
	o.applied[n%dedupWindow/64] |= 1 << (n % 64)
	return true, lost
}

// has reports whether entry n's bit is set (n within the window).
func (o *origin) has(n uint64) bool { return o.applied[n%dedupWindow/64]&(1<<(n%64)) != 0 }

// read applies the other replicas' messages: first the newest Replay of
// them, then each as it comes.
func (s *Sharer) read() {
	defer s.wg.Done()
	last := ""
	backoff := retryMin
	for s.ctx.Err() == nil {
		var err error
		switch {
		case last == "":
			last, err = s.replay()
			if err != nil && s.f != nil && kvstore.Closed(err) {
				// go-redis's handshake goes on past a server's reason
				// for turning it away, and reports the close.
				if why := kvstore.TurnedAway(s.ctx, s.f.addr); why != nil {
					err = fmt.Errorf("%w; the server said: %v", err, why)
				}
			}
		case s.f != nil:
			last, err = s.f.follow(last)
		default:
			last, err = s.follow(last)
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
func (s *Sharer) replay() (string, error) {
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
		s.apply(msgs[i], false)
	}
	return msgs[0].ID, nil
}

// follow waits for the messages after last, applies them and returns the
// id of the newest.
func (s *Sharer) follow(last string) (string, error) {
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
			s.apply(m, true)
			last = m.ID
		}
	}
	return last, nil
}

// apply applies m unless this replica sent it, counting gaps in its
// sender's sequence when gaps is true.
func (s *Sharer) apply(m redis.XMessage, gaps bool) {
	from, _ := m.Values["r"].(string)
	seq, _ := strconv.ParseUint(str(m.Values["s"]), 10, 64)
	published, _ := strconv.ParseInt(str(m.Values["t"]), 10, 64)
	s.applyMessage(ViaRedis, m.ID, from, seq, published, []byte(str(m.Values["d"])), gaps)
}

// applyMessage applies the entries of a message that came via the stream
// or a peer and were not applied yet: its id in the stream, sender,
// sequence number in the stream (0 from a peer), first commit's time and
// data, which it does not keep. With gaps, a jump in the stream's
// sequence numbers counts the messages skipped.
func (s *Sharer) applyMessage(via, id, from string, seq uint64, published int64, data []byte, gaps bool) {
	if from == s.cfg.ID || from == "" {
		return
	}
	now := time.Now()
	s.originsMu.Lock()
	o := s.origins[from]
	if o == nil {
		if len(s.origins) >= maxOrigins {
			forgetOldest(s.origins)
		}
		o = &origin{seq: seq}
		s.origins[from] = o
	} else if seq > 0 {
		if gaps && o.seq > 0 && seq > o.seq+1 {
			s.cfg.Observer.Gap(int(seq - o.seq - 1))
		}
		o.seq = max(o.seq, seq)
	}
	o.seen = now
	s.originsMu.Unlock()
	applied, dups, lost := 0, 0, 0
	_, err := decode(data, func(e Entry) {
		s.originsMu.Lock()
		fresh, l := o.fresh(e.Seq)
		s.originsMu.Unlock()
		lost += l
		if !fresh {
			dups++
			return
		}
		applied++
		if p := s.polled.Load(); e.At > 0 && p > e.At {
			s.cfg.Observer.Unseen(time.Duration(p - e.At))
		}
		s.cfg.Apply(e)
	})
	if dups > 0 {
		s.cfg.Observer.Duplicates(dups)
	}
	if lost > 0 {
		s.cfg.Observer.Lost(lost)
	}
	if err != nil {
		s.cfg.Logger.Debug("replica sharing: bad message skipped", "id", id, "from", from, "err", err)
		return
	}
	if applied > 0 {
		s.cfg.Observer.Received(via, applied, len(data), now.Sub(time.Unix(0, published)))
	}
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
// decision's time; formatSeq's, also the entry's number (Entry.Seq).
// encode writes formatSeq; decode reads all three.
const (
	formatKeys    = 1
	formatPending = 2
	formatSeq     = 3
)

// encode appends the entries to b: a version byte, then per entry the
// worker's name (uvarint length, bytes), its keys (uvarint count, 8 bytes
// each, little endian: block keys are uniform 64-bit hashes, which
// varints would lengthen), its pending blocks plus one (uvarint; 0:
// unknown), the decision's time (uvarint Unix nanoseconds) and the
// entry's number (uvarint).
func encode(b []byte, entries []Entry) []byte {
	b = append(b, formatSeq)
	for _, e := range entries {
		b = binary.AppendUvarint(b, uint64(len(e.Worker)))
		b = append(b, e.Worker...)
		b = binary.AppendUvarint(b, uint64(len(e.Keys)))
		for _, k := range e.Keys {
			b = binary.LittleEndian.AppendUint64(b, k)
		}
		b = binary.AppendUvarint(b, uint64(max(e.Pending+1, 0)))
		b = binary.AppendUvarint(b, uint64(max(e.At, 0)))
		b = binary.AppendUvarint(b, e.Seq)
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
	if len(b) == 0 || b[0] < formatKeys || b[0] > formatSeq {
		return 0, errors.New("unknown format")
	}
	format := b[0]
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
		if format >= formatPending {
			p, ok1 := uvarint(c + 1)
			at, ok2 := uvarint(math.MaxInt64)
			if !ok1 || !ok2 {
				return n, errors.New("bad pending blocks or decision time")
			}
			if p > 0 {
				e.Pending, e.At = int(p)-1, int64(at)
			}
		}
		if format >= formatSeq {
			if e.Seq, ok = uvarint(math.MaxUint64); !ok {
				return n, errors.New("bad entry number")
			}
		}
		apply(e)
		n++
	}
	return n, nil
}

type nopObserver struct{}

func (nopObserver) Sent(string, int, int)                    {}
func (nopObserver) Received(string, int, int, time.Duration) {}
func (nopObserver) Dropped(string, int)                      {}
func (nopObserver) Gap(int)                                  {}
func (nopObserver) Up(bool)                                  {}
func (nopObserver) Peers(int)                                {}
func (nopObserver) Duplicates(int)                           {}
func (nopObserver) Lost(int)                                 {}
func (nopObserver) Refused(string)                           {}
func (nopObserver) Loads(string, int, int)                   {}
func (nopObserver) Unseen(time.Duration)                     {}
