package kveventstest

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log"
	"slices"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/batonllm/baton/workers/vllm/kvevents"
)

// PublisherConfig configures a fake engine publisher.
type PublisherConfig struct {
	// Endpoint is where the PUB socket binds ("tcp://127.0.0.1:0" picks a
	// free port) or, with Connect, the subscriber it dials.
	Endpoint string
	// Connect dials Endpoint instead of binding it, as an engine configured
	// with a non-wildcard endpoint does.
	Connect bool
	// Topic is the first frame of every message.
	Topic string
	// Replay binds a ROUTER replay socket on a free loopback port.
	Replay bool
	// ReplayTopic puts the topic frame in replay replies, as vLLM does
	// from 0.26: [topic, seq, payload] rather than [seq, payload].
	ReplayTopic bool
	// ReplayEndpoint, if set, is where the replay socket binds instead.
	ReplayEndpoint string
	// Encoding of the batches. Default ArrayLike.
	Encoding Encoding
	// Variant of the encoding: how the publisher writes what it leaves
	// open. Default current vLLM's.
	Variant Variant
	// Buffer is how many batches the replay socket keeps. Default 10,000,
	// the engines' buffer_steps.
	Buffer int
	// FirstSeq is the sequence number of the first batch. Default 0.
	FirstSeq uint64
}

// Publisher is a fake engine: it publishes batches as vLLM's
// ZmqEventPublisher does, [topic, 8-byte big-endian seq, payload], and
// answers replay requests on a ROUTER socket.
type Publisher struct {
	cfg    PublisherConfig
	pub    zmq4.Socket
	router zmq4.Socket
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once

	mu   sync.Mutex
	next uint64
	buf  []stored
}

type stored struct {
	seq     uint64
	payload []byte
}

var quiet = log.New(io.Discard, "", 0)

// NewPublisher starts a fake publisher. Close it.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.Buffer <= 0 {
		cfg.Buffer = 10_000
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{cfg: cfg, cancel: cancel, next: cfg.FirstSeq}
	p.pub = zmq4.NewPub(ctx, zmq4.WithLogger(quiet), zmq4.WithDialerRetry(20*time.Millisecond),
		zmq4.WithDialerMaxRetries(100))
	var err error
	if cfg.Connect {
		err = p.pub.Dial(cfg.Endpoint)
	} else {
		err = p.pub.Listen(cfg.Endpoint)
	}
	if err != nil {
		p.pub.Close()
		cancel()
		return nil, fmt.Errorf("publisher on %s: %w", cfg.Endpoint, err)
	}
	if cfg.Replay || cfg.ReplayEndpoint != "" {
		ep := cfg.ReplayEndpoint
		if ep == "" {
			ep = "tcp://127.0.0.1:0"
		}
		p.router = zmq4.NewRouter(ctx, zmq4.WithLogger(quiet))
		if err := p.router.Listen(ep); err != nil {
			p.pub.Close()
			p.router.Close()
			cancel()
			return nil, fmt.Errorf("replay socket on %s: %w", ep, err)
		}
		p.wg.Add(1)
		go p.serveReplay(ctx)
	}
	return p, nil
}

// Endpoint returns the address subscribers dial: the bound one, with its
// port, or the configured one when the publisher connects out.
func (p *Publisher) Endpoint() string {
	if a := p.pub.Addr(); a != nil {
		return "tcp://" + a.String()
	}
	return p.cfg.Endpoint
}

// ReplayEndpoint returns the replay socket's address, "" without one.
func (p *Publisher) ReplayEndpoint() string {
	if p.router == nil {
		return ""
	}
	return "tcp://" + p.router.Addr().String()
}

// WaitSubscribed waits until a subscriber to the topic is connected: a PUB
// socket drops what it publishes before.
func (p *Publisher) WaitSubscribed(ctx context.Context) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		if slices.Contains(p.pub.(zmq4.Topics).Topics(), p.cfg.Topic) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for a subscriber: %w", ctx.Err())
		case <-t.C:
		}
	}
}

// Publish encodes and publishes a batch and returns its sequence number.
func (p *Publisher) Publish(b kvevents.Batch) (uint64, error) {
	return p.publish(b, true)
}

// Drop numbers and buffers a batch for replay without publishing it: a
// batch the subscriber missed.
func (p *Publisher) Drop(b kvevents.Batch) (uint64, error) {
	return p.publish(b, false)
}

func (p *Publisher) publish(b kvevents.Batch, send bool) (uint64, error) {
	payload, err := EncodeVariant(b, p.cfg.Encoding, p.cfg.Variant)
	if err != nil {
		return 0, err
	}
	return p.PublishPayload(payload, send)
}

// PublishPayload publishes (or, send false, only buffers) a raw payload
// under the next sequence number, which it returns.
func (p *Publisher) PublishPayload(payload []byte, send bool) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.next
	p.next++
	p.buf = append(p.buf, stored{seq, payload})
	if len(p.buf) > p.cfg.Buffer {
		p.buf = slices.Delete(p.buf, 0, len(p.buf)-p.cfg.Buffer)
	}
	if !send {
		return seq, nil
	}
	return seq, p.pub.SendMulti(zmq4.NewMsgFrom([]byte(p.cfg.Topic), seqBytes(seq), payload))
}

// SendFrames publishes raw frames, for malformed messages; the first frame
// must start with the topic for subscribers to get it.
func (p *Publisher) SendFrames(frames ...[]byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pub.SendMulti(zmq4.NewMsgFrom(frames...))
}

// ForgetBefore drops buffered batches below seq, as a full replay buffer
// does.
func (p *Publisher) ForgetBefore(seq uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.buf = slices.DeleteFunc(p.buf, func(s stored) bool { return s.seq < seq })
}

func seqBytes(seq uint64) []byte {
	b := make([]byte, 8)
	binary.BigEndian.PutUint64(b, seq)
	return b
}

// endSeq is the replay reply's end marker, -1.
var endSeq = []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// serveReplay answers replay requests [identity, "", 8-byte start] with
// every buffered batch from start on, then the end marker, as vLLM's
// ZmqEventPublisher._service_replay does.
func (p *Publisher) serveReplay(ctx context.Context) {
	defer p.wg.Done()
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			continue
		}
		if len(msg.Frames) != 3 || len(msg.Frames[2]) != 8 {
			continue // the engine logs and drops these
		}
		id := msg.Frames[0]
		start := binary.BigEndian.Uint64(msg.Frames[2])
		p.mu.Lock()
		batches := slices.Clone(p.buf)
		p.mu.Unlock()
		for _, b := range batches {
			if b.seq >= start {
				p.reply(id, seqBytes(b.seq), b.payload)
			}
		}
		p.reply(id, endSeq, []byte{})
	}
}

func (p *Publisher) reply(id, seq, payload []byte) {
	frames := [][]byte{id, {}}
	if p.cfg.ReplayTopic {
		topic := []byte(p.cfg.Topic)
		if len(payload) == 0 {
			topic = []byte{} // the end marker carries an empty topic
		}
		frames = append(frames, topic)
	}
	frames = append(frames, seq, payload)
	_ = p.router.SendMulti(zmq4.NewMsgFrom(frames...))
}

// Close stops the publisher and closes its sockets. It is idempotent.
func (p *Publisher) Close() error {
	var err error
	p.once.Do(func() {
		p.cancel()
		err = p.pub.Close()
		if p.router != nil {
			err = errors.Join(err, p.router.Close())
		}
		p.wg.Wait()
	})
	return err
}
