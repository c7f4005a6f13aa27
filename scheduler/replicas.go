package scheduler

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/scheduler/internal/replica"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/transfer/kvstore"
)

// ReplicasConfig makes several scheduler replicas in front of one fleet
// share what each learns: the blocks each replica's committed decisions
// predict on a worker (on engines that publish no KV events, what the
// learned index knows) reach the others through a Redis stream, within
// milliseconds, and are applied as their own. Sharing never delays a
// decision; while Redis is down each replica routes on what it knows.
type ReplicasConfig struct {
	// Redis is the server the replicas share through (the shared KV
	// tier's will do). Default: none, and each replica learns alone.
	Redis kvstore.RedisConfig `yaml:"redis"`
	// Stream is the Redis stream's key; replicas in front of different
	// fleets that share a Redis need different ones. Default
	// baton:replica:commits.
	Stream string `yaml:"stream"`
	// Replay is how many of the newest messages a starting replica
	// applies before it follows the stream. Default 1000; -1: none.
	Replay int64 `yaml:"replay"`
}

// enabled reports whether the replicas share.
func (c ReplicasConfig) enabled() bool { return c.Redis.Addr != "" }

// validate reports what is wrong with c, naming the field.
func (c ReplicasConfig) validate() error {
	if !c.enabled() {
		if c.Stream != "" || c.Replay != 0 || c.Redis != (kvstore.RedisConfig{}) {
			return errors.New("replicas.redis.addr: required when replicas is set")
		}
		return nil
	}
	if err := c.Redis.Validate(); err != nil {
		return fmt.Errorf("replicas.redis.%w", err)
	}
	if c.Replay < -1 {
		return fmt.Errorf("replicas.replay: must be -1 (none) or more, got %d", c.Replay)
	}
	return nil
}

// sharing is a replica's link to the others, closed with the scheduler.
type sharing struct {
	sharer *replica.Sharer
	client *redis.Client
	early  *earlyEntries
}

func (s *sharing) close() {
	s.sharer.Close()
	s.early.stop()
	s.client.Close()
}

// startSharing starts sharing idx's predictions with the other replicas,
// and applying theirs to it.
func startSharing(c ReplicasConfig, idx *kvindex.Index, reg prometheus.Registerer, log *slog.Logger) (*sharing, error) {
	client, err := kvstore.NewClient(c.Redis)
	if err != nil {
		return nil, fmt.Errorf("replicas.redis.%w", err)
	}
	obs := newSyncMetrics(reg)
	early := newEarlyEntries(idx, obs)
	sh, err := replica.New(replica.Config{
		Client: client, Stream: c.Stream, Replay: c.Replay,
		Apply: func(e replica.Entry) {
			if !applyEntry(idx, e) {
				early.keep(e)
			}
		},
		Logger: log, Observer: obs,
	})
	if err != nil {
		early.stop()
		client.Close()
		return nil, err
	}
	log.Info("sharing with the other scheduler replicas", "redis", c.Redis.Addr, "replica", sh.ID())
	return &sharing{sharer: sh, client: client, early: early}, nil
}

// applyEntry records another replica's decision in idx, and reports false
// when idx does not know its worker.
func applyEntry(idx *kvindex.Index, e replica.Entry) bool {
	p := kvindex.Prediction{Worker: e.Worker, Keys: e.Keys, Pending: e.Pending}
	if e.Pending >= 0 {
		p.At = time.Unix(0, e.At)
	}
	return idx.Shared(p)
}

// Entries for workers the index does not know yet: a replica that starts
// replays the others' decisions at once, while its engines join the index
// as the watcher reaches them. Such entries are kept for a while, and
// applied once their worker is known.
const (
	earlyFor   = 30 * time.Second
	earlyEvery = 50 * time.Millisecond
	earlyMax   = 10_000
)

// earlyEntries keeps the entries of workers not known yet, for earlyFor
// after the replica started, and applies them once their worker is
// known; what is left then is dropped (reason unknown_worker).
type earlyEntries struct {
	idx   *kvindex.Index
	obs   *syncMetrics
	mu    sync.Mutex
	kept  []replica.Entry
	until time.Time
	done  chan struct{}
	once  sync.Once
	wg    sync.WaitGroup
}

func newEarlyEntries(idx *kvindex.Index, obs *syncMetrics) *earlyEntries {
	e := &earlyEntries{idx: idx, obs: obs, until: time.Now().Add(earlyFor), done: make(chan struct{})}
	e.wg.Go(e.run)
	return e
}

// keep keeps an entry whose worker the index does not know, or drops it
// once earlyFor has passed or earlyMax are kept.
func (e *earlyEntries) keep(en replica.Entry) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.kept) >= earlyMax || time.Now().After(e.until) {
		e.obs.Dropped("unknown_worker", 1)
		return
	}
	e.kept = append(e.kept, en)
}

// run applies the kept entries whose worker has become known, every
// earlyEvery, until earlyFor has passed.
func (e *earlyEntries) run() {
	t := time.NewTicker(earlyEvery)
	defer t.Stop()
	for {
		select {
		case <-e.done:
			return
		case now := <-t.C:
			e.mu.Lock()
			left := e.kept[:0]
			for _, en := range e.kept {
				if !applyEntry(e.idx, en) {
					left = append(left, en)
				}
			}
			clear(e.kept[len(left):])
			e.kept = left
			over := now.After(e.until)
			if over {
				if len(e.kept) > 0 {
					e.obs.Dropped("unknown_worker", len(e.kept))
				}
				e.kept = nil
			}
			e.mu.Unlock()
			if over {
				return
			}
		}
	}
}

func (e *earlyEntries) stop() {
	e.once.Do(func() { close(e.done) })
	e.wg.Wait()
}

// syncMetrics are the baton_replica_sync_* metrics.
type syncMetrics struct {
	messages, entries, bytes *prometheus.CounterVec
	dropped                  *prometheus.CounterVec
	missed                   prometheus.Counter
	up                       prometheus.Gauge
	lag                      prometheus.Histogram
	sent, received           [3]prometheus.Counter // messages, entries, bytes
}

func newSyncMetrics(reg prometheus.Registerer) *syncMetrics {
	m := &syncMetrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_messages_total",
			Help: "Messages of committed decisions this replica sent to the other scheduler replicas, or received and applied from them."}, []string{"direction"}),
		entries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_entries_total",
			Help: "Committed decisions (a worker and the blocks it will hold) sent or received."}, []string{"direction"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_bytes_total",
			Help: "Bytes of messages sent or received (their data, without Redis's framing)."}, []string{"direction"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_dropped_entries_total",
			Help: "Committed decisions not shared: queue_full (sharing fell behind) or redis_error."}, []string{"reason"}),
		missed: prometheus.NewCounter(prometheus.CounterOpts{Name: "baton_replica_sync_missed_messages_total",
			Help: "Messages of other replicas this one never applied, from the gaps in their sequence numbers."}),
		up: prometheus.NewGauge(prometheus.GaugeOpts{Name: "baton_replica_sync_up",
			Help: "1 while the replicas' Redis answers, else 0."}),
		lag: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "baton_replica_sync_lag_seconds",
			Help:    "Time from another replica's commit of a decision to its application here (the oldest decision of each message): how long this replica routed without knowing of it.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 17)}),
	}
	reg.MustRegister(m.messages, m.entries, m.bytes, m.dropped, m.missed, m.up, m.lag)
	m.up.Set(1)
	for i, vec := range []*prometheus.CounterVec{m.messages, m.entries, m.bytes} {
		m.sent[i] = vec.WithLabelValues("sent")
		m.received[i] = vec.WithLabelValues("received")
	}
	for _, r := range []string{"queue_full", "redis_error", "unknown_worker"} {
		m.dropped.WithLabelValues(r)
	}
	return m
}

func (m *syncMetrics) Sent(entries, bytes int) {
	m.sent[0].Inc()
	m.sent[1].Add(float64(entries))
	m.sent[2].Add(float64(bytes))
}

func (m *syncMetrics) Received(entries, bytes int, lag time.Duration) {
	m.received[0].Inc()
	m.received[1].Add(float64(entries))
	m.received[2].Add(float64(bytes))
	m.lag.Observe(max(lag, 0).Seconds())
}

func (m *syncMetrics) Dropped(reason string, n int) {
	m.dropped.WithLabelValues(reason).Add(float64(n))
}
func (m *syncMetrics) Gap(n int) { m.missed.Add(float64(n)) }

func (m *syncMetrics) Up(up bool) {
	if up {
		m.up.Set(1)
	} else {
		m.up.Set(0)
	}
}

var _ replica.Observer = (*syncMetrics)(nil)
