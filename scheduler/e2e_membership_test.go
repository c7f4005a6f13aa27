package scheduler_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/openai/openai-go/v3"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	simfleet "github.com/batonllm/baton/bench/fleet"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/discovery"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/workers/sim"
)

// The tests of membership: workers that join and leave while the
// scheduler runs, found by DNS or in Kubernetes EndpointSlices.

// loopbackPort returns a port free on 127.0.0.1, on which the tests start
// workers at other loopback addresses (127.0.0.2, ...), as the pods behind
// one headless Service share a port.
func loopbackPort(t *testing.T) int {
	t.Helper()
	_, port, _ := net.SplitHostPort(freeAddr(t))
	p, _ := strconv.Atoi(port)
	return p
}

// startSim starts a simulated worker of role at addr, at scale.
func startSim(t *testing.T, name, role, addr string, scale float64) {
	t.Helper()
	w, err := sim.Start(sim.Config{Name: name, Role: role, TimeScale: scale}, addr, "", nil)
	if err != nil {
		t.Fatalf("sim.Start(%s at %s): %v", name, addr, err)
	}
	t.Cleanup(func() { w.Close() })
}

// dnsRecords is a DNS server on loopback answering A queries for one name
// from a list the test changes.
type dnsRecords struct {
	mu  sync.Mutex
	ips []string
}

func (d *dnsRecords) set(ips ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ips = ips
}

func (d *dnsRecords) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	d.mu.Lock()
	defer d.mu.Unlock()
	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	if q := req.Question[0]; q.Qtype == dns.TypeA {
		for _, ip := range d.ips {
			m.Answer = append(m.Answer, &dns.A{
				Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 1},
				A:   net.ParseIP(ip).To4(),
			})
		}
	}
	w.WriteMsg(m)
}

// startDNS serves records on a loopback UDP port and returns its address.
func startDNS(t *testing.T, records *dnsRecords) string {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan struct{})
	srv := &dns.Server{PacketConn: pc, Handler: records, NotifyStartedFunc: func() { close(started) }}
	go srv.ActivateAndServe()
	<-started
	t.Cleanup(func() { srv.Shutdown() })
	return pc.LocalAddr().String()
}

// names returns the names of the workers in p.
func names(p *pool.Pool) []string {
	var out []string
	for _, w := range p.Snapshot().Workers {
		out = append(out, w.Name)
	}
	return out
}

// poolIs waits until p holds exactly want.
func poolIs(t *testing.T, p *pool.Pool, want ...string) {
	t.Helper()
	slices.Sort(want)
	eventually(t, 30*time.Second, func() error {
		if got := names(p); !slices.Equal(got, want) {
			return fmt.Errorf("pool holds %v, want %v", got, want)
		}
		return nil
	})
}

// outcome is one request's outcome under load.
type outcome struct {
	worker string
	end    time.Time
	err    error
}

// load sends streaming chat completions of maxTokens through the
// openai-go client from n goroutines until stop is closed. results waits
// for them and returns every outcome; sofar returns those known now.
func load(t *testing.T, addr string, n int, maxTokens int64, stop <-chan struct{}) (results, sofar func() []outcome) {
	c := oaClient(t, addr)
	var (
		mu  sync.Mutex
		out []outcome
		wg  sync.WaitGroup
	)
	for g := range n {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				r, err := streamChat(t, c, chatParams(text(fmt.Sprintf("load %d-%d", g, i), 600), maxTokens))
				if apiErr := (*openai.Error)(nil); errors.As(err, &apiErr) {
					err = fmt.Errorf("%w: %s", err, apiErr.RawJSON())
				}
				mu.Lock()
				out = append(out, outcome{worker: r.worker, end: time.Now(), err: err})
				mu.Unlock()
			}
		})
	}
	results = func() []outcome {
		wg.Wait()
		return out
	}
	sofar = func() []outcome {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(out)
	}
	return results, sofar
}

// ringOwners returns the owner of each key on p's ring.
func ringOwners(p *pool.Pool, keys []uint64) []string {
	r := p.Snapshot().Ring
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = r.Member(r.Lookup(k))
	}
	return out
}

// TestDNSDiscoveryRemovesAWorkerUnderLoad: workers behind a DNS name join
// the pool; when one's record goes, it leaves the pool, the ring and the
// KV index within one interval, while requests keep flowing and none
// fails: those it was serving finish on it. When the record comes back it
// joins again, and its ring keys return to it.
func TestDNSDiscoveryRemovesAWorkerUnderLoad(t *testing.T) {
	port := loopbackPort(t)
	ips := []string{"127.0.0.2", "127.0.0.3", "127.0.0.4"}
	addr := func(ip string) string { return net.JoinHostPort(ip, strconv.Itoa(port)) }
	for i, ip := range ips {
		// A pace at which a request lasts a while, so that the worker
		// removed has some in flight.
		startSim(t, fmt.Sprintf("w%d", i), sim.RoleBoth, addr(ip), 5)
	}
	records := &dnsRecords{}
	records.set(ips...)
	server := startDNS(t, records)

	rec := &logRecorder{level: slog.LevelInfo}
	f := startFleetSpec(t, simfleet.Spec{Log: slog.New(rec), Scheduler: scheduler.Config{
		Strategy: "kv_aware", Pool: discoveryPool(),
		Discovery: scheduler.DiscoveryConfig{
			Mode: scheduler.DiscoveryDNS,
			DNS:  discovery.DNSConfig{Name: "workers.baton.test.", Port: port, Server: server, Interval: 100 * time.Millisecond},
		},
	}})
	s := f.Scheduler
	poolIs(t, s.Pool, addr(ips[0]), addr(ips[1]), addr(ips[2]))

	rng := rand.New(rand.NewPCG(3, 5))
	keys := make([]uint64, 20_000)
	for i := range keys {
		keys[i] = rng.Uint64()
	}
	before := ringOwners(s.Pool, keys)

	stop := make(chan struct{})
	// Requests long enough that one in flight on the worker when its
	// record goes is still running when the pool drops it.
	results, sofar := load(t, f.Addr, 6, 160, stop)
	gone := addr(ips[1])
	eventually(t, 30*time.Second, func() error {
		if w := s.Pool.Snapshot().Worker(gone); w == nil || w.InFlight() == 0 {
			return fmt.Errorf("no request in flight on %s yet", gone)
		}
		return nil
	})
	records.set(ips[0], ips[2])
	poolIs(t, s.Pool, addr(ips[0]), addr(ips[2]))
	removedAt := time.Now()
	// Keep the load up a little past the removal, then stop.
	eventually(t, 30*time.Second, func() error {
		if n := len(names(s.Pool)); n != 2 {
			return fmt.Errorf("%d workers", n)
		}
		var m [1]kvindex.Match
		s.Index.Lookup(nil, []string{gone}, m[:])
		if m[0].Known {
			return fmt.Errorf("KV index still tracks %s", gone)
		}
		return nil
	})
	// Keep the load up until as many requests as there are clients have
	// ended since, then stop.
	eventually(t, 30*time.Second, func() error {
		n := 0
		for _, r := range sofar() {
			if r.end.After(removedAt) && r.worker != gone {
				n++
			}
		}
		if n < 6 {
			return fmt.Errorf("%d requests ended on the other workers since the removal, want 6", n)
		}
		return nil
	})
	close(stop)
	out := results()

	failed, onGoneAfter, byWorker := 0, 0, map[string]int{}
	for _, r := range out {
		if r.err != nil {
			failed++
			t.Errorf("request failed during the removal: %v", r.err)
			continue
		}
		byWorker[r.worker]++
		if r.worker == gone && r.end.After(removedAt) {
			onGoneAfter++
		}
	}
	t.Logf("%d requests, %d failed, by worker %v; %d of the removed worker's ended after its removal", len(out), failed, byWorker, onGoneAfter)
	if onGoneAfter == 0 {
		t.Errorf("no request of %s ended after its removal: its requests in flight did not finish on it", gone)
	}
	eventually(t, 30*time.Second, func() error {
		for _, m := range rec.messages() {
			if strings.Contains(m, "worker drained") && strings.Contains(m, gone) {
				return nil
			}
		}
		return fmt.Errorf("no log of %s drained", gone)
	})
	m := scrapeSettled(t, httpClient(t), f.Addr)
	for _, c := range []struct {
		name, label string
		want        float64
	}{
		{"baton_discovered_workers", "", 2},
		{"baton_discovery_changes_total", `change="added"`, 3},
		{"baton_discovery_changes_total", `change="removed"`, 1},
		{"baton_worker_in_flight", `worker="` + gone + `"`, 0},
	} {
		var labels []string
		if c.label != "" {
			labels = append(labels, c.label)
		}
		if got, _ := metric(m, c.name, labels...); got != c.want {
			t.Errorf("%s{%s} = %v, want %v", c.name, c.label, got, c.want)
		}
	}

	// Only the removed worker's keys moved, and about a third of all.
	after := ringOwners(s.Pool, keys)
	moved := 0
	for i := range keys {
		if before[i] != after[i] {
			moved++
			if before[i] != gone {
				t.Fatalf("key %x moved from %s, which stayed, to %s", keys[i], before[i], after[i])
			}
		} else if before[i] == gone {
			t.Fatalf("key %x still owned by the removed %s", keys[i], gone)
		}
	}
	t.Logf("removing 1 of 3 workers moved %d of %d ring keys (%.1f%%; 1/N = 33.3%%)", moved, len(keys), 100*float64(moved)/float64(len(keys)))

	records.set(ips...)
	poolIs(t, s.Pool, addr(ips[0]), addr(ips[1]), addr(ips[2]))
	if diff := slices.Compare(before, ringOwners(s.Pool, keys)); diff != 0 {
		t.Error("the ring differs from before the worker left and came back")
	}
	c := oaClient(t, f.Addr)
	for i := range 6 {
		chat(t, c, chatParams(text(fmt.Sprintf("after %d", i), 600), 4))
	}
}

// endpointSlice is an EndpointSlice of service with a port named grpc, its
// workers' role in the baton.io/role label.
func endpointSlice(service, role string, port int, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	p, name := int32(port), "grpc"
	return &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: service + "-x1", Namespace: "baton", Labels: map[string]string{
			discoveryv1.LabelServiceName: service, discovery.LabelRole: role,
		}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   eps,
		Ports:       []discoveryv1.EndpointPort{{Name: &name, Port: &p}},
	}
}

func podEndpoint(pod, ip string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses:  []string{ip},
		Conditions: discoveryv1.EndpointConditions{Ready: &ready},
		TargetRef:  &corev1.ObjectReference{Kind: "Pod", Name: pod},
	}
}

// TestKubernetesDiscovery: pods found in EndpointSlices join the pools of
// their Services' roles, and disaggregated serving follows them as slices
// are added, turn not ready and are removed, with requests flowing and
// none failing.
func TestKubernetesDiscovery(t *testing.T) {
	port := loopbackPort(t)
	addr := func(ip string) string { return net.JoinHostPort(ip, strconv.Itoa(port)) }
	startSim(t, "decode-0", sim.RoleDecode, addr("127.0.0.2"), fastScale)
	startSim(t, "decode-1", sim.RoleDecode, addr("127.0.0.3"), fastScale)
	startSim(t, "prefill-0", sim.RolePrefill, addr("127.0.0.4"), fastScale)

	api := fake.NewClientset(endpointSlice("baton-decode", "decode", port,
		podEndpoint("decode-0", "127.0.0.2", true), podEndpoint("decode-1", "127.0.0.3", true)))
	f := startFleetSpec(t, simfleet.Spec{Scheduler: scheduler.Config{
		Strategy: "prefix_aware", Pool: discoveryPool(),
		Discovery: scheduler.DiscoveryConfig{
			Mode: scheduler.DiscoveryKubernetes,
			Kubernetes: discovery.KubernetesConfig{
				Namespace: "baton", Selector: "kubernetes.io/service-name in (baton-decode, baton-prefill)", Port: "grpc", Client: api,
			},
		},
	}})
	s := f.Scheduler
	poolIs(t, s.Pool, "decode-0", "decode-1")
	poolIs(t, s.PrefillPool)

	stop := make(chan struct{})
	results, _ := load(t, f.Addr, 4, 48, stop)
	ctx := context.Background()
	esl := api.DiscoveryV1().EndpointSlices("baton")

	// A prefill pool appears: requests are prefilled on it.
	if _, err := esl.Create(ctx, endpointSlice("baton-prefill", "prefill", port, podEndpoint("prefill-0", "127.0.0.4", true)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	poolIs(t, s.PrefillPool, "prefill-0")
	c := oaClient(t, f.Addr)
	if r := chat(t, c, chatParams(text("a long document", 4000), 4)); r.prefill != "prefill-0" {
		t.Errorf("prefilled on %q, want prefill-0 (route %q)", r.prefill, r.route)
	}

	// decode-1 terminates: its endpoint turns not ready.
	if _, err := esl.Update(ctx, endpointSlice("baton-decode", "decode", port,
		podEndpoint("decode-0", "127.0.0.2", true), podEndpoint("decode-1", "127.0.0.3", false)), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	poolIs(t, s.Pool, "decode-0")

	// The prefill Service goes away.
	if err := esl.Delete(ctx, "baton-prefill-x1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	poolIs(t, s.PrefillPool)
	close(stop)
	out := results()
	for _, r := range out {
		if r.err != nil {
			t.Errorf("request failed while workers left: %v", r.err)
		}
	}
	t.Logf("%d requests while the slices changed", len(out))
	if r := chat(t, c, chatParams(text("the end", 600), 4)); r.worker != "decode-0" || r.prefill != "" {
		t.Errorf("served by %q, prefilled on %q; want decode-0 alone", r.worker, r.prefill)
	}
}

// TestDiscoveredWorkerWaitsUntilItAnswers: a worker found before it is up
// is held pending, never routed to, until it describes itself; then it
// joins the pool of its role.
func TestDiscoveredWorkerWaitsUntilItAnswers(t *testing.T) {
	port := loopbackPort(t)
	addr := func(ip string) string { return net.JoinHostPort(ip, strconv.Itoa(port)) }
	startSim(t, "up", sim.RoleBoth, addr("127.0.0.2"), fastScale)
	records := &dnsRecords{}
	records.set("127.0.0.2", "127.0.0.3")
	server := startDNS(t, records)
	f := startFleetSpec(t, simfleet.Spec{Scheduler: scheduler.Config{
		Strategy: "round_robin", Pool: fastPool(),
		Discovery: scheduler.DiscoveryConfig{
			Mode: scheduler.DiscoveryDNS,
			DNS:  discovery.DNSConfig{Name: "workers.baton.test.", Port: port, Server: server, Interval: 100 * time.Millisecond},
		},
	}})
	s := f.Scheduler
	poolIs(t, s.Pool, addr("127.0.0.2"))
	eventually(t, 30*time.Second, func() error {
		if got := s.Pending(); !slices.Equal(got, []string{addr("127.0.0.3")}) {
			return fmt.Errorf("pending %v, want the worker not up", got)
		}
		return nil
	})
	c := oaClient(t, f.Addr)
	for i := range 4 {
		if r := chat(t, c, chatParams(text(fmt.Sprintf("before %d", i), 300), 4)); r.worker != addr("127.0.0.2") {
			t.Errorf("served by %s while the other worker is down", r.worker)
		}
	}
	startSim(t, "late", sim.RoleDecode, addr("127.0.0.3"), fastScale)
	poolIs(t, s.Pool, addr("127.0.0.2"), addr("127.0.0.3"))
	if got := s.Pending(); len(got) != 0 {
		t.Errorf("pending %v once both answer", got)
	}
	seen := map[string]bool{}
	for i := range 4 {
		seen[chat(t, c, chatParams(text(fmt.Sprintf("after %d", i), 300), 4)).worker] = true
	}
	if !seen[addr("127.0.0.3")] {
		t.Errorf("round_robin over 4 requests never chose the worker that joined: %v", seen)
	}
}

// engineSlice is an EndpointSlice holding one fake engine, pod name, at
// the engine's loopback port.
func engineSlice(t *testing.T, pod, url string) *discoveryv1.EndpointSlice {
	t.Helper()
	_, port, err := net.SplitHostPort(strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	p, _ := strconv.Atoi(port)
	es := endpointSlice("vllm", "both", p, podEndpoint(pod, "127.0.0.1", true))
	es.Name = pod
	es.Labels = map[string]string{"app": "vllm"}
	return es
}

// TestKubernetesDiscoveredEnginesTokenize: with discovered vllm workers and
// kv_aware, requests are keyed by the tokens of the first engine by name,
// and by the next one's once it leaves.
func TestKubernetesDiscoveredEnginesTokenize(t *testing.T) {
	e0 := startFakeEngine(t, vllmMetrics(0, 0, 0, 1000))
	e1 := startFakeEngine(t, vllmMetrics(0, 0, 0, 1000))
	api := fake.NewClientset(engineSlice(t, "v0", e0.srv.URL), engineSlice(t, "v1", e1.srv.URL))
	f := startFleetSpec(t, simfleet.Spec{Scheduler: scheduler.Config{
		Strategy: "kv_aware", Pool: fastPool(),
		Discovery: scheduler.DiscoveryConfig{
			Mode:       scheduler.DiscoveryKubernetes,
			Kubernetes: discovery.KubernetesConfig{Namespace: "baton", Selector: "app=vllm", Port: "grpc", Client: api},
			Worker: scheduler.WorkerConfig{Kind: scheduler.KindVLLM, Models: []string{model},
				EngineConfig: scheduler.EngineConfig{MetricsInterval: 50 * time.Millisecond}},
		},
	}})
	s := f.Scheduler
	poolIs(t, s.Pool, "v0", "v1")
	c := oaClient(t, f.Addr)
	chat(t, c, chatParams(longPrefix(100), 8))
	if got0, got1 := e0.tokenizeCalls(), e1.tokenizeCalls(); got0 != 1 || got1 != 0 {
		t.Errorf("tokenize calls: v0 %d, v1 %d; want 1 and 0 (v0 is first by name)", got0, got1)
	}
	if err := api.DiscoveryV1().EndpointSlices("baton").Delete(context.Background(), "v0", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	poolIs(t, s.Pool, "v1")
	chat(t, c, chatParams(longPrefix(101), 8))
	if got0, got1 := e0.tokenizeCalls(), e1.tokenizeCalls(); got0 != 1 || got1 != 1 {
		t.Errorf("tokenize calls after v0 left: v0 %d, v1 %d; want 1 and 1", got0, got1)
	}
	m := scrapeSettled(t, httpClient(t), f.Addr)
	if got, _ := metric(m, "baton_tokenize_total", `outcome="miss"`); got != 2 {
		t.Errorf(`baton_tokenize_total{outcome="miss"} = %v, want 2`, got)
	}
}

// discoveryPool is fastPool with health checks a loaded -race run meets: in the tests where membership follows discovery while requests
// flow and none may fail, a 100 ms timeout would mark the workers that
// stay down, and count the machine's slowness as a failed removal.
func discoveryPool() pool.Config {
	c := fastPool()
	c.HealthInterval, c.HealthTimeout = 2*time.Second, 2*time.Second
	return c
}
