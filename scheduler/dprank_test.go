package scheduler

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/scheduler/discovery"
)

func TestDataParallelSizeValidate(t *testing.T) {
	valid := func() Config {
		return Config{Workers: []WorkerConfig{{Name: "e", Address: "http://127.0.0.1:8001", Kind: KindVLLM,
			EngineConfig: EngineConfig{Events: "tcp://127.0.0.1:5557", EventsReplay: "tcp://127.0.0.1:5600", DataParallelSize: 4}}}}
	}
	if err := valid().Validate(registry()); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	sglang := valid()
	sglang.Workers[0].Kind = KindSGLang
	if err := sglang.Validate(registry()); err != nil {
		t.Fatalf("valid config of an sglang engine: %v", err)
	}
	for _, c := range []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"negative", func(c *Config) { c.Workers[0].DataParallelSize = -1 }, "workers[0].data_parallel_size:"},
		{"too large", func(c *Config) { c.Workers[0].DataParallelSize = 1000 }, "workers[0].data_parallel_size:"},
		{"sglang prefill", func(c *Config) {
			c.Workers[0].Kind, c.Workers[0].Role = KindSGLang, RolePrefill
		}, "workers[0].data_parallel_size:"},
		{"http", func(c *Config) {
			c.Workers[0].Kind = KindHTTP
			c.Workers[0].EngineConfig = EngineConfig{DataParallelSize: 2}
		}, "workers[0].data_parallel_size:"},
		{"ipc events", func(c *Config) { c.Workers[0].Events = "ipc:///tmp/kv" }, "workers[0].events:"},
		{"replay port past 65535", func(c *Config) { c.Workers[0].EventsReplay = "tcp://h:65534" }, "workers[0].events_replay:"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := valid()
			c.edit(&cfg)
			err := cfg.Validate(registry())
			if err == nil || !strings.HasPrefix(err.Error(), c.field) {
				t.Errorf("error %v, want one naming %s", err, c.field)
			}
		})
	}
}

func TestRanks(t *testing.T) {
	wc := WorkerConfig{Name: "v", Kind: KindVLLM, Address: "http://h:8000",
		EngineConfig: EngineConfig{Events: "tcp://h:5557", EventsReplay: "tcp://h:6000", DataParallelSize: 3}}
	var got []string
	for i, r := range wc.ranks() {
		got = append(got, r.Name+" "+r.Events+" "+r.EventsReplay+" "+r.Address)
		if rank, size := r.dpTarget(); rank != i || size != 3 {
			t.Errorf("%s: rank %d of %d; want rank %d of 3", r.Name, rank, size, i)
		}
	}
	want := []string{
		"v/dp0 tcp://h:5557 tcp://h:6000 http://h:8000",
		"v/dp1 tcp://h:5558 tcp://h:6001 http://h:8000",
		"v/dp2 tcp://h:5559 tcp://h:6002 http://h:8000",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("ranks (-want +got):\n%s", diff)
	}
	wc.DataParallelSize = 0
	if r := wc.ranks(); len(r) != 1 || r[0].Name != "v" || r[0].DataParallelSize > 1 {
		t.Errorf("without data parallelism: %+v, want the worker itself", r)
	}
}

// TestDiscoveredDataParallelSize: discovery's template may have
// data_parallel_size, checked as a static worker's; an endpoint whose
// kind label makes it other than vllm is refused.
func TestDiscoveredDataParallelSize(t *testing.T) {
	cfg := Config{Discovery: DiscoveryConfig{
		Mode: DiscoveryDNS, DNS: discovery.DNSConfig{Name: "vllm.baton.svc", Port: 8000},
		Worker: WorkerConfig{Kind: KindVLLM, EngineConfig: EngineConfig{Events: "tcp://{host}:5557", DataParallelSize: 2}},
	}}
	if err := cfg.Validate(registry()); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	cfg.Discovery.Worker.Events = "tcp://{host}:65535"
	if err := cfg.Validate(registry()); err == nil || !strings.HasPrefix(err.Error(), "discovery.worker.events:") {
		t.Errorf("error %v, want one naming discovery.worker.events", err)
	}
	_, err := memberConfig(discovery.Member{Name: "s", Address: "10.0.0.1:8000", Kind: KindHTTP}, WorkerConfig{Kind: KindVLLM, EngineConfig: EngineConfig{DataParallelSize: 2}})
	if err == nil || !strings.Contains(err.Error(), "discovery.worker.data_parallel_size") {
		t.Errorf("an http endpoint with data_parallel_size 2: error %v, want one naming discovery.worker.data_parallel_size", err)
	}
	wc, err := memberConfig(discovery.Member{Name: "v", Address: "10.0.0.1:8000"}, WorkerConfig{Kind: KindVLLM, EngineConfig: EngineConfig{Events: "tcp://{host}:5557", DataParallelSize: 2}})
	if err != nil {
		t.Fatal(err)
	}
	if r := wc.ranks(); len(r) != 2 || r[1].Name != "v/dp1" || r[1].Events != "tcp://10.0.0.1:5558" {
		t.Errorf("ranks of a discovered engine: %+v", r)
	}
}
