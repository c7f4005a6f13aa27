package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/batonllm/baton/bench/haproxy"
)

// fleet is the disaggregated fleet under test: a redis-server behind a
// delaying proxy, prefill and decode baton workers using it as their
// shared tier, each behind a link proxy that every connection to it
// passes through (the schedulers' calls, and the KV blocks prefill
// workers push to decode workers), and baton serve replicas in front.
type fleet struct {
	dir, bin  string
	timeScale float64

	redis     *proc
	redisAddr string      // the server's own address
	redisPx   *delayProxy // what workers dial

	workers map[string]*proc      // by name: p0, p1, d0, d1
	addrs   map[string]string     // where each worker listens
	links   map[string]*linkProxy // in front of each worker: its address in the configuration
	metrics map[string]string     // each worker's /metrics base URL
	names   []string
	started map[string]time.Time // when each worker last started listening

	scheds []*proc
	bases  []string // http://host:port of each replica
	// clients are the URLs the clients send to: bases, or HAProxy's
	// alone in front of them (lb).
	clients []string
	lb      *haproxy.Proxy
	// sharePx are the replicas' own ways to Redis for what they share,
	// each through the workers' proxy: cutting one partitions a replica
	// from the others.
	sharePx []*delayProxy
	// peerPx[i][j] is replica i's way to replica j's peer listener
	// (replicas.peers; nil for i == j): cutting replica 1's, both ways,
	// partitions it from the others.
	peerPx [][]*delayProxy
}

// Scheduler settings of the fleet: a worker's capacity and the queue are
// small, so that a burst at three times capacity is a few hundred streams.
const (
	maxInFlight = 32
	maxQueue    = 32
)

// With lb (an HAProxy binary) the clients send to an HAProxy in front of
// the replicas, which drain for lbDrainDelay before they stop accepting.
func startFleet(ctx context.Context, dir, bin string, prefill, decode, replicas int, timeScale float64, lb string) (*fleet, error) {
	f := &fleet{dir: dir, bin: bin, timeScale: timeScale, workers: map[string]*proc{}, addrs: map[string]string{},
		links: map[string]*linkProxy{}, metrics: map[string]string{}, started: map[string]time.Time{}}
	rbin, err := redisServer()
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	f.redisAddr = loopback(port)
	rdir := filepath.Join(dir, "redis")
	if err := os.MkdirAll(rdir, 0o755); err != nil {
		return nil, err
	}
	f.redis = newProc(dir, "redis", rbin, redisArgs(port, rdir)...)
	if err := f.startRedis(); err != nil {
		f.close()
		return nil, err
	}
	if f.redisPx, err = newDelayProxy(f.redisAddr); err != nil {
		f.close()
		return nil, err
	}
	var yaml strings.Builder
	fmt.Fprintf(&yaml, `strategy: kv_aware
log_level: warn
drain_timeout: 5s
drain_delay: DRAIN_DELAY
request_timeout: 30s
max_in_flight: %d
max_queue: %d
queue_timeout: 2s
pool:
  health_interval: 500ms
  health_timeout: 400ms
  breaker_open_timeout: 2s
disaggregation:
  transfer_timeout: 2s
replicas:
  redis: {addr: "SHARE_REDIS"}
  peers: SHARE_PEERS
workers:
`, maxInFlight, maxQueue)
	for i := range prefill + decode {
		role, name := "prefill", fmt.Sprintf("p%d", i)
		if i >= prefill {
			role, name = "decode", fmt.Sprintf("d%d", i-prefill)
		}
		port, err := freePort()
		if err != nil {
			f.close()
			return nil, err
		}
		f.addrs[name] = loopback(port)
		if f.links[name], err = newLinkProxy(f.addrs[name]); err != nil {
			f.close()
			return nil, err
		}
		mport, err := freePort()
		if err != nil {
			f.close()
			return nil, err
		}
		f.metrics[name] = "http://" + loopback(mport)
		f.names = append(f.names, name)
		fmt.Fprintf(&yaml, "  - {name: %s, address: %q, role: %s}\n", name, f.links[name].addr(), role)
		f.workers[name] = f.workerProc(name, role, timeScale)
		if err := f.startWorker(name); err != nil {
			f.close()
			return nil, err
		}
	}
	peerListen := make([]string, replicas)
	for i := range peerListen {
		port, err := freePort()
		if err != nil {
			f.close()
			return nil, err
		}
		peerListen[i] = loopback(port)
	}
	f.peerPx = make([][]*delayProxy, replicas)
	for i := range replicas {
		f.peerPx[i] = make([]*delayProxy, replicas)
		for j := range replicas {
			if i == j {
				continue
			}
			px, err := newDelayProxy(peerListen[j])
			if err != nil {
				f.close()
				return nil, err
			}
			f.peerPx[i][j] = px
		}
	}
	for i := range replicas {
		var peers []string
		for _, px := range f.peerPx[i] {
			if px != nil {
				peers = append(peers, strconv.Quote(px.addr()))
			}
		}
		px, err := newDelayProxy(f.redisPx.addr())
		if err != nil {
			f.close()
			return nil, err
		}
		f.sharePx = append(f.sharePx, px)
		config := filepath.Join(dir, fmt.Sprintf("baton-%d.yaml", i))
		drainDelay := "0s"
		if lb != "" {
			drainDelay = lbDrainDelay.String()
		}
		if err := os.WriteFile(config, []byte(strings.NewReplacer("SHARE_REDIS", px.addr(), "DRAIN_DELAY", drainDelay,
			"SHARE_PEERS", fmt.Sprintf("{listen: %q, addresses: [%s]}", peerListen[i], strings.Join(peers, ", "))).Replace(yaml.String())), 0o644); err != nil {
			f.close()
			return nil, err
		}
		port, err := freePort()
		if err != nil {
			f.close()
			return nil, err
		}
		addr := loopback(port)
		p := newProc(dir, fmt.Sprintf("serve%d", i), bin, "serve", "--config", config, "--listen", addr)
		f.scheds = append(f.scheds, p)
		f.bases = append(f.bases, "http://"+addr)
		if err := f.startScheduler(ctx, i); err != nil {
			f.close()
			return nil, err
		}
	}
	f.clients = f.bases
	if lb != "" {
		var servers []string
		for _, base := range f.bases {
			servers = append(servers, strings.TrimPrefix(base, "http://"))
		}
		if f.lb, err = haproxy.Start(lb, func(bind string) string { return haproxy.Replicas(bind, servers) }); err != nil {
			f.close()
			return nil, err
		}
		f.clients = []string{"http://" + f.lb.Addr}
	}
	return f, nil
}

// lbDrainDelay is the replicas' drain_delay behind HAProxy: three of its
// /readyz checks, so that it has taken a draining replica out before the
// replica stops accepting.
const lbDrainDelay = 3 * haproxy.CheckInterval

// partition cuts replica i off from what the replicas share (down), or
// restores its links: its way to Redis and its peer links both ways.
func (f *fleet) partition(i int, down bool) {
	f.sharePx[i].setDown(down)
	for j := range f.peerPx {
		if px := f.peerPx[i][j]; px != nil {
			px.setDown(down)
		}
		if px := f.peerPx[j][i]; px != nil {
			px.setDown(down)
		}
	}
}

func (f *fleet) workerProc(name, role string, timeScale float64) *proc {
	return newProc(f.dir, name, f.bin, "worker", "--name", name, "--listen", f.addrs[name], "--role", role,
		"--redis", f.redisPx.addr(), "--time-scale", strconv.FormatFloat(timeScale, 'g', -1, 64),
		"--metrics-listen", strings.TrimPrefix(f.metrics[name], "http://"),
		"--log-level", "warn", "--drain-timeout", "5s")
}

func (f *fleet) startRedis() error {
	if err := f.redis.start(); err != nil {
		return err
	}
	return waitTCP(f.redis, f.redisAddr, 10*time.Second)
}

func (f *fleet) startWorker(name string) error {
	p := f.workers[name]
	if err := p.start(); err != nil {
		return err
	}
	err := waitTCP(p, f.addrs[name], 20*time.Second)
	f.started[name] = time.Now()
	return err
}

// restartWorker replaces a stopped worker with one at timeScale.
func (f *fleet) restartWorker(name string, timeScale float64) error {
	role := "prefill"
	if strings.HasPrefix(name, "d") {
		role = "decode"
	}
	f.workers[name] = f.workerProc(name, role, timeScale)
	return f.startWorker(name)
}

func (f *fleet) startScheduler(ctx context.Context, i int) error {
	if err := f.scheds[i].start(); err != nil {
		return err
	}
	return waitReady(ctx, f.scheds[i], f.bases[i], len(f.names), 30*time.Second)
}

// waitAll waits until every replica sees every worker available again.
func (f *fleet) waitAll(ctx context.Context, timeout time.Duration) error {
	for i := range f.scheds {
		if err := waitReady(ctx, f.scheds[i], f.bases[i], len(f.names), timeout); err != nil {
			return err
		}
	}
	return nil
}

// scrapeWorkers scrapes every worker's /metrics; one that does not answer
// (killed) is left out.
func (f *fleet) scrapeWorkers(ctx context.Context) map[string]metrics {
	out := map[string]metrics{}
	for name, base := range f.metrics {
		if m, err := scrape(ctx, base); err == nil {
			out[name] = m
		}
	}
	return out
}

func (f *fleet) close() {
	if f.lb != nil {
		f.lb.Stop()
	}
	for _, p := range f.scheds {
		p.stop(10 * time.Second)
	}
	for _, p := range f.workers {
		p.stop(10 * time.Second)
	}
	for _, l := range f.links {
		l.close()
	}
	for _, px := range f.sharePx {
		px.close()
	}
	for _, row := range f.peerPx {
		for _, px := range row {
			if px != nil {
				px.close()
			}
		}
	}
	if f.redisPx != nil {
		f.redisPx.close()
	}
	if f.redis != nil {
		f.redis.kill()
	}
}
