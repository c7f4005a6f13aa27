package deploy

import (
	"cmp"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
	"github.com/batonllm/baton/workers/sim"
)

// The checks below read the built output of every kustomization, so they
// see what a cluster would be given: names with kustomize's hash suffixes,
// patches applied, deleted objects gone.

// batonNamespace is where every object goes; the scheduler configs'
// worker addresses and the workers' --redis name it.
const batonNamespace = "baton"

// workload is a Deployment or a StatefulSet, as far as the checks go.
type workload struct {
	kind, name, namespace string
	replicas              int32 // 1 when unset, as the API server defaults it
	selector              *metav1.LabelSelector
	pod                   *corev1.PodTemplateSpec
	serviceName           string // StatefulSet only
}

func (w workload) String() string { return w.kind + " " + w.name }

func (o *objects) workloads() []workload {
	var out []workload
	replicas := func(n *int32) int32 {
		if n == nil {
			return 1
		}
		return *n
	}
	for _, d := range o.deployments {
		out = append(out, workload{"Deployment", d.Name, d.Namespace, replicas(d.Spec.Replicas), d.Spec.Selector, &d.Spec.Template, ""})
	}
	for _, s := range o.statefulSets {
		out = append(out, workload{"StatefulSet", s.Name, s.Namespace, replicas(s.Spec.Replicas), s.Spec.Selector, &s.Spec.Template, s.Spec.ServiceName})
	}
	return out
}

// container is one container of a workload's pods.
type container struct {
	w workload
	*corev1.Container
}

func (c container) String() string { return fmt.Sprintf("%s container %s", c.w, c.Name) }

func (o *objects) containers() []container {
	var out []container
	for _, w := range o.workloads() {
		for i := range w.pod.Spec.InitContainers {
			out = append(out, container{w, &w.pod.Spec.InitContainers[i]})
		}
		for i := range w.pod.Spec.Containers {
			out = append(out, container{w, &w.pod.Spec.Containers[i]})
		}
	}
	return out
}

// batonCommands are the subcommands a baton container may run.
var batonCommands = []string{"serve", "worker"}

// baton reports whether c runs the baton image.
func (c container) baton() bool {
	repo, _, _ := strings.Cut(path.Base(c.Image), ":")
	repo, _, _ = strings.Cut(repo, "@")
	return repo == "baton"
}

// command returns the baton subcommand c runs, or "".
func (c container) command() string {
	if !c.baton() || len(c.Args) == 0 {
		return ""
	}
	return c.Args[0]
}

// flag returns the value of --name=value in c's arguments.
func (c container) flag(name string) (string, bool) {
	for _, a := range c.Args {
		if v, ok := strings.CutPrefix(strings.TrimLeft(a, "-"), name+"="); ok && strings.HasPrefix(a, "-") {
			return v, true
		}
	}
	return "", false
}

// hasPort reports whether a container of the pod declares port, by name or
// number.
func hasPort(pod *corev1.PodSpec, port intstr.IntOrString) bool {
	for _, c := range pod.Containers {
		for _, p := range c.Ports {
			if (port.Type == intstr.String && p.Name == port.StrVal) || (port.Type == intstr.Int && p.ContainerPort == port.IntVal) {
				return true
			}
		}
	}
	return false
}

// selects reports whether the Service selector picks w's pods.
func selects(selector map[string]string, w workload) bool {
	return len(selector) > 0 && labels.SelectorFromSet(selector).Matches(labels.Set(w.pod.Labels))
}

func TestNamespace(t *testing.T) {
	for _, o := range built(t) {
		found := false
		for _, obj := range o.all {
			if _, ok := obj.(*corev1.Namespace); ok {
				found = found || obj.GetName() == batonNamespace
			} else if obj.GetNamespace() != batonNamespace {
				t.Errorf("%s: %s %s: namespace %q, want %q", o.dir, obj.GetObjectKind().GroupVersionKind().Kind, obj.GetName(), obj.GetNamespace(), batonNamespace)
			}
		}
		if !found {
			t.Errorf("%s: no Namespace %s", o.dir, batonNamespace)
		}
	}
}

// TestSelectors checks that every selector picks the pods it is meant to
// and that every Service's target ports exist on them.
func TestSelectors(t *testing.T) {
	for _, o := range built(t) {
		ws := o.workloads()
		for _, w := range ws {
			sel, err := metav1.LabelSelectorAsSelector(w.selector)
			if err != nil || sel.Empty() || !sel.Matches(labels.Set(w.pod.Labels)) {
				t.Errorf("%s: %s: selector %v does not select its pod template's labels %v (%v)", o.dir, w, w.selector, w.pod.Labels, err)
			}
		}
		services := map[string]*corev1.Service{}
		for _, s := range o.services {
			services[s.Namespace+"/"+s.Name] = s
			var pods []workload
			for _, w := range ws {
				if w.namespace == s.Namespace && selects(s.Spec.Selector, w) {
					pods = append(pods, w)
				}
			}
			if len(pods) == 0 {
				t.Errorf("%s: Service %s: selector %v selects no pods", o.dir, s.Name, s.Spec.Selector)
			}
			for _, p := range s.Spec.Ports {
				target := p.TargetPort
				if target.Type == intstr.Int && target.IntVal == 0 {
					target = intstr.FromInt32(p.Port)
				}
				for _, w := range pods {
					if !hasPort(&w.pod.Spec, target) {
						t.Errorf("%s: Service %s port %s: target port %s is not a port of %s", o.dir, s.Name, p.Name, target.String(), w)
					}
				}
			}
		}
		for _, w := range ws {
			if w.kind != "StatefulSet" {
				continue
			}
			s := services[w.namespace+"/"+w.serviceName]
			switch {
			case s == nil:
				t.Errorf("%s: %s: serviceName %q: no such Service", o.dir, w, w.serviceName)
			case s.Spec.ClusterIP != corev1.ClusterIPNone:
				t.Errorf("%s: %s: Service %s is not headless, so its pods get no DNS names", o.dir, w, s.Name)
			case !selects(s.Spec.Selector, w):
				t.Errorf("%s: %s: its Service %s does not select its pods", o.dir, w, s.Name)
			}
		}
		for _, b := range o.pdbs {
			sel, err := metav1.LabelSelectorAsSelector(b.Spec.Selector)
			n := 0
			for _, w := range ws {
				if err == nil && !sel.Empty() && w.namespace == b.Namespace && sel.Matches(labels.Set(w.pod.Labels)) {
					n++
				}
			}
			if n == 0 {
				t.Errorf("%s: PodDisruptionBudget %s selects no pods (%v)", o.dir, b.Name, err)
			}
		}
		for _, m := range o.serviceMonitors {
			sel, err := metav1.LabelSelectorAsSelector(&m.Spec.Selector)
			n := 0
			for _, s := range o.services {
				if err != nil || sel.Empty() || s.Namespace != m.Namespace || !sel.Matches(labels.Set(s.Labels)) {
					continue
				}
				n++
				for _, e := range m.Spec.Endpoints {
					if !slices.ContainsFunc(s.Spec.Ports, func(p corev1.ServicePort) bool { return p.Name == e.Port }) {
						t.Errorf("%s: ServiceMonitor %s: Service %s has no port named %q", o.dir, m.Name, s.Name, e.Port)
					}
				}
			}
			if n == 0 {
				t.Errorf("%s: ServiceMonitor %s selects no Service (%v)", o.dir, m.Name, err)
			}
		}
	}
}

// TestPodReferences checks that what the pods name exists: ConfigMaps
// (whose names kustomize suffixes with a hash), service accounts, volumes.
func TestPodReferences(t *testing.T) {
	for _, o := range built(t) {
		for _, w := range o.workloads() {
			spec := &w.pod.Spec
			if sa := spec.ServiceAccountName; sa != "" && !slices.ContainsFunc(o.serviceAccounts, func(a *corev1.ServiceAccount) bool { return a.Name == sa && a.Namespace == w.namespace }) {
				t.Errorf("%s: %s: no ServiceAccount %s", o.dir, w, sa)
			}
			for _, v := range spec.Volumes {
				if v.ConfigMap != nil && o.configMap(w.namespace, v.ConfigMap.Name) == nil {
					t.Errorf("%s: %s: volume %s: no ConfigMap %s", o.dir, w, v.Name, v.ConfigMap.Name)
				}
			}
		}
		for _, c := range o.containers() {
			for _, m := range c.VolumeMounts {
				if !slices.ContainsFunc(c.w.pod.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name }) {
					t.Errorf("%s: %s: mounts volume %s, which the pod lacks", o.dir, c, m.Name)
				}
			}
		}
	}
}

func (o *objects) configMap(namespace, name string) *corev1.ConfigMap {
	for _, c := range o.configMaps {
		if c.Namespace == namespace && c.Name == name {
			return c
		}
	}
	return nil
}

// TestProbes checks that every probe's port is one its container declares
// (a named port must be) and that baton workers' probes ask the gRPC health service for the
// service the worker registers.
func TestProbes(t *testing.T) {
	want := workerpb.Worker_ServiceDesc.ServiceName
	for _, o := range built(t) {
		for _, c := range o.containers() {
			probes := map[string]*corev1.Probe{"readinessProbe": c.ReadinessProbe, "livenessProbe": c.LivenessProbe, "startupProbe": c.StartupProbe}
			for name, p := range probes {
				if p == nil {
					continue
				}
				var port intstr.IntOrString
				switch {
				case p.HTTPGet != nil:
					port = p.HTTPGet.Port
				case p.TCPSocket != nil:
					port = p.TCPSocket.Port
				case p.GRPC != nil:
					port = intstr.FromInt32(p.GRPC.Port)
				default:
					continue
				}
				if !hasPort(&corev1.PodSpec{Containers: []corev1.Container{*c.Container}}, port) {
					t.Errorf("%s: %s: %s port %s is not one of the container's ports", o.dir, c, name, port.String())
				}
			}
			if c.command() != "worker" {
				continue
			}
			for _, name := range []string{"readinessProbe", "livenessProbe"} {
				p := probes[name]
				if p == nil || p.GRPC == nil || p.GRPC.Service == nil || *p.GRPC.Service != want {
					t.Errorf("%s: %s: %s must be a grpc probe of service %q", o.dir, c, name, want)
				}
			}
		}
	}
}

// TestScrapeAnnotations checks that prometheus.io/port names a port of
// the pod.
func TestScrapeAnnotations(t *testing.T) {
	for _, o := range built(t) {
		for _, w := range o.workloads() {
			p, ok := w.pod.Annotations["prometheus.io/port"]
			if !ok {
				continue
			}
			n, err := strconv.ParseInt(p, 10, 32)
			if err != nil || !hasPort(&w.pod.Spec, intstr.FromInt32(int32(n))) {
				t.Errorf("%s: %s: prometheus.io/port %q is not a port of the pod", o.dir, w, p)
			}
		}
	}
}

// TestImagesAndResources checks that the images transformer mapped baton's
// image and that GPUs and the Prometheus Operator's CRDs appear only where
// expected says.
func TestImagesAndResources(t *testing.T) {
	for _, o := range built(t) {
		want := expected[o.dir]
		gpu := false
		for _, c := range o.containers() {
			if c.baton() && (!strings.Contains(c.Image, "/") || !strings.Contains(path.Base(c.Image), ":")) {
				t.Errorf("%s: %s: image %q: want a registry and a tag (the kustomization's images: entry)", o.dir, c, c.Image)
			}
			for _, rl := range []corev1.ResourceList{c.Resources.Requests, c.Resources.Limits} {
				if _, ok := rl["nvidia.com/gpu"]; ok {
					gpu = true
				}
			}
		}
		if gpu != want.gpu {
			t.Errorf("%s: requests nvidia.com/gpu: %v, want %v", o.dir, gpu, want.gpu)
		}
		if sm := len(o.serviceMonitors) > 0; sm != want.serviceMonitor {
			t.Errorf("%s: has a ServiceMonitor: %v, want %v (it needs the Prometheus Operator)", o.dir, sm, want.serviceMonitor)
		}
		if so := len(o.scaledObjects) > 0; so != want.keda {
			t.Errorf("%s: has a ScaledObject: %v, want %v (it needs KEDA)", o.dir, so, want.keda)
		}
	}
}

// tmpDir is removed when the tests end.
var tmpDir string

func TestMain(m *testing.M) {
	var err error
	if tmpDir, err = os.MkdirTemp("", "baton-deploy-test"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(tmpDir)
	os.Exit(code)
}

// batonBinary builds baton once per test binary: package main cannot be
// imported, and its flag parser is the one the manifests must satisfy.
var batonBinary = sync.OnceValues(func() (string, error) {
	bin := filepath.Join(tmpDir, "baton")
	// go run keeps the executable it links in the build cache, where go
	// build -o would link baton again on every run; -exec cp copies it out
	// instead of running it. go test puts its own go first in PATH.
	out, err := exec.Command("go", "run", "-buildvcs=false", "-exec", "cp", "../cmd/baton", bin).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go run ../cmd/baton: %v\n%s", err, out)
	}
	return bin, nil
})

// TestContainerFlags runs baton with each baton container's arguments and
// -h after them: the CLI parses every flag (name and type) and stops at
// the help, so anything it rejects fails here.
func TestContainerFlags(t *testing.T) {
	bin, err := batonBinary()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, o := range built(t) {
		for _, c := range o.containers() {
			if !c.baton() {
				continue
			}
			if len(c.Command) > 0 {
				t.Errorf("%s: %s: sets command %q; the image's entrypoint is baton", o.dir, c, c.Command)
			}
			cmd := c.command()
			if !slices.Contains(batonCommands, cmd) {
				t.Errorf("%s: %s: args %q do not start with a baton subcommand (%s)", o.dir, c, c.Args, strings.Join(batonCommands, ", "))
				continue
			}
			seen[cmd] = true
			for i, a := range c.Args[1:] {
				if !strings.HasPrefix(a, "--") || !strings.Contains(a, "=") {
					t.Errorf("%s: %s: argument %d %q: write flags as --name=value", o.dir, c, i+1, a)
				}
			}
			out, err := exec.Command(bin, append(slices.Clone(c.Args), "-h")...).CombinedOutput()
			if err != nil || !strings.HasPrefix(string(out), "Usage: baton "+cmd) {
				// The error follows the usage text.
				lines := strings.Split(strings.TrimSpace(string(out)), "\n")
				t.Errorf("%s: %s: baton %q: %v: %s", o.dir, c, c.Args, err, lines[len(lines)-1])
			}
		}
	}
	for _, c := range batonCommands {
		if !seen[c] {
			t.Errorf("no container runs baton %s", c)
		}
	}
}

// TestRedisAddress checks that a worker's --redis names a Service of the
// same output, on one of its ports.
func TestRedisAddress(t *testing.T) {
	for _, o := range built(t) {
		for _, c := range o.containers() {
			v, ok := c.flag("redis")
			if c.command() != "worker" || !ok {
				continue
			}
			u, err := url.Parse(v)
			if err != nil {
				t.Errorf("%s: %s: --redis: %v", o.dir, c, err)
				continue
			}
			svc, ns, _ := strings.Cut(strings.TrimSuffix(u.Hostname(), ".svc.cluster.local"), ".")
			port, _ := strconv.Atoi(u.Port())
			if !slices.ContainsFunc(o.services, func(s *corev1.Service) bool {
				return s.Name == svc && s.Namespace == ns && slices.ContainsFunc(s.Spec.Ports, func(p corev1.ServicePort) bool { return int(p.Port) == port })
			}) {
				t.Errorf("%s: %s: --redis=%s: no Service %s in namespace %s with port %d", o.dir, c, v, svc, ns, port)
			}
		}
	}
}

// schedulerConfig returns the config file c (a baton serve container)
// reads, from the ConfigMap mounted at its --config directory.
func (o *objects) schedulerConfig(c container) (string, []byte, error) {
	file, ok := c.flag("config")
	if !ok {
		return "", nil, fmt.Errorf("no --config")
	}
	dir, key := path.Split(file)
	for _, m := range c.VolumeMounts {
		if path.Clean(m.MountPath) != path.Clean(dir) {
			continue
		}
		for _, v := range c.w.pod.Spec.Volumes {
			if v.Name != m.Name || v.ConfigMap == nil {
				continue
			}
			cm := o.configMap(c.w.namespace, v.ConfigMap.Name)
			if cm == nil {
				return "", nil, fmt.Errorf("--config=%s: no ConfigMap %s", file, v.ConfigMap.Name)
			}
			data, ok := cm.Data[key]
			if !ok {
				return "", nil, fmt.Errorf("--config=%s: ConfigMap %s has no key %s", file, cm.Name, key)
			}
			return "ConfigMap " + cm.Name, []byte(data), nil
		}
	}
	return "", nil, fmt.Errorf("--config=%s: no ConfigMap volume mounted at %s", file, dir)
}

// hasService reports whether addr, host:port, names a Service of o by its
// cluster DNS name (<service>.<namespace>.svc.cluster.local) and one of
// its ports.
func (o *objects) hasService(addr string) bool {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	p, _ := strconv.Atoi(port)
	svc, ns, _ := strings.Cut(strings.TrimSuffix(host, ".svc.cluster.local"), ".")
	return slices.ContainsFunc(o.services, func(s *corev1.Service) bool {
		return s.Name == svc && s.Namespace == ns && slices.ContainsFunc(s.Spec.Ports, func(sp corev1.ServicePort) bool { return int(sp.Port) == p })
	})
}

// podAddress matches <statefulset>-<ordinal>.<service>.<namespace>.svc.cluster.local.
var podAddress = regexp.MustCompile(`^([a-z0-9-]+)-([0-9]+)\.([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local$`)

// TestSchedulerConfig loads each scheduler's config from the built
// ConfigMap as baton serve would, and checks it against the output: it
// listens on the port the pod declares, and its workers are the
// StatefulSets' pods, each by its DNS name, on the port and in the role
// the pod runs.
func TestSchedulerConfig(t *testing.T) {
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	for _, o := range built(t) {
		n := 0
		for _, c := range o.containers() {
			if c.command() != "serve" {
				continue
			}
			n++
			where, data, err := o.schedulerConfig(c)
			if err != nil {
				t.Errorf("%s: %s: %v", o.dir, c, err)
				continue
			}
			where = fmt.Sprintf("%s: %s", o.dir, where)
			file := filepath.Join(t.TempDir(), "config.yaml")
			if err := os.WriteFile(file, data, 0o600); err != nil {
				t.Fatal(err)
			}
			cfg, err := scheduler.LoadConfig(file)
			if err == nil {
				err = cfg.Validate(reg)
			}
			if err != nil {
				t.Errorf("%s: %v", where, err)
				continue
			}
			cfg = cfg.WithDefaults()
			host, port, _ := net.SplitHostPort(cfg.Listen)
			p, _ := strconv.Atoi(port)
			if host == "127.0.0.1" || host == "localhost" || !hasPort(&corev1.PodSpec{Containers: []corev1.Container{*c.Container}}, intstr.FromInt32(int32(p))) {
				t.Errorf("%s: listen %q: want a non-loopback address on a port of %s", where, cfg.Listen, c)
			}
			if a := cfg.Replicas.Redis.Addr; a == "" {
				t.Errorf("%s: replicas.redis: not set; the scheduler replicas would learn alone", where)
			} else if !o.hasService(a) {
				t.Errorf("%s: replicas.redis.addr %s: no Service of that name and port in the build", where, a)
			}
			checkPeers(t, o, where, cfg, c)
			if cfg.Discovery.Mode == scheduler.DiscoveryKubernetes {
				checkDiscovery(t, o, where, cfg, c)
			} else {
				checkWorkers(t, o, where, cfg)
			}
		}
		if n == 0 {
			t.Errorf("%s: no container runs baton serve", o.dir)
		}
	}
}

// checkPeers checks that the scheduler's replicas send their decisions
// to each other: replicas.peers listens on a port of c, and its DNS name
// is a headless Service of the build selecting c's pods, ready or not, on
// that port.
func checkPeers(t *testing.T, o *objects, where string, cfg scheduler.Config, c container) {
	t.Helper()
	p := cfg.Replicas.Peers
	if p.Listen == "" {
		t.Errorf("%s: replicas.peers: not set; the replicas would hear of each other's decisions only through Redis", where)
		return
	}
	_, port, _ := net.SplitHostPort(p.Listen)
	lp, _ := strconv.Atoi(port)
	if !hasPort(&corev1.PodSpec{Containers: []corev1.Container{*c.Container}}, intstr.FromInt32(int32(lp))) {
		t.Errorf("%s: replicas.peers.listen %q: not a port of %s", where, p.Listen, c)
	}
	if p.DNS.Name == "" {
		t.Errorf("%s: replicas.peers: want dns, the name of a headless Service of the scheduler's pods", where)
		return
	}
	if p.DNS.Port != lp {
		t.Errorf("%s: replicas.peers.dns.port %d, but the replicas listen on %d", where, p.DNS.Port, lp)
	}
	svc, ns, _ := strings.Cut(strings.TrimSuffix(p.DNS.Name, ".svc.cluster.local"), ".")
	i := slices.IndexFunc(o.services, func(s *corev1.Service) bool { return s.Name == svc && s.Namespace == ns })
	if i < 0 {
		t.Errorf("%s: replicas.peers.dns.name %s: no Service %s in namespace %s", where, p.DNS.Name, svc, ns)
		return
	}
	s := o.services[i]
	switch {
	case s.Spec.ClusterIP != corev1.ClusterIPNone:
		t.Errorf("%s: Service %s is not headless: its name resolves to one address, not each replica's", where, svc)
	case !s.Spec.PublishNotReadyAddresses:
		t.Errorf("%s: Service %s leaves out replicas not yet ready, which then hear no decision until they are", where, svc)
	case !labels.SelectorFromSet(s.Spec.Selector).Matches(labels.Set(c.w.pod.Labels)) || len(s.Spec.Selector) == 0:
		t.Errorf("%s: Service %s does not select the scheduler's pods", where, svc)
	case !slices.ContainsFunc(s.Spec.Ports, func(sp corev1.ServicePort) bool {
		return int(sp.Port) == lp && (sp.TargetPort.IntValue() == lp || hasPort(&corev1.PodSpec{Containers: []corev1.Container{*c.Container}}, sp.TargetPort))
	}):
		t.Errorf("%s: Service %s has no port %d reaching the replicas' peers port", where, svc, lp)
	}
}

// TestPeersPolicy: the replicas' peers port is reachable from the
// scheduler's pods alone, and every other port of theirs stays reachable.
func TestPeersPolicy(t *testing.T) {
	for _, o := range built(t) {
		checkPeersPolicy(t, o)
	}
}

// checkPeersPolicy checks that a NetworkPolicy selects each scheduler's
// pods, leaves every port of theirs reachable, and admits to the
// replicas' peers port the scheduler's pods alone: a pod that could
// reach it could otherwise steer routing.
func checkPeersPolicy(r reporter, o *objects) {
	r.Helper()
	for _, s := range servedConfigs(r, o) {
		c := s.c
		where := fmt.Sprintf("%s: %s", o.dir, c)
		_, port, _ := net.SplitHostPort(s.cfg.Replicas.Peers.Listen)
		lp, _ := strconv.Atoi(port)
		pod := labels.Set(c.w.pod.Labels)
		var rules []networkingv1.NetworkPolicyIngressRule
		selected := false
		for _, np := range o.netPolicies {
			sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
			if err != nil {
				r.Errorf("%s: NetworkPolicy %s: %v", o.dir, np.Name, err)
				continue
			}
			ingress := len(np.Spec.PolicyTypes) == 0 || slices.Contains(np.Spec.PolicyTypes, networkingv1.PolicyTypeIngress)
			if np.Namespace == c.w.namespace && ingress && sel.Matches(pod) {
				selected = true
				rules = append(rules, np.Spec.Ingress...)
			}
		}
		if !selected {
			r.Errorf("%s: no NetworkPolicy selects the scheduler's pods: any pod that reaches the peers port %d could send decisions", where, lp)
			continue
		}
		var peers corev1.ContainerPort
		for _, pc := range c.w.pod.Spec.Containers {
			for _, cp := range pc.Ports {
				if !slices.ContainsFunc(rules, func(ru networkingv1.NetworkPolicyIngressRule) bool { return admits(ru, cp) }) {
					r.Errorf("%s: port %s (%d) is closed by the NetworkPolicies that select its pods", where, cp.Name, cp.ContainerPort)
				}
				if int(cp.ContainerPort) == lp {
					peers = cp
				}
			}
		}
		if peers.ContainerPort == 0 {
			continue // checkPeers reports it
		}
		for _, ru := range rules {
			if !admits(ru, peers) {
				continue
			}
			if len(ru.From) == 0 {
				r.Errorf("%s: a NetworkPolicy admits anyone to the peers port %d", where, lp)
			}
			for _, f := range ru.From {
				if f.IPBlock != nil || f.NamespaceSelector != nil || f.PodSelector == nil {
					r.Errorf("%s: a NetworkPolicy admits more than the scheduler's pods to the peers port %d", where, lp)
					continue
				}
				sel, err := metav1.LabelSelectorAsSelector(f.PodSelector)
				if err != nil {
					r.Errorf("%s: %v", where, err)
					continue
				}
				for _, w := range o.workloads() {
					if w.name != c.w.name && sel.Matches(labels.Set(w.pod.Labels)) {
						r.Errorf("%s: the NetworkPolicy rule for the peers port %d also admits %s's pods", where, lp, w)
					}
				}
			}
		}
	}
}

// admits reports whether rule ru lets traffic reach container port cp
// (from whichever peers it names).
func admits(ru networkingv1.NetworkPolicyIngressRule, cp corev1.ContainerPort) bool {
	if len(ru.Ports) == 0 {
		return true
	}
	proto := cmp.Or(cp.Protocol, corev1.ProtocolTCP)
	for _, p := range ru.Ports {
		if p.Protocol != nil && *p.Protocol != proto {
			continue
		}
		switch {
		case p.Port == nil:
			return true
		case p.Port.Type == intstr.String:
			if p.Port.StrVal == cp.Name {
				return true
			}
		case p.EndPort != nil:
			if cp.ContainerPort >= p.Port.IntVal && cp.ContainerPort <= *p.EndPort {
				return true
			}
		case p.Port.IntVal == cp.ContainerPort:
			return true
		}
	}
	return false
}

// checkWorkers checks cfg's workers against the StatefulSets of o, and
// that every StatefulSet pod is a worker.
func checkWorkers(t *testing.T, o *objects, where string, cfg scheduler.Config) {
	t.Helper()
	listed := map[string]bool{}
	roles := map[string]int{}
	for _, w := range cfg.Workers {
		where := fmt.Sprintf("%s: worker %s", where, w.Name)
		addr := w.Address
		if w.Kind == scheduler.KindHTTP {
			u, err := url.Parse(w.Address)
			if err != nil {
				t.Errorf("%s: %v", where, err)
				continue
			}
			addr = u.Host
		}
		host, port, err := net.SplitHostPort(addr)
		if err != nil {
			t.Errorf("%s: %v", where, err)
			continue
		}
		m := podAddress.FindStringSubmatch(host)
		if m == nil {
			t.Errorf("%s: address %q is not a StatefulSet pod's DNS name", where, w.Address)
			continue
		}
		set, ordinal, svc, ns := m[1], m[2], m[3], m[4]
		i := slices.IndexFunc(o.workloads(), func(s workload) bool { return s.kind == "StatefulSet" && s.name == set && s.namespace == ns })
		if i < 0 {
			t.Errorf("%s: no StatefulSet %s in namespace %s", where, set, ns)
			continue
		}
		sts := o.workloads()[i]
		pod := set + "-" + ordinal
		listed[pod] = true
		roles[w.Role]++
		if sts.serviceName != svc {
			t.Errorf("%s: service %s, but %s has serviceName %q", where, svc, sts, sts.serviceName)
		}
		if k, _ := strconv.Atoi(ordinal); int32(k) >= sts.replicas {
			t.Errorf("%s: %s has %d replicas", where, sts, sts.replicas)
		}
		if w.Name != pod {
			t.Errorf("%s: the name differs from the pod name %s", where, pod)
		}
		p, _ := strconv.Atoi(port)
		if !hasPort(&sts.pod.Spec, intstr.FromInt32(int32(p))) {
			t.Errorf("%s: port %d is not a port of %s", where, p, sts)
		}
		for i := range sts.pod.Spec.Containers {
			c := container{sts, &sts.pod.Spec.Containers[i]}
			if c.command() != "worker" {
				continue
			}
			if w.Kind != scheduler.KindGRPC {
				t.Errorf("%s: kind %s, but %s runs baton worker", where, w.Kind, c)
			}
			if role, _ := c.flag("role"); w.Role != "" && role != w.Role {
				t.Errorf("%s: role %s, but %s runs --role=%s", where, w.Role, c, role)
			}
			if listen, _ := c.flag("listen"); listen != "0.0.0.0:"+port {
				t.Errorf("%s: port %s, but %s runs --listen=%s", where, port, c, listen)
			}
			// The scheduler's name for the worker is the pod name; so must
			// the worker's own be.
			name, _ := c.flag("name")
			v, ok := strings.CutPrefix(name, "$(")
			v, ok2 := strings.CutSuffix(v, ")")
			if !ok || !ok2 || !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool {
				return e.Name == v && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name"
			}) {
				t.Errorf("%s: %s runs --name=%s, not the pod name (an env var from fieldRef metadata.name)", where, c, name)
			}
		}
	}
	for _, sts := range o.workloads() {
		if sts.kind != "StatefulSet" {
			continue
		}
		for i := range sts.replicas {
			if pod := fmt.Sprintf("%s-%d", sts.name, i); !listed[pod] {
				t.Errorf("%s: pod %s of %s is not a worker", where, pod, sts)
			}
		}
	}
	if want := expected[o.dir].disaggregated; want != (roles[scheduler.RolePrefill] > 0 && roles[scheduler.RoleDecode] > 0) {
		t.Errorf("%s: roles %v; want prefill and decode workers: %v", where, roles, want)
	}
}

// TestTerminationGrace checks that each baton pod's
// terminationGracePeriodSeconds exceeds its preStop sleep plus the drain
// its process does on SIGTERM: the scheduler's drain_delay and
// drain_timeout; a worker's --drain-timeout, which it must set, and the
// writing of its hot blocks. Kubernetes kills what outlives the grace.
// The scheduler needs a preStop sleep (endpoints drop it meanwhile), and
// no baton container an exec hook: the image has no shell.
func TestTerminationGrace(t *testing.T) {
	for _, o := range built(t) {
		for _, c := range o.containers() {
			cmd := c.command()
			if cmd == "" {
				continue
			}
			grace := 30 * time.Second // the API server's default
			if g := c.w.pod.Spec.TerminationGracePeriodSeconds; g != nil {
				grace = time.Duration(*g) * time.Second
			}
			var preStop time.Duration
			if l := c.Lifecycle; l != nil && l.PreStop != nil {
				switch {
				case l.PreStop.Exec != nil:
					t.Errorf("%s: %s: preStop exec: the baton image has no shell; use sleep", o.dir, c)
				case l.PreStop.Sleep != nil:
					preStop = time.Duration(l.PreStop.Sleep.Seconds) * time.Second
				}
			}
			var drain time.Duration
			switch cmd {
			case "serve":
				if preStop == 0 {
					t.Errorf("%s: %s: no preStop sleep: SIGTERM would come before endpoints drop the pod", o.dir, c)
				}
				_, data, err := o.schedulerConfig(c)
				if err != nil {
					t.Errorf("%s: %s: %v", o.dir, c, err)
					continue
				}
				file := filepath.Join(t.TempDir(), "config.yaml")
				if err := os.WriteFile(file, data, 0o600); err != nil {
					t.Fatal(err)
				}
				cfg, err := scheduler.LoadConfig(file)
				if err != nil {
					t.Errorf("%s: %s: %v", o.dir, c, err)
					continue
				}
				cfg = cfg.WithDefaults()
				drain = cfg.DrainDelay + cfg.DrainTimeout
				if v, ok := c.flag("drain-timeout"); ok {
					if d, err := time.ParseDuration(v); err == nil {
						drain = cfg.DrainDelay + d
					}
				}
			case "worker":
				v, ok := c.flag("drain-timeout")
				d, err := time.ParseDuration(v)
				if !ok || err != nil {
					t.Errorf("%s: %s: want --drain-timeout=<duration>, got %q", o.dir, c, v)
					continue
				}
				drain = d + sim.DrainWriteTimeout
			}
			if grace <= preStop+drain {
				t.Errorf("%s: %s: terminationGracePeriodSeconds %v must exceed preStop %v + drain %v", o.dir, c, grace, preStop, drain)
			}
		}
	}
}
