package replica

import (
	"encoding/binary"
	"errors"
	"math"
	"time"

	"github.com/batonllm/baton/workers/engine"
)

// Load is one scrape of an engine's load (its metrics page), relayed to
// the other replicas so that each engine is scraped by about one replica
// at a time rather than by every one (scheduler/watch says who scrapes).
type Load struct {
	Worker string
	// At is when the scrape started, in Unix nanoseconds on the scraping
	// replica's clock.
	At     int64
	Report engine.Load
}

// formatLoad is the first byte of a relayed load report's data: a value
// no decision's message starts with, so that a replica that reads only
// decisions (before load reports were relayed) skips it as a message of
// an unknown format and keeps scraping for itself.
const formatLoad = 16

// Flags of a relayed report: which of engine.Load's Has fields are set.
const (
	loadHasLoad = 1 << iota
	loadHasKVUsage
	loadHasLoRA
)

// maxAdapters bounds the adapters of one decoded report.
const maxAdapters = 4096

// encodeLoads appends the data of a frame of relayed load reports to b:
// formatLoad, then each report: the worker's name (uvarint length,
// bytes), the scrape's start (uvarint Unix nanoseconds), a byte of flags,
// running and waiting requests, the KV usage (8 bytes, the float's bits,
// little endian), block size, GPU blocks, KV tokens, slots and adapter
// slots (uvarints), then the adapters (uvarint count, each a uvarint
// length and bytes).
func encodeLoads(b []byte, ls []Load) []byte {
	b = append(b, formatLoad)
	for _, l := range ls {
		b = encodeLoad(b, l)
	}
	return b
}

// encodeLoad appends one report of encodeLoads to b.
func encodeLoad(b []byte, l Load) []byte {
	r := l.Report
	b = binary.AppendUvarint(b, uint64(len(l.Worker)))
	b = append(b, l.Worker...)
	b = binary.AppendUvarint(b, uint64(max(l.At, 0)))
	var flags byte
	if r.HasLoad {
		flags |= loadHasLoad
	}
	if r.HasKVUsage {
		flags |= loadHasKVUsage
	}
	if r.HasLoRA {
		flags |= loadHasLoRA
	}
	b = append(b, flags)
	for _, v := range []int64{int64(r.Running), int64(r.Waiting)} {
		b = binary.AppendUvarint(b, uint64(max(v, 0)))
	}
	b = binary.LittleEndian.AppendUint64(b, math.Float64bits(r.KVUsage))
	for _, v := range []int64{int64(r.BlockSize), r.GPUBlocks, r.KVTokens, int64(r.Slots), int64(r.MaxLoRAs)} {
		b = binary.AppendUvarint(b, uint64(max(v, 0)))
	}
	b = binary.AppendUvarint(b, uint64(len(r.Adapters)))
	for _, a := range r.Adapters {
		b = binary.AppendUvarint(b, uint64(len(a)))
		b = append(b, a...)
	}
	return b
}

var errBadLoad = errors.New("malformed load report")

// decodeLoads calls apply with each report of a frame's data, as
// encodeLoads writes it, and returns how many there were. A malformed
// report is an error; those before it were applied.
func decodeLoads(b []byte, apply func(Load)) (int, error) {
	if len(b) == 0 || b[0] != formatLoad {
		return 0, errBadLoad
	}
	b = b[1:]
	n := 0
	for len(b) > 0 {
		l, rest, err := decodeLoad(b)
		if err != nil {
			return n, err
		}
		b = rest
		apply(l)
		n++
	}
	return n, nil
}

// decodeLoad parses the report at the front of b and returns what
// follows it.
func decodeLoad(b []byte) (Load, []byte, error) {
	bad := false
	uvarint := func(limit uint64) uint64 {
		v, k := binary.Uvarint(b)
		if k <= 0 || v > limit {
			bad = true
			return 0
		}
		b = b[k:]
		return v
	}
	field := func(limit uint64) string {
		n := uvarint(limit)
		if bad || n > uint64(len(b)) {
			bad = true
			return ""
		}
		s := string(b[:n])
		b = b[n:]
		return s
	}
	var l Load
	l.Worker = field(maxName)
	l.At = int64(uvarint(math.MaxInt64))
	if bad || len(b) < 1 || l.Worker == "" {
		return Load{}, nil, errBadLoad
	}
	flags := b[0]
	b = b[1:]
	r := &l.Report
	r.HasLoad, r.HasKVUsage, r.HasLoRA = flags&loadHasLoad != 0, flags&loadHasKVUsage != 0, flags&loadHasLoRA != 0
	r.Running, r.Waiting = int(uvarint(math.MaxInt32)), int(uvarint(math.MaxInt32))
	if bad || len(b) < 8 {
		return Load{}, nil, errBadLoad
	}
	r.KVUsage = math.Float64frombits(binary.LittleEndian.Uint64(b))
	b = b[8:]
	if math.IsNaN(r.KVUsage) || math.IsInf(r.KVUsage, 0) || r.KVUsage < 0 {
		return Load{}, nil, errBadLoad
	}
	r.BlockSize = int(uvarint(math.MaxInt32))
	r.GPUBlocks, r.KVTokens = int64(uvarint(math.MaxInt64)), int64(uvarint(math.MaxInt64))
	r.Slots, r.MaxLoRAs = int(uvarint(math.MaxInt32)), int(uvarint(math.MaxInt32))
	n := uvarint(maxAdapters)
	for i := uint64(0); i < n && !bad; i++ {
		r.Adapters = append(r.Adapters, field(maxName))
	}
	if bad {
		return Load{}, nil, errBadLoad
	}
	return l, b, nil
}

// Relayed load reports are sent in batches: the first report queued
// wakes the relaying goroutine, which waits loadBatchWait for more and
// sends what has queued, up to maxLoadBatch reports a frame, to each peer.
// One frame, one write and one wake-up of each receiver for a batch
// rather than for each report: at a thousand engines scraped four times
// a second, a frame each would cost more than the scrapes it saves. The
// wait is small beside a scrape interval. A full queue (loadQueue) drops
// the report: the receivers scrape the engine at their own turn.
const (
	loadBatchWait = 5 * time.Millisecond
	maxLoadBatch  = 512
	loadQueue     = 8192
)

// PublishLoad relays l, a scrape of l.Worker's metrics, to every peer
// connected when its batch is sent; it never blocks. Not through Redis,
// and not kept for a peer that connects later: a load report is stale
// within its interval. Without Listen it does nothing.
func (s *Sharer) PublishLoad(l Load) {
	if s.peers == nil || l.Worker == "" {
		return
	}
	select {
	case s.peers.loads <- l:
	default:
	}
}

// relayLoads sends the queued load reports in batches until the Sharer
// closes.
func (p *peers) relayLoads() {
	defer p.wg.Done()
	batch := make([]Load, 0, maxLoadBatch)
	var buf []byte
	t := time.NewTimer(0)
	<-t.C
	for {
		select {
		case <-p.s.ctx.Done():
			return
		case l := <-p.loads:
			batch = append(batch[:0], l)
		}
		t.Reset(loadBatchWait)
	collect:
		for len(batch) < maxLoadBatch {
			select {
			case <-p.s.ctx.Done():
				return
			case l := <-p.loads:
				batch = append(batch, l)
			case <-t.C:
				break collect
			}
		}
		if !t.Stop() {
			select {
			case <-t.C:
			default:
			}
		}
		buf = p.publishLoads(buf, batch, time.Now().UnixNano())
	}
}

// applyLoads applies the load reports of a frame another replica relayed.
func (s *Sharer) applyLoads(from string, data []byte) {
	if from == s.cfg.ID || from == "" {
		return
	}
	n, err := decodeLoads(data, func(l Load) {
		if s.cfg.ApplyLoad != nil {
			s.cfg.ApplyLoad(l)
		}
	})
	if err != nil {
		s.cfg.Logger.Debug("replica sharing: bad load report skipped", "from", from, "err", err)
	}
	if n > 0 {
		s.cfg.Observer.Loads("received", n, len(data))
	}
}
