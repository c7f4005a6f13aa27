package scheduler

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"go.yaml.in/yaml/v3"

	"github.com/batonllm/baton/scheduler/pool"
)

// loadYAML writes text to a file and loads it.
func loadYAML(t testing.TB, dir, text string) (Config, error) {
	t.Helper()
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path)
	if err != nil {
		// Every error names the file first.
		msg, ok := strings.CutPrefix(err.Error(), path+": ")
		if !ok {
			t.Fatalf("error %q does not start with the file's path", err)
		}
		return cfg, errorString(msg)
	}
	return cfg, nil
}

type errorString string

func (e errorString) Error() string { return string(e) }

func TestLoadConfigErrorsNameTheField(t *testing.T) {
	cases := []struct {
		name, yaml, want string
	}{
		{"negative uint", "listen: ':8080'\n\npool:\n  breaker_failures: -1\n",
			"pool.breaker_failures: line 4: -1 is not a non-negative integer"},
		{"uint too large", "pool: {breaker_half_open_requests: 4294967296}\n",
			"pool.breaker_half_open_requests: line 1: 4294967296 is not a non-negative 32-bit integer"},
		{"duration in words", "strategy: random\nrequest_timeout: ten minutes\n",
			`request_timeout: line 2: "ten minutes" is not a duration (e.g. 30s, 10m)`},
		{"duration without unit", "disaggregation:\n  transfer_timeout: 30\n",
			"disaggregation.transfer_timeout: line 2: 30 is not a duration (e.g. 30s, 10m)"},
		{"int a string", "retries: two\n", `retries: line 1: "two" is not an integer`},
		{"int a fraction", "max_in_flight: 2.5\n", "max_in_flight: line 1: 2.5 is not an integer"},
		{"string a list", "strategy: [random]\n", "strategy: line 1: a list is not a string"},
		{"list a string", "models: llama\n", `models: line 1: "llama" is not a list`},
		{"struct a scalar", "pool: 3\n", "pool: line 1: 3 is not a mapping of fields"},
		{"document a list", "- 1\n", "line 1: a list is not a mapping of fields"},
		{"worker field", "workers:\n  - address: a:1\n  - address: b:1\n    models: m\n",
			`workers[1].models: line 4: "m" is not a list`},
		{"typo", "pool:\n  breaker_failure: 3\n",
			"pool.breaker_failure: line 2: unknown field; did you mean breaker_failures?"},
		{"typo of an inlined field", "strategy: prefix_aware\nconcurency_threshold: 4\n",
			"concurency_threshold: line 2: unknown field; did you mean concurrency_threshold?"},
		{"typo in a worker", "workers: [{adress: 'a:1'}]\n",
			"workers[0].adress: line 1: unknown field; did you mean address?"},
		{"typo in a vllm field", "workers:\n  - {address: 'http://v:8000', kind: vllm, events: 'tcp://v:5557', event_topic: kv}\n",
			"workers[0].event_topic: line 2: unknown field; did you mean events_topic?"},
		{"vllm field of the wrong type", "workers:\n  - address: http://v:8000\n    kind: sglang\n    events_bind: maybe\n",
			`workers[0].events_bind: line 4: "maybe" is not true or false`},
		{"unknown field", "disaggregation: {speed: 3}\n",
			"disaggregation.speed: line 1: unknown field (known: decode_strategy, min_remote_prefill_tokens, transfer_timeout, prefill_retries)"},
		{"Go name", "Listen: ':80'\n", "Listen: line 1: unknown field; did you mean listen?"},
		{"null key", "pool:\n  ~: 3\n", "pool: line 2: a field must be named"},
		{"set twice", "listen: a:1\nlisten: b:1\n", "listen: line 2: set twice (first on line 1)"},
		{"recursive merge", "pool: &p {<<: *p}\n", "pool: line 1: nested too deeply (a recursive alias?)"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := loadYAML(t, t.TempDir(), c.yaml)
			if err == nil || err.Error() != c.want {
				t.Errorf("got %v\nwant %s", err, c.want)
			}
		})
	}
}

// Every field decodes as yaml.v3 decodes it, aliases and merges included.
func TestLoadConfigDecodesEveryField(t *testing.T) {
	const text = `
listen: 0.0.0.0:8080
strategy: kv_aware
log_level: debug
concurrency_threshold: 8
models: [a, b]
prefix_length: 2048
max_body_bytes: 0x100000
retries: -1
request_timeout: 1m30s
max_in_flight: 1_000
max_queue: -1
queue_timeout: 2s
pool: &pool
  breaker_failures: 3
  breaker_open_timeout: 1s
  breaker_half_open_requests: 2
  health_interval: 500ms
  health_timeout: 250ms
  unhealthy_after: 4
  health_concurrency: 8
  virtual_nodes: 100
disaggregation:
  decode_strategy: random
  min_remote_prefill_tokens: 1
  transfer_timeout: 3s
  prefill_retries: 2
workers:
  - &w {name: p0, address: 'p0:9000', role: prefill, models: [a]}
  - {<<: *w, name: p1, address: 'p1:9000'}
  - name: ~
    address: http://v:8000
    kind: http
  - name: e0
    address: http://e0:8000
    kind: vllm
    events: tcp://e0:5557
    events_replay: tcp://e0:5558
    events_topic: kv-events
    events_bind: true
    metrics_path: /engine/metrics
    metrics_interval: 100ms
    metrics_timeout: 2s
    block_size: 32
`
	got, err := loadYAML(t, t.TempDir(), text)
	if err != nil {
		t.Fatal(err)
	}
	want := Config{
		Listen: "0.0.0.0:8080", Strategy: "kv_aware", LogLevel: "debug",
		Pool: pool.Config{BreakerFailures: 3, BreakerOpenTimeout: time.Second, BreakerHalfOpenRequests: 2,
			HealthInterval: 500 * time.Millisecond, HealthTimeout: 250 * time.Millisecond,
			UnhealthyAfter: 4, HealthConcurrency: 8, VirtualNodes: 100},
		Disaggregation: DisaggConfig{DecodeStrategy: "random", MinRemotePrefillTokens: 1,
			TransferTimeout: 3 * time.Second, PrefillRetries: 2},
		Workers: []WorkerConfig{
			{Name: "p0", Address: "p0:9000", Role: RolePrefill, Models: []string{"a"}},
			{Name: "p1", Address: "p1:9000", Role: RolePrefill, Models: []string{"a"}},
			{Address: "http://v:8000", Kind: KindHTTP},
			{Name: "e0", Address: "http://e0:8000", Kind: KindVLLM, EngineConfig: EngineConfig{
				Events: "tcp://e0:5557", EventsReplay: "tcp://e0:5558", EventsTopic: "kv-events", EventsBind: true,
				MetricsPath: "/engine/metrics", MetricsInterval: 100 * time.Millisecond, MetricsTimeout: 2 * time.Second, BlockSize: 32,
			}},
		},
	}
	want.ConcurrencyThreshold = 8
	want.Models = []string{"a", "b"}
	want.PrefixLength = 2048
	want.MaxBodyBytes = 1 << 20
	want.Retries = -1
	want.RequestTimeout = 90 * time.Second
	want.MaxInFlight = 1000
	want.MaxQueue = -1
	want.QueueTimeout = 2 * time.Second
	opt := cmp.Options{cmpopts.IgnoreFields(Config{}, "Rand"), withRank}
	if diff := cmp.Diff(want, got, opt); diff != "" {
		t.Errorf("LoadConfig (-want +got):\n%s", diff)
	}
	var plain Config
	dec := yaml.NewDecoder(strings.NewReader(text))
	dec.KnownFields(true)
	if err := dec.Decode(&plain); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(plain, got, opt); diff != "" {
		t.Errorf("LoadConfig and yaml.v3 differ (-yaml +LoadConfig):\n%s", diff)
	}
}

// A file with nothing set means every default.
func TestLoadConfigEmpty(t *testing.T) {
	for _, text := range []string{"", "# nothing yet\n", "---\n"} {
		got, err := loadYAML(t, t.TempDir(), text)
		if err != nil || !cmp.Equal(got, Config{}, cmpopts.IgnoreFields(Config{}, "Rand"), withRank) {
			t.Errorf("%q: got %+v, %v; want the zero Config", text, got, err)
		}
	}
}

func TestValidateListsLogLevels(t *testing.T) {
	cfg := Config{LogLevel: "verbose", Workers: []WorkerConfig{{Address: "127.0.0.1:9000"}}}
	err := cfg.Validate(registry())
	const want = `log_level: must be debug, info, warn or error, got "verbose"`
	if err == nil || err.Error() != want {
		t.Errorf("got %v, want %s", err, want)
	}
}

// fraction matches the error of a fractional integer.
var fraction = regexp.MustCompile(`: line \d+: \S*[.eE]\S* is not an integer$`)

// FuzzLoadConfigAgreesWithYAML: what yaml.v3 with KnownFields decodes,
// LoadConfig decodes the same, but for fractional integers, which yaml.v3
// truncates, and keys that are not names, which it skips: LoadConfig
// rejects both.
func FuzzLoadConfigAgreesWithYAML(f *testing.F) {
	f.Add([]byte("strategy: prefix_aware\nworkers: [{address: '127.0.0.1:1'}]\n"))
	f.Add([]byte("pool: {health_interval: 1s, breaker_failures: 7}\nworkers: [&w {address: 'http://x:1', kind: http}, {<<: *w, name: y}]\n"))
	f.Add([]byte("max_body_bytes: 0o777\nretries: 1.0\nmodels: [1, true, ~]\n"))
	f.Add([]byte("max_queue: 2.5\n"))
	f.Add([]byte("profiles: [{name: p, filters: [available, {type: adapter, options: {load: true}}], scorers: [{name: a, type: prefix, weight: 2, options: {concurrency_threshold: 4}}], picker: {type: max}}]\n"))
	f.Add([]byte("profiles: [{name: p, picker: round_robin, scorers: [{name: l, type: load, options: &o {x: 1}}, {name: m, options: *o}]}]\n"))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		var want Config
		dec := yaml.NewDecoder(bytes.NewReader(b))
		dec.KnownFields(true)
		if dec.Decode(&want) != nil {
			return
		}
		got, err := loadYAML(t, dir, string(b))
		if err != nil && (fraction.MatchString(err.Error()) || strings.HasSuffix(err.Error(), "a field must be named")) {
			return // yaml.v3 truncates fractions and skips keys it cannot name
		}
		if err != nil {
			t.Fatalf("yaml.v3 decodes %q, LoadConfig: %v", b, err)
		}
		if diff := cmp.Diff(want, got, cmpopts.IgnoreFields(Config{}, "Rand"), withRank); diff != "" {
			t.Fatalf("%q (-yaml +LoadConfig):\n%s", b, diff)
		}
	})
}
