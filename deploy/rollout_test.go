package deploy

import (
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// reporter is what the checks report to: a *testing.T, or a recorder in
// the tests of the checks themselves.
type reporter interface {
	Helper()
	Errorf(format string, args ...any)
}

// pools returns the workloads of o that run more than one pod or that a
// ScaledObject scales: those a node drain or a rollout must not empty.
func (o *objects) pools() []workload {
	var out []workload
	for _, w := range o.workloads() {
		if w.replicas > 1 || o.scaledObjectOf(w) != nil {
			out = append(out, w)
		}
	}
	return out
}

// scaledObjectOf returns the ScaledObject that scales w, or nil.
func (o *objects) scaledObjectOf(w workload) *scaledObject {
	for _, s := range o.scaledObjects {
		r := s.Spec.ScaleTargetRef
		if s.Namespace == w.namespace && r.Name == w.name && cmpOr(r.Kind, "Deployment") == w.kind {
			return s
		}
	}
	return nil
}

func cmpOr(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// selectsPods reports whether sel picks w's pods.
func selectsPods(sel *metav1.LabelSelector, w workload) bool {
	s, err := metav1.LabelSelectorAsSelector(sel)
	return err == nil && !s.Empty() && s.Matches(labels.Set(w.pod.Labels))
}

// TestDisruptionBudgets checks that every PodDisruptionBudget selects the
// pods of exactly one workload of its output and lets a drain through
// (it never forbids every eviction), and that every pool of more than one
// pod, or autoscaled, has one.
func TestDisruptionBudgets(t *testing.T) {
	for _, o := range built(t) {
		checkDisruptionBudgets(t, o)
	}
}

func checkDisruptionBudgets(t reporter, o *objects) {
	t.Helper()
	covered := map[string]bool{}
	for _, b := range o.pdbs {
		var ws []workload
		for _, w := range o.workloads() {
			if w.namespace == b.Namespace && selectsPods(b.Spec.Selector, w) {
				ws = append(ws, w)
				covered[w.String()] = true
			}
		}
		if len(ws) != 1 {
			t.Errorf("%s: PodDisruptionBudget %s selects the pods of %d workloads %v; want one pool each", o.dir, b.Name, len(ws), ws)
			continue
		}
		w := ws[0]
		minReplicas := w.replicas
		if s := o.scaledObjectOf(w); s != nil && s.Spec.MinReplicaCount != nil {
			minReplicas = min(minReplicas, *s.Spec.MinReplicaCount)
		}
		switch {
		case b.Spec.MinAvailable != nil && b.Spec.MaxUnavailable != nil:
			t.Errorf("%s: PodDisruptionBudget %s sets minAvailable and maxUnavailable", o.dir, b.Name)
		case b.Spec.MinAvailable != nil:
			n, err := intstr.GetScaledValueFromIntOrPercent(b.Spec.MinAvailable, int(minReplicas), true)
			if err != nil || n >= int(minReplicas) {
				t.Errorf("%s: PodDisruptionBudget %s: minAvailable %s of %s's %d pods forbids every eviction (%v)", o.dir, b.Name, b.Spec.MinAvailable.String(), w, minReplicas, err)
			}
		case b.Spec.MaxUnavailable != nil:
			n, err := intstr.GetScaledValueFromIntOrPercent(b.Spec.MaxUnavailable, int(minReplicas), true)
			if err != nil || n < 1 {
				t.Errorf("%s: PodDisruptionBudget %s: maxUnavailable %s forbids every eviction (%v)", o.dir, b.Name, b.Spec.MaxUnavailable.String(), err)
			}
		default:
			t.Errorf("%s: PodDisruptionBudget %s sets neither minAvailable nor maxUnavailable", o.dir, b.Name)
		}
	}
	for _, w := range o.pools() {
		if !covered[w.String()] {
			t.Errorf("%s: %s runs %d pods (or is autoscaled) but no PodDisruptionBudget selects them", o.dir, w, w.replicas)
		}
	}
}

// TestRollouts checks how each workload rolls out: the scheduler
// Deployment surges and never goes below its replicas (a new pod counts
// once /readyz passes, that is once it sees a worker); StatefulSets roll
// one ready pod at a time (RollingUpdate, or OnDelete by hand) with
// minReadySeconds for the schedulers to take a replaced worker in; every
// pool spreads over nodes; every pod that serves has a readiness probe.
func TestRollouts(t *testing.T) {
	for _, o := range built(t) {
		checkRollouts(t, o)
	}
}

func checkRollouts(t reporter, o *objects) {
	t.Helper()
	for _, d := range o.deployments {
		s := d.Spec.Strategy
		if d.Spec.Replicas != nil && *d.Spec.Replicas <= 1 {
			continue // a single pod (Redis) may be recreated
		}
		if s.Type == appsv1.RecreateDeploymentStrategyType {
			t.Errorf("%s: Deployment %s: Recreate takes every pod down at once", o.dir, d.Name)
			continue
		}
		if s.RollingUpdate == nil || s.RollingUpdate.MaxUnavailable == nil || s.RollingUpdate.MaxUnavailable.String() != "0" || s.RollingUpdate.MaxSurge == nil {
			t.Errorf("%s: Deployment %s: want rollingUpdate maxUnavailable 0 and a maxSurge, got %+v", o.dir, d.Name, s.RollingUpdate)
		}
	}
	for _, s := range o.statefulSets {
		u := s.Spec.UpdateStrategy
		switch u.Type {
		case appsv1.OnDeleteStatefulSetStrategyType:
		case appsv1.RollingUpdateStatefulSetStrategyType:
			if u.RollingUpdate == nil || u.RollingUpdate.Partition == nil {
				t.Errorf("%s: StatefulSet %s: set rollingUpdate.partition (0), the handle for a staged rollout", o.dir, s.Name)
			} else if u.RollingUpdate.MaxUnavailable != nil {
				t.Errorf("%s: StatefulSet %s: rollingUpdate.maxUnavailable needs an alpha feature gate", o.dir, s.Name)
			}
			if s.Spec.MinReadySeconds < 5 {
				t.Errorf("%s: StatefulSet %s: minReadySeconds %d: want at least 5, for the schedulers to take a replaced pod in before the next goes", o.dir, s.Name, s.Spec.MinReadySeconds)
			}
		default:
			t.Errorf("%s: StatefulSet %s: updateStrategy %q: want RollingUpdate or OnDelete, set explicitly", o.dir, s.Name, u.Type)
		}
	}
	for _, w := range o.pools() {
		if !slices.ContainsFunc(w.pod.Spec.TopologySpreadConstraints, func(c corev1.TopologySpreadConstraint) bool {
			return c.TopologyKey == corev1.LabelHostname && c.LabelSelector != nil && selectsPods(c.LabelSelector, w)
		}) {
			t.Errorf("%s: %s: no topology spread constraint over %s that selects its own pods", o.dir, w, corev1.LabelHostname)
		}
	}
	for _, c := range o.containers() {
		if len(c.Ports) > 0 && c.ReadinessProbe == nil {
			t.Errorf("%s: %s serves ports but has no readiness probe", o.dir, c)
		}
		// /readyz fails while the scheduler sees no worker or drains.
		if p := c.ReadinessProbe; c.command() == "serve" && (p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/readyz") {
			t.Errorf("%s: %s: the readiness probe must GET /readyz", o.dir, c)
		}
	}
}

// exportedMetrics returns the baton_* metric names the scheduler's
// packages define (the string literals of its non-test Go files), which
// is what autoscaling may query.
var exportedMetrics = sync.OnceValues(func() (map[string]bool, error) {
	out := map[string]bool{}
	re := regexp.MustCompile(`"(baton_[a-z0-9_]+)"`)
	err := filepath.WalkDir("../scheduler", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		b, err := os.ReadFile(path)
		for _, m := range re.FindAllSubmatch(b, -1) {
			out[string(m[1])] = true
		}
		return err
	})
	if err == nil && !out["baton_queue_depth"] {
		err = fmt.Errorf("no baton_queue_depth among the scheduler's metrics: is ../scheduler read?")
	}
	return out, err
})

// baseMetric returns the metric a series name belongs to: a histogram's
// _bucket, _sum and _count series belong to the histogram.
func baseMetric(name string, exported map[string]bool) string {
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if b, ok := strings.CutSuffix(name, suffix); ok && exported[b] {
			return b
		}
	}
	return name
}

// TestReadmeMetrics checks that every baton_* name deploy/README.md shows
// (autoscaling queries, adapter rules, dashboard panels) is a metric the
// scheduler exports.
func TestReadmeMetrics(t *testing.T) {
	exported, err := exportedMetrics()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range regexp.MustCompile(`baton_[a-z0-9_]+`).FindAllString(string(b), -1) {
		if !exported[baseMetric(name, exported)] {
			t.Errorf("README.md: %s is not a metric baton exports", name)
		}
	}
}

// workerMatcher matches the worker="..." or worker=~"..." matchers of a
// PromQL query.
var workerMatcher = regexp.MustCompile(`worker\s*(=~?)\s*"([^"]*)"`)

// TestScaledObjects checks each KEDA ScaledObject: it scales a workload of
// its output, within bounds that hold the workload's initial replicas;
// its Prometheus triggers have an address, a query and a threshold, and
// query only metrics baton exports; a query that picks workers by name
// picks the pods of the pool it scales and no other's.
func TestScaledObjects(t *testing.T) {
	exported, err := exportedMetrics()
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range built(t) {
		checkScaledObjects(t, o, exported)
	}
}

func checkScaledObjects(t reporter, o *objects, exported map[string]bool) {
	t.Helper()
	for _, s := range o.scaledObjects {
		where := fmt.Sprintf("%s: ScaledObject %s", o.dir, s.Name)
		r := s.Spec.ScaleTargetRef
		i := slices.IndexFunc(o.workloads(), func(w workload) bool {
			return w.namespace == s.Namespace && w.name == r.Name && w.kind == cmpOr(r.Kind, "Deployment")
		})
		if i < 0 || (r.APIVersion != "" && r.APIVersion != "apps/v1") {
			t.Errorf("%s: scaleTargetRef %+v is no workload of the output", where, r)
			continue
		}
		w := o.workloads()[i]
		lo, hi := int32(1), int32(100) // KEDA's defaults
		if s.Spec.MinReplicaCount != nil {
			lo = *s.Spec.MinReplicaCount
		}
		if s.Spec.MaxReplicaCount != nil {
			hi = *s.Spec.MaxReplicaCount
		}
		if lo < 1 || lo > hi || w.replicas < lo || w.replicas > hi {
			t.Errorf("%s: min %d, max %d, %s starts with %d: want 1 ≤ min ≤ replicas ≤ max (no scaling to zero: the pool would leave the scheduler)", where, lo, hi, w, w.replicas)
		}
		if len(s.Spec.Triggers) == 0 {
			t.Errorf("%s: no triggers", where)
		}
		for _, tr := range s.Spec.Triggers {
			where := fmt.Sprintf("%s: trigger %s", where, cmpOr(tr.Name, tr.Type))
			if tr.Type != "prometheus" {
				t.Errorf("%s: type %q: the tests know prometheus triggers only", where, tr.Type)
				continue
			}
			if mt := tr.MetricType; mt != "" && mt != "Value" && mt != "AverageValue" {
				t.Errorf("%s: metricType %q: want Value or AverageValue", where, mt)
			}
			known := []string{"serverAddress", "query", "threshold", "activationThreshold", "ignoreNullValues", "namespace", "customHeaders", "unsafeSsl"}
			for key := range tr.Metadata {
				if !slices.Contains(known, key) {
					t.Errorf("%s: metadata %s: not a key the tests know (%s)", where, key, strings.Join(known, ", "))
				}
			}
			if !strings.HasPrefix(tr.Metadata["serverAddress"], "http") {
				t.Errorf("%s: serverAddress %q: want a Prometheus URL", where, tr.Metadata["serverAddress"])
			}
			if v, err := strconv.ParseFloat(tr.Metadata["threshold"], 64); err != nil || v <= 0 {
				t.Errorf("%s: threshold %q: want a positive number", where, tr.Metadata["threshold"])
			}
			q := tr.Metadata["query"]
			names := regexp.MustCompile(`baton_[a-z0-9_]+`).FindAllString(q, -1)
			if len(names) == 0 {
				t.Errorf("%s: query %q reads no baton metric", where, q)
			}
			for _, name := range names {
				if !exported[baseMetric(name, exported)] {
					t.Errorf("%s: query reads %s, which baton does not export", where, name)
				}
			}
			for _, m := range workerMatcher.FindAllStringSubmatch(q, -1) {
				match := func(pod string) bool { return pod == m[2] }
				if m[1] == "=~" {
					re, err := regexp.Compile("^(?:" + m[2] + ")$")
					if err != nil {
						t.Errorf("%s: worker=~%q: %v", where, m[2], err)
						continue
					}
					match = re.MatchString
				}
				for _, other := range o.workloads() {
					for _, n := range []int32{0, max(other.replicas, lo, hi) - 1} {
						pod := fmt.Sprintf("%s-%d", other.name, n)
						if mine := other.name == w.name; match(pod) != mine {
							t.Errorf("%s: worker%s%q matches pod %s: %v, want %v (workers are named after their pods)", where, m[1], m[2], pod, !mine, mine)
						}
					}
				}
			}
		}
	}
}

// localPort matches the engine address a preStop hook polls.
var localPort = regexp.MustCompile(`127\.0\.0\.1:([0-9]+)`)

// TestEngineDrain checks that every vLLM container waits in a preStop
// hook for its requests in flight (vLLM cancels them on SIGTERM), polling
// a port it declares, for a bound (the hook's last argument, in seconds)
// that the pod's terminationGracePeriodSeconds exceeds with room for
// vLLM's own shutdown.
func TestEngineDrain(t *testing.T) {
	for _, o := range built(t) {
		checkEngineDrain(t, o)
	}
}

func checkEngineDrain(t reporter, o *objects) {
	t.Helper()
	const shutdown = 10 // seconds left to vLLM after the hook
	for _, c := range o.containers() {
		repo, _, _ := strings.Cut(path.Base(c.Image), ":")
		if repo != "vllm-openai" {
			continue
		}
		var cmd []string
		if l := c.Lifecycle; l != nil && l.PreStop != nil && l.PreStop.Exec != nil {
			cmd = l.PreStop.Exec.Command
		}
		if len(cmd) < 2 {
			t.Errorf("%s: %s: no preStop exec hook waiting for its requests in flight", o.dir, c)
			continue
		}
		bound, err := strconv.Atoi(cmd[len(cmd)-1])
		if err != nil || bound <= 0 {
			t.Errorf("%s: %s: preStop hook's last argument %q: want its bound in seconds", o.dir, c, cmd[len(cmd)-1])
			continue
		}
		grace := int64(30)
		if g := c.w.pod.Spec.TerminationGracePeriodSeconds; g != nil {
			grace = *g
		}
		if grace < int64(bound+shutdown) {
			t.Errorf("%s: %s: terminationGracePeriodSeconds %d must be at least the preStop bound %d + %d s of shutdown", o.dir, c, grace, bound, shutdown)
		}
		m := localPort.FindStringSubmatch(strings.Join(cmd, " "))
		if m == nil {
			t.Errorf("%s: %s: the preStop hook polls no 127.0.0.1 port", o.dir, c)
		} else if n, _ := strconv.Atoi(m[1]); !hasPort(&corev1.PodSpec{Containers: []corev1.Container{*c.Container}}, intstr.FromInt(n)) {
			t.Errorf("%s: %s: the preStop hook polls port %d, which the container does not declare", o.dir, c, n)
		}
	}
}
