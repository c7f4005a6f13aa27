package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// Mode is how a Subscriber reaches the engine's publisher.
type Mode uint8

const (
	// Connect: the engine's PUB socket binds (vLLM's default, tcp://*:5557)
	// and the subscriber dials it, redialling when the connection breaks.
	Connect Mode = iota
	// Bind: the subscriber listens and the engine connects out (an engine
	// endpoint without a wildcard, tcp://scheduler:5557).
	Bind
)

// SubscriberConfig configures a Subscriber. Zero durations mean defaults.
type SubscriberConfig struct {
	// Endpoint is the ZeroMQ address to dial (Connect) or listen on (Bind),
	// e.g. "tcp://10.0.0.7:5557". Required.
	Endpoint string
	// Topic is the topic prefix to subscribe to; empty means every message.
	// SGLang may append metadata to its topic, so it is matched as a prefix.
	Topic string
	// ReplayEndpoint is the engine's replay ROUTER socket (vLLM's and
	// SGLang's replay_endpoint), always dialled. Empty: gaps are not
	// replayed, they reset the engine's entries.
	ReplayEndpoint string
	// Mode is Connect (the default) or Bind.
	Mode Mode
	// ReplayTimeout bounds one replay request, reply included. Default 2s.
	ReplayTimeout time.Duration
	// ReplayFromStart asks for the engine's whole replay buffer when the
	// first batch received is not its first, so a scheduler that starts
	// after the engine learns the blocks stored before it subscribed.
	ReplayFromStart bool
	// RedialMin and RedialMax bound the backoff between attempts to dial
	// (or listen) after a failure or a broken subscription; it doubles
	// from RedialMin. Defaults 100ms and 5s.
	RedialMin, RedialMax time.Duration
	// Handle, if set, is given each message on the subscriber's goroutine,
	// in order, instead of Messages: a batch is then received, decoded and
	// handled without waking another goroutine. The subscriber reads
	// nothing while it runs; Close waits for it to return. It should
	// Release the message.
	Handle func(Message)
	// Buffer is the capacity of the channel of messages. Default 256
	// batches: a few seconds of a busy engine, after which the subscriber
	// stops reading and the engine's high-water mark drops batches, which
	// then show as a gap.
	Buffer int
	// Logger receives connection changes, gaps and resets. Nil: discard.
	Logger *slog.Logger
	// DPRank, when CheckDPRank, is the data-parallel rank whose stream
	// this is. A batch stamped with another rank (a misconfigured port,
	// another rank's publisher) is dropped and counted as WrongRank, so
	// that it never lands on this rank's entries; an unstamped batch is
	// delivered.
	DPRank      int64
	CheckDPRank bool
}

func (c SubscriberConfig) withDefaults() SubscriberConfig {
	if c.ReplayTimeout <= 0 {
		c.ReplayTimeout = 2 * time.Second
	}
	if c.RedialMin <= 0 {
		c.RedialMin = 100 * time.Millisecond
	}
	if c.RedialMax <= 0 {
		c.RedialMax = 5 * time.Second
	}
	if c.Buffer <= 0 {
		c.Buffer = 256
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Validate checks the configuration, naming the field at fault.
func (c SubscriberConfig) Validate() error {
	if err := validEndpoint(c.Endpoint); err != nil {
		return fmt.Errorf("kvevents: endpoint: %w", err)
	}
	if c.ReplayEndpoint != "" {
		if err := validEndpoint(c.ReplayEndpoint); err != nil {
			return fmt.Errorf("kvevents: replay_endpoint: %w", err)
		}
	}
	if c.Mode > Bind {
		return fmt.Errorf("kvevents: mode: unknown mode %d", c.Mode)
	}
	if c.RedialMin > 0 && c.RedialMax > 0 && c.RedialMin > c.RedialMax {
		return fmt.Errorf("kvevents: redial_min %v above redial_max %v", c.RedialMin, c.RedialMax)
	}
	return nil
}

func validEndpoint(ep string) error {
	scheme, addr, ok := strings.Cut(ep, "://")
	switch {
	case ep == "":
		return errors.New("empty")
	case !ok || addr == "":
		return fmt.Errorf("%q is not transport://address", ep)
	case scheme != "tcp" && scheme != "ipc" && scheme != "inproc":
		return fmt.Errorf("%q: unknown transport %q", ep, scheme)
	}
	return nil
}

// Message is what a Subscriber delivers, in order.
type Message struct {
	// Seq is the batch's sequence number (for a Reset, the next batch's).
	Seq uint64
	// Batch is the decoded batch; Err is ErrUnknownTag when some of its
	// events were of an unknown kind (the others are in Batch).
	Batch Batch
	Err   error
	// Replayed: the batch came from the engine's replay socket.
	Replayed bool
	// Reset: batches were lost and could not be replayed, or the engine
	// restarted. Drop every entry of the engine (the translator's Reset) before
	// the batches that follow. A Reset message carries no batch.
	Reset bool

	// dec holds Batch's memory (see Release).
	dec *Decoder
}

// Release hands the message's memory back to the subscribers, which
// decode later batches into it: a receiver that follows busy engines then
// costs the collector next to nothing per batch. Call it once, when done
// with the batch, which must not be used after; messages not released are
// the collector's.
func (m Message) Release() {
	if m.dec != nil {
		decoders.Put(m.dec)
	}
}

// decoders are the Decoders of released messages, for the next batches
// of any subscriber. A Decoder keeps a bounded memory (see maxKeptTokens).
var decoders = sync.Pool{New: func() any { return new(Decoder) }}

// Stats counts what a Subscriber saw.
type Stats struct {
	Batches        uint64 // delivered, replayed ones included
	DecodeErrors   uint64 // payloads that did not decode (malformed), dropped
	UnknownTags    uint64 // batches delivered without their unknown events
	BadFrames      uint64 // messages without [topic, 8-byte seq, payload], dropped
	Gaps           uint64 // sequence gaps seen
	Replays        uint64 // gaps filled by replay
	ReplayFailures uint64 // replays that failed or came back incomplete
	Resets         uint64 // Reset messages delivered
	WrongRank      uint64 // batches of another data-parallel rank, dropped
	Restarts       uint64 // sequence numbers that went back: the engine restarted
	Reconnects     uint64 // subscriptions re-established after breaking
	DialFailures   uint64 // attempts to dial or listen that failed
}

// Subscriber receives one engine's KV event batches over ZeroMQ and
// delivers them in sequence order on Messages, filling gaps from the
// engine's replay socket. New starts it; Close stops it.
type Subscriber struct {
	cfg    SubscriberConfig
	out    chan Message
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once

	// Sequence state, owned by the run goroutine.
	have bool   // a batch was delivered since start or the last reset
	last uint64 // its sequence number

	stats struct {
		batches, decodeErrors, unknownTags, badFrames, gaps, replays atomic.Uint64
		replayFailures, resets, restarts, reconnects, dialFailures   atomic.Uint64
		wrongRank                                                    atomic.Uint64
	}
	wrongRankLogged atomic.Bool
}

// New validates cfg and starts a Subscriber.
func New(cfg SubscriberConfig) (*Subscriber, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	ctx, cancel := context.WithCancel(context.Background())
	buffer := cfg.Buffer
	if cfg.Handle != nil {
		buffer = 0 // nothing is sent on it
	}
	s := &Subscriber{
		cfg:    cfg,
		out:    make(chan Message, buffer),
		cancel: cancel,
		done:   make(chan struct{}),
	}
	go s.run(ctx)
	return s, nil
}

// Messages returns the channel of delivered messages, none when
// SubscriberConfig.Handle is set. It is closed after Close.
func (s *Subscriber) Messages() <-chan Message { return s.out }

// Close stops the subscriber and waits for it. It is idempotent.
func (s *Subscriber) Close() error {
	s.once.Do(func() {
		s.cancel()
		<-s.done
	})
	return nil
}

// Stats returns the subscriber's counters; any goroutine may call it.
func (s *Subscriber) Stats() Stats {
	st := &s.stats
	return Stats{
		Batches: st.batches.Load(), DecodeErrors: st.decodeErrors.Load(),
		UnknownTags: st.unknownTags.Load(), BadFrames: st.badFrames.Load(),
		Gaps: st.gaps.Load(), Replays: st.replays.Load(),
		ReplayFailures: st.replayFailures.Load(), Resets: st.resets.Load(),
		Restarts: st.restarts.Load(), Reconnects: st.reconnects.Load(),
		DialFailures: st.dialFailures.Load(), WrongRank: st.wrongRank.Load(),
	}
}

// dialTimeout bounds a TCP connect to the engine; a refused one fails at once.
const dialTimeout = 5 * time.Second

// zmqLogger silences zmq4's own logging; the subscriber logs what matters.
var zmqLogger = log.New(io.Discard, "", 0)

func (s *Subscriber) run(ctx context.Context) {
	defer close(s.done)
	defer close(s.out)
	backoff := s.cfg.RedialMin
	connected := false // a subscription was up before: the next is a reconnect
	for ctx.Err() == nil {
		src, err := s.open(ctx)
		if err != nil {
			s.stats.dialFailures.Add(1)
			s.cfg.Logger.Debug("kv events: subscribe", "endpoint", s.cfg.Endpoint, "err", err)
			if !sleep(ctx, backoff) {
				return
			}
			backoff = min(2*backoff, s.cfg.RedialMax)
			continue
		}
		if connected {
			s.stats.reconnects.Add(1)
			s.cfg.Logger.Info("kv events: resubscribed", "endpoint", s.cfg.Endpoint)
		}
		connected = true
		err = s.receive(ctx, src, &backoff)
		src.close()
		if ctx.Err() != nil {
			return
		}
		s.cfg.Logger.Warn("kv events: subscription broke", "endpoint", s.cfg.Endpoint, "err", err)
		if !sleep(ctx, backoff) {
			return
		}
		backoff = min(2*backoff, s.cfg.RedialMax)
	}
}

// open returns a subscription: a stream the subscriber reads itself when
// it dials a tcp or ipc endpoint, streams of its own for the publishers
// that connect to a tcp endpoint it binds, else (ipc bound, inproc) a SUB
// socket.
func (s *Subscriber) open(ctx context.Context) (source, error) {
	if network, addr, ok := streamNetwork(s.cfg.Endpoint); ok && s.cfg.Mode == Connect {
		return dialStream(ctx, network, addr, s.cfg.Topic)
	} else if ok && network == "tcp" {
		return listenStream(ctx, addr, s.cfg.Topic)
	}
	sock := zmq4.NewSub(ctx, zmq4.WithLogger(zmqLogger), zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(dialTimeout))
	if err := sock.SetOption(zmq4.OptionSubscribe, s.cfg.Topic); err != nil {
		closeSocket(sock)
		return nil, err
	}
	var err error
	if s.cfg.Mode == Bind {
		err = sock.Listen(zmqEndpoint(s.cfg.Endpoint))
	} else {
		err = sock.Dial(zmqEndpoint(s.cfg.Endpoint))
	}
	if err != nil {
		closeSocket(sock)
		return nil, err
	}
	return socketSource{sock}, nil
}

// closeSocket closes a socket and drains what its connections had queued:
// zmq4's reader goroutines block on a full queue, and would outlive the
// socket.
func closeSocket(sock zmq4.Socket) {
	_ = sock.Close()
	// A closed socket's Recv picks at random between its queue and its
	// cancellation: eight errors in a row mean the queue is empty.
	for i, misses := 0, 0; i < 1024 && misses < 8; i++ {
		if _, err := sock.Recv(); err != nil {
			misses++
		} else {
			misses = 0
		}
	}
}

// receive reads the socket until it breaks (Connect mode) or ctx ends. In
// Bind mode an engine that goes away comes back by itself: its error is
// only logged.
func (s *Subscriber) receive(ctx context.Context, src source, backoff *time.Duration) error {
	for {
		frames, err := src.next()
		if err != nil {
			if ctx.Err() != nil || s.cfg.Mode == Connect {
				return err
			}
			s.cfg.Logger.Info("kv events: publisher went away", "endpoint", s.cfg.Endpoint, "err", err)
			continue
		}
		*backoff = s.cfg.RedialMin
		topic, seq, payload, ok := splitFrames(frames, 3)
		if !ok || !bytes.HasPrefix(topic, []byte(s.cfg.Topic)) {
			s.stats.badFrames.Add(1)
			continue
		}
		if !s.live(ctx, seq, payload) {
			return ctx.Err()
		}
	}
}

// splitFrames splits [topic, seq, payload] (or [seq, payload] when n is 2)
// and checks the sequence number's size.
func splitFrames(frames [][]byte, n int) (topic []byte, seq uint64, payload []byte, ok bool) {
	if len(frames) != n || (n != 2 && n != 3) {
		return nil, 0, nil, false
	}
	if n == 3 {
		topic, frames = frames[0], frames[1:]
	}
	if len(frames[0]) != 8 {
		return nil, 0, nil, false
	}
	return topic, binary.BigEndian.Uint64(frames[0]), frames[1], true
}

// live handles a batch received on the subscription: it fills or reports
// the gap before it, then delivers it. It returns false when ctx ended.
func (s *Subscriber) live(ctx context.Context, seq uint64, payload []byte) bool {
	switch {
	case !s.have:
		if s.cfg.ReplayFromStart && seq > 0 && s.cfg.ReplayEndpoint != "" {
			// Nothing is known yet, so an incomplete replay loses nothing
			// that a reset would fix.
			if ok, _ := s.replay(ctx, 0, seq); !ok && ctx.Err() != nil {
				return false
			}
		}
	case seq == s.last:
		return true // already delivered by a replay
	case seq < s.last:
		s.stats.restarts.Add(1)
		s.cfg.Logger.Info("kv events: engine restarted", "endpoint", s.cfg.Endpoint, "seq", seq, "last", s.last)
		if !s.reset(ctx, seq) {
			return false
		}
	case seq > s.last+1:
		s.stats.gaps.Add(1)
		from := s.last + 1
		ok := false
		if s.cfg.ReplayEndpoint != "" {
			var err error
			if ok, err = s.replay(ctx, from, seq); !ok {
				if ctx.Err() != nil {
					return false
				}
				s.stats.replayFailures.Add(1)
				s.cfg.Logger.Warn("kv events: replay failed", "endpoint", s.cfg.ReplayEndpoint,
					"from", from, "to", seq, "err", err)
			}
		}
		if ok {
			s.stats.replays.Add(1)
		} else if !s.reset(ctx, seq) {
			return false
		}
	}
	return s.deliver(ctx, seq, payload, false)
}

// reset delivers a Reset before the batch seq.
func (s *Subscriber) reset(ctx context.Context, seq uint64) bool {
	s.have = false
	s.stats.resets.Add(1)
	return s.send(ctx, Message{Seq: seq, Reset: true})
}

// deliver decodes and sends one batch, and records its sequence number even
// when it did not decode: a payload that fails once fails again.
func (s *Subscriber) deliver(ctx context.Context, seq uint64, payload []byte, replayed bool) bool {
	s.have, s.last = true, seq
	dec := decoders.Get().(*Decoder)
	b, err := dec.Decode(payload)
	switch {
	case errors.Is(err, ErrUnknownTag):
		s.stats.unknownTags.Add(1)
	case err != nil:
		s.stats.decodeErrors.Add(1)
		s.cfg.Logger.Debug("kv events: undecodable batch", "seq", seq, "err", err)
		decoders.Put(dec)
		return true
	}
	if s.cfg.CheckDPRank && b.HasDPRank && b.DPRank != s.cfg.DPRank {
		decoders.Put(dec)
		s.stats.wrongRank.Add(1)
		if !s.wrongRankLogged.Swap(true) {
			s.cfg.Logger.Warn("kv events: batches of another data-parallel rank dropped (logged once)",
				"seq", seq, "rank", b.DPRank, "want", s.cfg.DPRank, "endpoint", s.cfg.Endpoint)
		}
		return true
	}
	s.stats.batches.Add(1)
	return s.send(ctx, Message{Seq: seq, Batch: b, Err: err, Replayed: replayed, dec: dec})
}

func (s *Subscriber) send(ctx context.Context, m Message) bool {
	if s.cfg.Handle != nil {
		s.cfg.Handle(m)
		return ctx.Err() == nil
	}
	select {
	case s.out <- m:
		return true
	case <-ctx.Done():
		return false
	}
}

// endSeq is the replay reply's end marker: -1 as 8 big-endian bytes.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// replay asks the engine's replay socket for the batches from..to-1 and
// delivers them, if it gets them all. The request is [empty delimiter,
// 8-byte big-endian start]; the engine answers each buffered batch from
// start on as [delimiter, seq, payload] (vLLM from 0.26 and SGLang's
// proposal: [delimiter, topic, seq, payload]), then an end marker of
// sequence -1.
func (s *Subscriber) replay(ctx context.Context, from, to uint64) (bool, error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.ReplayTimeout)
	defer cancel()
	sock := zmq4.NewDealer(rctx, zmq4.WithLogger(zmqLogger), zmq4.WithDialerMaxRetries(0),
		zmq4.WithDialerTimeout(s.cfg.ReplayTimeout), zmq4.WithTimeout(s.cfg.ReplayTimeout))
	defer closeSocket(sock)
	if err := sock.Dial(s.cfg.ReplayEndpoint); err != nil {
		return false, err
	}
	start := make([]byte, 8)
	binary.BigEndian.PutUint64(start, from)
	if err := sock.SendMulti(zmq4.NewMsgFrom([]byte{}, start)); err != nil {
		return false, fmt.Errorf("replay request: %w", err)
	}
	type batch struct {
		seq     uint64
		payload []byte
	}
	var got []batch
	next := from
	for {
		msg, err := sock.Recv()
		if err != nil {
			return false, fmt.Errorf("replay reply: %w", err)
		}
		frames := msg.Frames
		if len(frames) > 0 && len(frames[0]) == 0 {
			frames = frames[1:] // the delimiter
		}
		if len(frames) >= 2 && bytes.Equal(frames[len(frames)-2], endSeq) {
			break
		}
		_, seq, payload, ok := splitFrames(frames, len(frames))
		if !ok {
			s.stats.badFrames.Add(1)
			continue
		}
		if seq == next && seq < to {
			got = append(got, batch{seq, payload})
			next++
		}
	}
	if next != to {
		return false, fmt.Errorf("replay returned %d..%d of %d..%d", from, next, from, to)
	}
	for _, b := range got {
		if !s.deliver(ctx, b.seq, b.payload, true) {
			return false, ctx.Err()
		}
	}
	return true, nil
}

// sleep waits d or until ctx ends; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
