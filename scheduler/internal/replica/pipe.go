package replica

import (
	"errors"
	"net"
	"os"
	"strconv"
	"sync"
	"time"
)

// maxInFlight bounds the messages a sender has written and Redis has not
// yet answered.
const maxInFlight = 64

// sent is a message written, waiting for Redis's answer.
type sent struct{ entries, bytes int }

// publishWait bounds how long Publish writes a message itself: past it
// the connection is given up (its messages lost, counted) rather than
// the decision's goroutine kept.
const publishWait = 5 * time.Millisecond

// pipe is the sender's connection, which Publish writes to itself when
// no entry waits in the queue. mu orders the messages' sequence numbers
// as they are written.
type pipe struct {
	mu       sync.Mutex
	conn     *net.TCPConn // nil while not connected
	inFlight chan sent
	seq      uint64
	buf, cmd []byte
}

// write writes one message of entries, first published at first; it
// reports whether the message was written. p.mu is held.
//
// Without block (Publish's own write) it gives up, the connection as it
// was, where the message would wait: with maxInFlight messages
// unanswered, or when the deadline passed before a byte was written (the
// goroutine not run in time on a busy machine, or the socket's buffer
// full); the caller then queues the message for the sender. Only a
// write cut short part way loses the connection.
func (s *Sharer) write(entries []Entry, first int64, wait time.Duration, block bool) bool {
	p := &s.pipe
	if p.conn == nil {
		return false
	}
	// Only holders of p.mu send on inFlight: room seen here stays.
	if !block && len(p.inFlight) == cap(p.inFlight) {
		return false
	}
	p.seq++
	p.buf = encode(p.buf[:0], entries)
	p.cmd = appendXAdd(p.cmd[:0], s.cfg, p.seq, first, p.buf)
	msg := sent{len(entries), len(p.buf)}
	if block {
		select {
		case p.inFlight <- msg:
		case <-s.ctx.Done():
			return false
		}
	}
	p.conn.SetWriteDeadline(time.Now().Add(wait))
	n, err := p.conn.Write(p.cmd)
	if !block {
		if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
			p.seq--
			return false
		}
		// Its answer is read after it is written: the answers' reader
		// takes a message from inFlight before reading its answer.
		p.inFlight <- msg
	}
	if err != nil {
		// The answers' reader counts msg with the rest unanswered; the
		// others see the gap in seq.
		if s.ctx.Err() == nil {
			s.setUp(false, err)
		}
		p.conn.Close()
		p.conn = nil
	}
	return true
}

// sendPiped is send over a connection of its own (the follower's server):
// each message is written as soon as it is taken, without waiting for
// Redis to answer the one before, and the answers are read by another
// goroutine, which counts them. Waiting for each answer would make the
// next message wait for the sender's goroutine to be woken by the
// runtime's poller, which while a burst keeps every processor busy takes
// milliseconds; the others would decide without the burst's decisions.
func (s *Sharer) sendPiped() {
	defer s.wg.Done()
	batch := make([]Entry, 0, s.cfg.MaxBatch)
	backoff := retryMin
	for s.ctx.Err() == nil {
		conn, err := dialRedis(s.ctx, s.f.addr, s.f.auth, s.f.db)
		if err != nil {
			if s.ctx.Err() != nil {
				return
			}
			s.setUp(false, err)
			// Entries queued meanwhile are dropped as they come, as an
			// XADD that fails drops its message.
			deadline := time.After(backoff)
		drop:
			for {
				select {
				case <-s.ctx.Done():
					return
				case <-s.queue:
					s.cfg.Observer.Dropped("redis_error", 1)
				case <-deadline:
					break drop
				}
			}
			backoff = min(2*backoff, retryMax)
			continue
		}
		backoff = retryMin
		inFlight := make(chan sent, maxInFlight)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.answers(conn, inFlight)
		}()
		s.pipe.mu.Lock()
		s.pipe.conn, s.pipe.inFlight = conn, inFlight
		s.pipe.mu.Unlock()
		for s.ctx.Err() == nil {
			var first int64
			select {
			case <-s.ctx.Done():
			case q := <-s.queue:
				batch, first = append(batch, q.e), q.at
			}
			if len(batch) == 0 {
				break
			}
			batch = s.fill(batch)
			s.pipe.mu.Lock()
			ok := s.write(batch, first, callTimeout, true)
			broken := s.pipe.conn == nil
			s.pipe.mu.Unlock()
			if !ok {
				s.cfg.Observer.Dropped("redis_error", len(batch))
			}
			clear(batch)
			batch = batch[:0]
			if broken {
				break
			}
		}
		s.pipe.mu.Lock()
		s.pipe.conn = nil
		s.pipe.mu.Unlock()
		conn.Close()
		close(inFlight)
		wg.Wait()
	}
}

// answers reads Redis's answers to the messages written on conn, one
// for each in inFlight, and counts them; when conn breaks, those left
// unanswered are counted as dropped.
func (s *Sharer) answers(conn *net.TCPConn, inFlight chan sent) {
	var buf []byte
	var rerr error
	for msg := range inFlight {
		if rerr == nil {
			conn.SetReadDeadline(time.Now().Add(callTimeout))
			var reply error
			if reply, rerr = readReply(conn, &buf); rerr == nil {
				if reply != nil {
					s.cfg.Observer.Dropped("redis_error", msg.entries)
					s.setUp(false, reply)
				} else {
					s.cfg.Observer.Sent(ViaRedis, msg.entries, msg.bytes)
					s.setUp(true, nil)
				}
				continue
			}
		}
		s.cfg.Observer.Dropped("redis_error", msg.entries)
		if s.ctx.Err() == nil && !errors.Is(rerr, net.ErrClosed) {
			s.setUp(false, rerr)
		}
		conn.Close()
	}
}

// appendXAdd appends the XADD command of one message to b.
func appendXAdd(b []byte, cfg Config, seq uint64, first int64, data []byte) []byte {
	return appendCommand(b, "XADD", cfg.Stream, "MAXLEN", "~", strconv.FormatInt(cfg.MaxLen, 10), "*",
		"r", cfg.ID, "s", strconv.FormatUint(seq, 10), "t", strconv.FormatInt(first, 10), "d", string(data))
}
