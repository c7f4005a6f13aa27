package scheduler

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/scheduler/discovery"
	"github.com/batonllm/baton/scheduler/internal/replica"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/workers/vllm"
)

// ReplicasConfig makes several scheduler replicas in front of one fleet
// share what each learns: the blocks each replica's committed decisions
// predict on a worker (on engines that publish no KV events, what the
// learned index knows) reach the others, within milliseconds, and are
// applied as their own: through a Redis stream (redis), straight from
// replica to replica (peers), or both, each decision then applied once.
// Sharing never delays a decision; while neither way works each replica
// routes on what it knows.
type ReplicasConfig struct {
	// Redis is the server the replicas share through (the shared KV
	// tier's will do): the stream keeps history, which a replica that
	// starts replays. Default: none.
	Redis kvstore.RedisConfig `yaml:"redis"`
	// Stream is the Redis stream's key, and the name the peers greet
	// each other with; replicas in front of different fleets need
	// different ones. Default baton:replica:commits.
	Stream string `yaml:"stream"`
	// Replay is how many of the newest messages a starting replica
	// applies before it follows the stream, and how many of its own
	// newest decisions a replica sends each peer it connects to, so that
	// one that starts learns what was decided before. Default 1000; -1:
	// none.
	Replay int64 `yaml:"replay"`
	// Peers sends each decision straight to the other replicas as it
	// commits: one hop instead of Redis's two. Default: none.
	Peers ReplicaPeersConfig `yaml:"peers"`
}

// ReplicaPeersConfig is where a replica takes the others' decisions, and
// where it finds the others: one of addresses, dns or kubernetes. A
// replica's own address may be among those found; it is recognised.
type ReplicaPeersConfig struct {
	// Listen is the host:port this replica takes the others' decisions
	// on, e.g. ":9401". Required with peers.
	Listen string `yaml:"listen"`
	// Addresses are the replicas' listen addresses (host:port each).
	Addresses []string `yaml:"addresses"`
	// DNS finds them by the records of a name: a headless Service of the
	// scheduler's pods, with the listen port.
	DNS discovery.DNSConfig `yaml:"dns"`
	// Kubernetes finds them by the EndpointSlices of such a Service; the
	// ServiceAccount needs get, list and watch on them.
	Kubernetes discovery.KubernetesConfig `yaml:"kubernetes"`
	// SecretFile is a file holding a secret every replica must hold to
	// send or take decisions straight (at least 16 bytes; surrounding
	// whitespace is not part of it), read at start: each end of a
	// connection proves it holds it before any decision crosses, and the
	// decisions cross encrypted and authenticated under a key of the
	// connection's own. Without it any replica that reaches listen and
	// names the same stream is taken at its word, and the decisions
	// cross in the clear.
	SecretFile string `yaml:"secret_file"`
	// ShareLoad relays each scrape of a vllm, sglang or llamacpp worker's
	// metrics to the other replicas, and skips a worker's scrape when
	// another replica relayed its load within three quarters of
	// metrics_interval: each engine serves about one replica's scrapes,
	// not one per replica, and every replica still takes its load each
	// interval. Default true; false: every replica scrapes every engine.
	ShareLoad *bool `yaml:"share_load"`
}

// shareLoad reports whether the replicas relay the engines' load to each
// other.
func (p ReplicaPeersConfig) shareLoad() bool { return p.set() && (p.ShareLoad == nil || *p.ShareLoad) }

// minSecret is the shortest secret_file's secret.
const minSecret = 16

// readSecret returns the secret of file, checked.
func readSecret(file string) ([]byte, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("secret_file: %w", err)
	}
	b = bytes.TrimSpace(b)
	if len(b) < minSecret {
		return nil, fmt.Errorf("secret_file: %s holds %d bytes, want at least %d", file, len(b), minSecret)
	}
	return b, nil
}

// set reports whether anything of p is configured.
func (p ReplicaPeersConfig) set() bool {
	return p.Listen != "" || p.SecretFile != "" || p.ShareLoad != nil || len(p.Addresses) > 0 || p.DNS != (discovery.DNSConfig{}) || p.Kubernetes != (discovery.KubernetesConfig{})
}

// enabled reports whether the replicas share.
func (c ReplicasConfig) enabled() bool { return c.Redis.Addr != "" || c.Peers.set() }

// validate reports what is wrong with c, naming the field.
func (c ReplicasConfig) validate() error {
	if !c.enabled() {
		if c.Stream != "" || c.Replay != 0 || c.Redis != (kvstore.RedisConfig{}) {
			return errors.New("replicas.redis.addr: required when replicas is set (or replicas.peers)")
		}
		return nil
	}
	if c.Redis != (kvstore.RedisConfig{}) {
		if err := c.Redis.Validate(); err != nil {
			return fmt.Errorf("replicas.redis.%w", err)
		}
	}
	if c.Replay < -1 {
		return fmt.Errorf("replicas.replay: must be -1 (none) or more, got %d", c.Replay)
	}
	if c.Peers.set() {
		if err := c.Peers.validate(); err != nil {
			return fmt.Errorf("replicas.peers.%w", err)
		}
	}
	return nil
}

func (p ReplicaPeersConfig) validate() error {
	if p.Listen == "" {
		return errors.New("listen: required, the host:port this replica takes the others' decisions on (e.g. :9401)")
	}
	if _, port, err := net.SplitHostPort(p.Listen); err != nil {
		return fmt.Errorf("listen: want host:port: %v", err)
	} else if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("listen: port must be 0–65535, got %q", port)
	}
	n := 0
	if len(p.Addresses) > 0 {
		n++
	}
	if p.DNS != (discovery.DNSConfig{}) {
		n++
	}
	if p.Kubernetes != (discovery.KubernetesConfig{}) {
		n++
	}
	if n != 1 {
		return errors.New("addresses: give the other replicas by one of addresses, dns or kubernetes")
	}
	if p.SecretFile != "" {
		if _, err := readSecret(p.SecretFile); err != nil {
			return err
		}
	}
	for i, a := range p.Addresses {
		if _, port, err := net.SplitHostPort(a); err != nil || port == "" {
			return fmt.Errorf("addresses[%d]: want host:port, got %q", i, a)
		}
	}
	if p.DNS != (discovery.DNSConfig{}) {
		if err := p.DNS.Validate(); err != nil {
			return fmt.Errorf("dns.%w", err)
		}
	}
	if p.Kubernetes != (discovery.KubernetesConfig{}) {
		if err := p.Kubernetes.Validate(); err != nil {
			return fmt.Errorf("kubernetes.%w", err)
		}
	}
	return nil
}

// source returns the discovery source of the peers' addresses.
func (p ReplicaPeersConfig) source(log *slog.Logger) (discovery.Source, error) {
	switch {
	case p.DNS != (discovery.DNSConfig{}):
		return discovery.NewDNS(p.DNS, log)
	case p.Kubernetes != (discovery.KubernetesConfig{}):
		return discovery.NewKubernetes(p.Kubernetes, log)
	}
	ms := make([]discovery.Member, len(p.Addresses))
	for i, a := range p.Addresses {
		ms[i] = discovery.Member{Name: a, Address: a}
	}
	return discovery.NewStatic(ms), nil
}

// sharing is a replica's link to the others, closed with the scheduler.
type sharing struct {
	sharer *replica.Sharer
	client *redis.Client // nil without redis
	peers  discovery.Source
	done   chan struct{} // closed once the peers' updates are all taken
	early  *earlyEntries
	// watcher takes the engines' load the other replicas relay, once the
	// scheduler has built it.
	watcher atomic.Pointer[watch.Watcher]
}

// relay returns the watch.Config.Relay of a scheduler sharing through sh
// under c: nil unless the replicas share the engines' load.
func (sh *sharing) relay(c ReplicasConfig) func(string, time.Time, vllm.Metrics) {
	if sh == nil || !c.Peers.shareLoad() {
		return nil
	}
	return func(worker string, at time.Time, m vllm.Metrics) {
		sh.sharer.PublishLoad(replica.Load{Worker: worker, At: at.UnixNano(), Report: m})
	}
}

func (s *sharing) close() {
	if s.peers != nil {
		s.peers.Close()
		<-s.done
	}
	s.sharer.Close()
	s.early.stop()
	if s.client != nil {
		s.client.Close()
	}
}

// startSharing starts sharing idx's predictions with the other replicas,
// and applying theirs to it.
func startSharing(c ReplicasConfig, idx *kvindex.Index, reg prometheus.Registerer, log *slog.Logger) (*sharing, error) {
	sh := &sharing{}
	if c.Redis.Addr != "" {
		var err error
		if sh.client, err = kvstore.NewClient(c.Redis); err != nil {
			return nil, fmt.Errorf("replicas.redis.%w", err)
		}
	}
	obs := newSyncMetrics(reg)
	sh.early = newEarlyEntries(idx, obs)
	cfg := replica.Config{
		Stream: c.Stream, Replay: c.Replay, Listen: c.Peers.Listen,
		Apply: func(e replica.Entry) {
			if !applyEntry(idx, e) {
				sh.early.keep(e)
			}
		},
		ApplyLoad: func(l replica.Load) {
			if w := sh.watcher.Load(); w != nil {
				w.Relayed(l.Worker, l.Report)
			}
		},
		Logger: log, Observer: obs,
	}
	if sh.client != nil {
		cfg.Client = sh.client
	}
	if c.Peers.SecretFile != "" {
		var err error
		if cfg.Secret, err = readSecret(c.Peers.SecretFile); err != nil {
			sh.early.stop()
			if sh.client != nil {
				sh.client.Close()
			}
			return nil, fmt.Errorf("replicas.peers.%w", err)
		}
	}
	var err error
	if sh.sharer, err = replica.New(cfg); err != nil {
		sh.early.stop()
		if sh.client != nil {
			sh.client.Close()
		}
		return nil, fmt.Errorf("replicas: %w", err)
	}
	if c.Peers.set() {
		if sh.peers, err = c.Peers.source(log); err != nil {
			sh.sharer.Close()
			sh.early.stop()
			if sh.client != nil {
				sh.client.Close()
			}
			return nil, fmt.Errorf("replicas.peers: %w", err)
		}
		sh.done = make(chan struct{})
		go func() {
			defer close(sh.done)
			for ms := range sh.peers.Updates() {
				addrs := make([]string, len(ms))
				for i, m := range ms {
					addrs[i] = m.Address
				}
				sh.sharer.SetPeers(addrs)
			}
		}()
	}
	log.Info("sharing with the other scheduler replicas", "redis", c.Redis.Addr, "peers_listen", sh.sharer.ListenAddr(), "replica", sh.sharer.ID())
	return sh, nil
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
	dropped, refused, loads  *prometheus.CounterVec
	missed, duplicates, lost prometheus.Counter
	up, peers                prometheus.Gauge
	lag                      *prometheus.HistogramVec
	unseen                   prometheus.Histogram
}

func newSyncMetrics(reg prometheus.Registerer) *syncMetrics {
	m := &syncMetrics{
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_messages_total",
			Help: "Messages of committed decisions this replica sent to the other scheduler replicas, or received and applied from them, via the Redis stream or straight from replica to replica (peer)."}, []string{"direction", "via"}),
		entries: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_entries_total",
			Help: "Committed decisions (a worker and the blocks it will hold) sent, or received and applied (not counting a second copy)."}, []string{"direction", "via"}),
		bytes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_bytes_total",
			Help: "Bytes of messages sent or received (their data, without Redis's framing)."}, []string{"direction", "via"}),
		dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_dropped_entries_total",
			Help: "Committed decisions not shared: queue_full (sharing fell behind) or redis_error, through the stream; peer_error, to one peer."}, []string{"reason"}),
		missed: prometheus.NewCounter(prometheus.CounterOpts{Name: "baton_replica_sync_missed_messages_total",
			Help: "Messages of other replicas this one never read from the stream, from the gaps in their sequence numbers (their decisions may have come straight from the replica: see lost_entries)."}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_peer_refused_total",
			Help: "Connections to this replica's peers listener closed before anything they sent was applied: greeting (not a replica's, or none in time), stream (a replica of another fleet), secret (no proof of replicas.peers.secret_file's secret)."}, []string{"reason"}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{Name: "baton_replica_sync_lost_entries_total",
			Help: "Decisions of other replicas that reached this one neither through the stream nor straight, counted once 4,096 newer decisions of the same replica have."}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{Name: "baton_replica_sync_duplicate_entries_total",
			Help: "Decisions that came a second way (the stream and a peer both) and were not applied again."}),
		up: prometheus.NewGauge(prometheus.GaugeOpts{Name: "baton_replica_sync_up",
			Help: "1 while the replicas' Redis answers (or none is configured), else 0."}),
		peers: prometheus.NewGauge(prometheus.GaugeOpts{Name: "baton_replica_sync_peers",
			Help: "Other replicas this one sends its decisions to straight, now."}),
		loads: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "baton_replica_sync_load_reports_total",
			Help: "Scrapes of engines' metrics relayed to a peer (sent, once per peer) or taken from one (received) in place of this replica's own scrape (replicas.peers.share_load)."}, []string{"direction"}),
		unseen: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "baton_replica_sync_unseen_seconds",
			Help:    "Decisions of other replicas that reached this one only after one of its picks that came after them, by how long before that pick they were made: what the lag cost (each counted once, at this replica's latest pick before it applied them).",
			Buckets: prometheus.ExponentialBuckets(0.00001, 2, 20)}),
		lag: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "baton_replica_sync_lag_seconds",
			Help:    "Time from another replica's commit of a decision to its application here (the oldest decision of each message), by the way that brought it first: how long this replica routed without knowing of it.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 17)}, []string{"via"}),
	}
	reg.MustRegister(m.messages, m.entries, m.bytes, m.dropped, m.refused, m.missed, m.duplicates, m.lost, m.up, m.peers, m.lag, m.loads, m.unseen)
	m.loads.WithLabelValues("sent")
	m.loads.WithLabelValues("received")
	m.up.Set(1)
	for _, via := range []string{replica.ViaRedis, replica.ViaPeer} {
		for _, vec := range []*prometheus.CounterVec{m.messages, m.entries, m.bytes} {
			vec.WithLabelValues("sent", via)
			vec.WithLabelValues("received", via)
		}
		m.lag.WithLabelValues(via)
	}
	for _, r := range []string{"queue_full", "redis_error", "peer_error", "unknown_worker"} {
		m.dropped.WithLabelValues(r)
	}
	for _, r := range []string{replica.RefusedGreeting, replica.RefusedStream, replica.RefusedSecret} {
		m.refused.WithLabelValues(r)
	}
	return m
}

func (m *syncMetrics) Sent(via string, entries, bytes int) {
	m.messages.WithLabelValues("sent", via).Inc()
	m.entries.WithLabelValues("sent", via).Add(float64(entries))
	m.bytes.WithLabelValues("sent", via).Add(float64(bytes))
}

func (m *syncMetrics) Received(via string, entries, bytes int, lag time.Duration) {
	m.messages.WithLabelValues("received", via).Inc()
	m.entries.WithLabelValues("received", via).Add(float64(entries))
	m.bytes.WithLabelValues("received", via).Add(float64(bytes))
	m.lag.WithLabelValues(via).Observe(max(lag, 0).Seconds())
}

func (m *syncMetrics) Dropped(reason string, n int) {
	m.dropped.WithLabelValues(reason).Add(float64(n))
}
func (m *syncMetrics) Gap(n int)        { m.missed.Add(float64(n)) }
func (m *syncMetrics) Duplicates(n int) { m.duplicates.Add(float64(n)) }
func (m *syncMetrics) Lost(n int)       { m.lost.Add(float64(n)) }
func (m *syncMetrics) Refused(reason string) {
	m.refused.WithLabelValues(reason).Inc()
}
func (m *syncMetrics) Peers(n int)            { m.peers.Set(float64(n)) }
func (m *syncMetrics) Unseen(d time.Duration) { m.unseen.Observe(d.Seconds()) }
func (m *syncMetrics) Loads(direction string, n, bytes int) {
	m.loads.WithLabelValues(direction).Add(float64(n))
}

func (m *syncMetrics) Up(up bool) {
	if up {
		m.up.Set(1)
	} else {
		m.up.Set(0)
	}
}

var _ replica.Observer = (*syncMetrics)(nil)
