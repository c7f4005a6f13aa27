package scheduler

import (
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/scheduler/discovery"
)

// TestDiscoveryConfigErrorsNameTheField: a discovery section with a typo or
// a bad value fails to load or validate, and the error names the field.
func TestDiscoveryConfigErrorsNameTheField(t *testing.T) {
	cases := []struct {
		name, yaml, want string
	}{
		{"typo in mode", "discovery:\n  mod: dns\n", "discovery.mod: line 2: unknown field; did you mean mode?"},
		{"typo in dns", "discovery:\n  mode: dns\n  dns:\n    nmae: w\n", "discovery.dns.nmae: line 4: unknown field; did you mean name?"},
		{"typo in kubernetes", "discovery:\n  mode: kubernetes\n  kubernetes:\n    selectr: a=b\n", "discovery.kubernetes.selectr: line 4: unknown field; did you mean selector?"},
		{"typo in worker", "discovery:\n  mode: dns\n  worker:\n    rol: decode\n", "discovery.worker.rol: line 4: unknown field; did you mean role?"},
		{"interval not a duration", "discovery:\n  mode: dns\n  dns: {name: w, port: 9000, interval: 5}\n", "discovery.dns.interval: line 3: 5 is not a duration (e.g. 30s, 10m)"},
		{"unknown mode", "discovery: {mode: consul}\n", `discovery.mode: must be static, dns or kubernetes, got "consul"`},
		{"dns without name", "discovery: {mode: dns, dns: {port: 9000}}\n", "discovery.dns.name: required"},
		{"dns without port", "discovery: {mode: dns, dns: {name: w}}\n", "discovery.dns.port: must be 1–65535, got 0"},
		{"dns short interval", "discovery: {mode: dns, dns: {name: w, port: 1, interval: 1ms}}\n", "discovery.dns.interval: must be at least 100ms, got 1ms"},
		{"dns server without port", "discovery: {mode: dns, dns: {name: w, port: 1, server: 10.0.0.1}}\n", "discovery.dns.server: address 10.0.0.1: missing port in address"},
		{"kubernetes without selector", "discovery: {mode: kubernetes}\n", "discovery.kubernetes.selector: required, e.g. kubernetes.io/service-name=baton-decode"},
		{"kubernetes bad selector", "discovery: {mode: kubernetes, kubernetes: {selector: 'a in (b'}}\n", "discovery.kubernetes.selector: "},
		{"dns settings in kubernetes mode", "discovery: {mode: kubernetes, kubernetes: {selector: a=b}, dns: {name: w}}\n", "discovery.dns: set, but mode is kubernetes"},
		{"kubernetes settings in dns mode", "discovery: {mode: dns, dns: {name: w, port: 1}, kubernetes: {selector: a=b}}\n", "discovery.kubernetes: set, but mode is dns"},
		{"settings without mode", "discovery: {dns: {name: w, port: 1}}\nworkers: [{address: 'a:1'}]\n", "discovery.mode: dns or kubernetes settings are given, but mode is static"},
		{"workers too", "discovery: {mode: dns, dns: {name: w, port: 1}}\nworkers: [{address: 'a:1'}]\n", "workers: must be empty with discovery.mode dns"},
		{"worker template with address", "discovery: {mode: dns, dns: {name: w, port: 1}, worker: {address: 'a:1'}}\n", "discovery.worker.address: discovery finds each worker's address"},
		{"worker template bad role", "discovery: {mode: dns, dns: {name: w, port: 1}, worker: {role: leader}}\n", `discovery.worker.role: must be both, prefill or decode, got "leader"`},
		{"worker template bad kind", "discovery: {mode: dns, dns: {name: w, port: 1}, worker: {kind: triton}}\n", "discovery.worker.kind: must be grpc"},
		{"worker template events of grpc", "discovery: {mode: dns, dns: {name: w, port: 1}, worker: {events: 'tcp://{host}:5557'}}\n", "discovery.worker.events: only vllm and sglang workers have it"},
		{"worker template in static mode", "discovery: {worker: {role: decode}}\nworkers: [{address: 'a:1'}]\n", "discovery.worker: only dns and kubernetes discovery have it"},
		{"no workers, no discovery", "strategy: random\n", "workers: at least one worker is required (or discovery.mode dns or kubernetes)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := loadYAML(t, t.TempDir(), tc.yaml)
			if err == nil {
				err = cfg.Validate(registry())
			}
			if err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Errorf("error %v, want one starting %q", err, tc.want)
			}
		})
	}
}

func TestDiscoveryConfigLoads(t *testing.T) {
	cfg, err := loadYAML(t, t.TempDir(), `
strategy: kv_aware
discovery:
  mode: kubernetes
  kubernetes:
    namespace: baton
    selector: kubernetes.io/service-name in (baton-prefill, baton-decode)
    port: grpc
    resync: 1m
  worker:
    kind: vllm
    models: [llama-3.1-8b]
    events: tcp://{host}:5557
`)
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(registry()); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	want := DiscoveryConfig{
		Mode: DiscoveryKubernetes,
		Kubernetes: discovery.KubernetesConfig{
			Namespace: "baton", Selector: "kubernetes.io/service-name in (baton-prefill, baton-decode)", Port: "grpc", Resync: time.Minute,
		},
		Worker: WorkerConfig{Kind: KindVLLM, Models: []string{"llama-3.1-8b"}, EngineConfig: EngineConfig{Events: "tcp://{host}:5557"}},
	}
	if diff := cmp.Diff(want, cfg.Discovery, withRank); diff != "" {
		t.Errorf("discovery (-want +got):\n%s", diff)
	}
}

// TestMemberConfig: a discovered worker takes the template's settings,
// its labels' kind and role, and its host in the events endpoints.
func TestMemberConfig(t *testing.T) {
	tmpl := WorkerConfig{Kind: KindVLLM, Models: []string{"m"}, EngineConfig: EngineConfig{Events: "tcp://{host}:5557", EventsReplay: "tcp://{host}:5558"}}
	tests := []struct {
		m       discovery.Member
		want    WorkerConfig
		wantErr string
	}{
		{
			m: discovery.Member{Name: "vllm-0", Address: "10.0.0.7:8000", Role: RoleDecode},
			want: WorkerConfig{Name: "vllm-0", Address: "http://10.0.0.7:8000", Kind: KindVLLM, Role: RoleDecode, Models: []string{"m"},
				EngineConfig: EngineConfig{Events: "tcp://10.0.0.7:5557", EventsReplay: "tcp://10.0.0.7:5558"}},
		},
		{
			m: discovery.Member{Name: "w", Address: "[fd00::1]:8000"},
			want: WorkerConfig{Name: "w", Address: "http://[fd00::1]:8000", Kind: KindVLLM, Models: []string{"m"},
				EngineConfig: EngineConfig{Events: "tcp://[fd00::1]:5557", EventsReplay: "tcp://[fd00::1]:5558"}},
		},
		{m: discovery.Member{Name: "w", Address: "10.0.0.7:9000", Kind: KindGRPC}, wantErr: `baton.io/kind "grpc": discovery.worker has settings of vllm and sglang workers only (events)`},
		{m: discovery.Member{Name: "w", Address: "10.0.0.7:8000", Kind: "triton"}, wantErr: `baton.io/kind "triton": unknown kind`},
		{m: discovery.Member{Name: "w", Address: "10.0.0.7:8000", Role: "leader"}, wantErr: `baton.io/role "leader": unknown role`},
	}
	for _, tt := range tests {
		got, err := memberConfig(tt.m, tmpl)
		if tt.wantErr != "" {
			if err == nil || err.Error() != tt.wantErr {
				t.Errorf("memberConfig(%+v) error %v, want %q", tt.m, err, tt.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("memberConfig(%+v): %v", tt.m, err)
			continue
		}
		if diff := cmp.Diff(tt.want, got, withRank); diff != "" {
			t.Errorf("memberConfig(%+v) (-want +got):\n%s", tt.m, diff)
		}
	}
}

// withRank lets cmp compare WorkerConfigs, whose data-parallel rank is
// unexported.
var withRank = cmp.AllowUnexported(WorkerConfig{})
