package scheduler

import (
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// FuzzNew: a configuration that loads and validates builds a scheduler
// without panicking. Each worker's address, events endpoints and DNS
// server are pointed at a closed loopback port first, so that New wires
// every kind of worker (clients, scrapers, event subscribers, data-parallel
// ranks) without reaching a network; what the fuzzer varies is the rest:
// names, kinds, roles, strategies, profiles, adapters, ranks.
func FuzzNew(f *testing.F) {
	for _, seed := range []string{
		// A one-character name on a vllm worker with events once panicked
		// New (its rank was parsed back out of the name).
		"strategy: kv_aware\nworkers: [{name: a, address: 'http://127.0.0.1:1', kind: vllm, events: 'tcp://127.0.0.1:5557'}]\n",
		"strategy: kv_aware\nworkers: [{name: b, address: 'http://127.0.0.1:1', kind: sglang, events: 'tcp://127.0.0.1:5557', data_parallel_size: 2}]\n",
		"strategy: kv_aware\nworkers: [{name: x/dp, address: 'http://127.0.0.1:1', kind: vllm, events: 'tcp://127.0.0.1:5557', events_replay: 'tcp://127.0.0.1:5600', data_parallel_size: 3}]\n",
		"strategy: prefix_aware\nworkers: [{address: '127.0.0.1:1'}, {name: l, address: 'http://127.0.0.1:1', kind: llamacpp, cache_prompts: 2}]\n",
		"workers: [{name: p, address: 'http://127.0.0.1:1', kind: vllm, role: prefill}, {name: d, address: 'http://127.0.0.1:1', kind: vllm, role: decode}]\n",
		"strategy: kv_aware\nreplicas: {peers: {listen: '127.0.0.1:0', addresses: ['127.0.0.1:1', '127.0.0.1:0']}}\nworkers: [{address: '127.0.0.1:1'}]\n",
		"adapters: [{name: sql}]\nworkers: [{name: h, address: 'http://127.0.0.1:1', kind: http, max_loras: 2}]\n",
	} {
		f.Add([]byte(seed))
	}
	reg := registry()
	dir := f.TempDir()
	closed := closedPort(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		path := filepath.Join(dir, "c.yaml")
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := LoadConfig(path)
		if err != nil || cfg.Validate(reg) != nil {
			return
		}
		offline(&cfg, closed)
		if cfg.Discovery.Mode == DiscoveryKubernetes {
			return // it would look for a cluster
		}
		if cfg.Validate(reg) != nil {
			return
		}
		s, err := New(cfg, reg, nil)
		if err != nil {
			return
		}
		s.Close()
	})
}

// closedPort returns a loopback port nothing listens on.
func closedPort(tb testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(l.Addr().String())
	l.Close()
	return port
}

// offline points every address of cfg at 127.0.0.1:port, keeping each
// address's scheme, and every events endpoint at a loopback port of its
// own rank range.
func offline(cfg *Config, port string) {
	redirect := func(w *WorkerConfig) {
		if w.Address != "" {
			if u, err := url.Parse(w.Address); err == nil && u.Scheme != "" && strings.Contains(w.Address, "://") {
				u.Host = net.JoinHostPort("127.0.0.1", port)
				w.Address = u.String()
			} else {
				w.Address = net.JoinHostPort("127.0.0.1", port)
			}
		}
		for _, e := range []*string{&w.Events, &w.EventsReplay} {
			if *e == "" || strings.Contains(*e, "{host}") {
				continue
			}
			if i := strings.LastIndexByte(*e, ':'); i >= 0 {
				if p, err := strconv.Atoi((*e)[i+1:]); err == nil {
					*e = "tcp://127.0.0.1:" + strconv.Itoa(p)
				}
			}
		}
	}
	for i := range cfg.Workers {
		redirect(&cfg.Workers[i])
	}
	redirect(&cfg.Discovery.Worker)
	if cfg.Discovery.DNS.Server != "" || cfg.Discovery.Mode == DiscoveryDNS {
		cfg.Discovery.DNS.Server = net.JoinHostPort("127.0.0.1", port)
	}
}
