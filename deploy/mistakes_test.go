package deploy

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/batonllm/baton/scheduler"
)

// recorder collects what a check reports.
type recorder struct{ errs []string }

func (r *recorder) Helper() {}

func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

// checkSchedulerDiscovery runs checkDiscovery for o's scheduler, as
// TestSchedulerConfig does.
func checkSchedulerDiscovery(r reporter, o *objects) {
	r.Helper()
	for _, s := range servedConfigs(r, o) {
		checkDiscovery(r, o, o.dir, s.cfg, s.c)
	}
}

// served is a scheduler container and its configuration.
type served struct {
	c   container
	cfg scheduler.Config
}

// servedConfigs returns o's scheduler containers with their
// configurations, loaded as baton serve loads them, defaults applied.
func servedConfigs(r reporter, o *objects) []served {
	r.Helper()
	var out []served
	for _, c := range o.containers() {
		if c.command() != "serve" {
			continue
		}
		_, data, err := o.schedulerConfig(c)
		if err != nil {
			r.Errorf("%v", err)
			continue
		}
		f, err := os.CreateTemp(tmpDir, "config-*.yaml")
		if err == nil {
			_, err = f.Write(data)
			err = cmpErr(err, f.Close())
		}
		if err != nil {
			r.Errorf("%v", err)
			continue
		}
		cfg, err := scheduler.LoadConfig(f.Name())
		if err != nil {
			r.Errorf("%v", err)
			continue
		}
		out = append(out, served{c, cfg.WithDefaults()})
	}
	return out
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// TestChecksCatchMistakes builds the vllm-disagg overlay, makes one
// mistake in its output, and checks that the check meant to catch it
// reports it, and that the overlay as written passes every one.
func TestChecksCatchMistakes(t *testing.T) {
	const dir = "overlays/vllm-disagg"
	exported, err := exportedMetrics()
	if err != nil {
		t.Fatal(err)
	}
	fresh := func(t *testing.T) *objects {
		t.Helper()
		ms, err := build(filesys.MakeFsOnDisk(), filepath.FromSlash(dir))
		if err != nil {
			t.Fatal(err)
		}
		o, err := decode(dir, ms)
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	sts := func(o *objects, name string) *appsv1.StatefulSet {
		i := slices.IndexFunc(o.statefulSets, func(s *appsv1.StatefulSet) bool { return s.Name == name })
		if i < 0 {
			t.Fatalf("no StatefulSet %s", name)
		}
		return o.statefulSets[i]
	}
	engine := func(o *objects, name string) *corev1.Container { return &sts(o, name).Spec.Template.Spec.Containers[0] }
	replaceArg := func(c *corev1.Container, old, new string) {
		for i, a := range c.Args {
			c.Args[i] = strings.ReplaceAll(a, old, new)
		}
	}
	query := func(o *objects, name, old, new string) {
		for _, s := range o.scaledObjects {
			for i := range s.Spec.Triggers {
				if s.Name == name {
					s.Spec.Triggers[i].Metadata["query"] = strings.ReplaceAll(s.Spec.Triggers[i].Metadata["query"], old, new)
				}
			}
		}
	}
	scaledObjects := func(r reporter, o *objects) { checkScaledObjects(r, o, exported) }
	checks := map[string]func(reporter, *objects){
		"disruption budgets": checkDisruptionBudgets,
		"rollouts":           checkRollouts,
		"scaled objects":     scaledObjects,
		"engine drain":       checkEngineDrain,
		"discovery":          checkSchedulerDiscovery,
		"peers policy":       checkPeersPolicy,
	}
	for name, check := range checks {
		r := &recorder{}
		check(r, fresh(t))
		if len(r.errs) > 0 {
			t.Errorf("%s: %s as written: %q", dir, name, r.errs)
		}
	}
	for _, tc := range []struct {
		name   string
		mutate func(o *objects)
		check  string
		want   string
	}{
		{"a pool without its PodDisruptionBudget", func(o *objects) {
			o.pdbs = slices.DeleteFunc(o.pdbs, func(b *policyv1.PodDisruptionBudget) bool { return b.Name == "vllm-decode" })
		}, "disruption budgets", "StatefulSet vllm-decode runs 2 pods (or is autoscaled) but no PodDisruptionBudget"},
		{"a PodDisruptionBudget that forbids every eviction", func(o *objects) {
			for _, b := range o.pdbs {
				if b.Name == "vllm-prefill" {
					two := intstr.FromInt(2)
					b.Spec.MaxUnavailable, b.Spec.MinAvailable = nil, &two
				}
			}
		}, "disruption budgets", "forbids every eviction"},
		{"a pool not spread over nodes", func(o *objects) {
			sts(o, "vllm-decode").Spec.Template.Spec.TopologySpreadConstraints = nil
		}, "rollouts", "StatefulSet vllm-decode: no topology spread constraint"},
		{"a rollout with no partition", func(o *objects) {
			sts(o, "vllm-prefill").Spec.UpdateStrategy = appsv1.StatefulSetUpdateStrategy{Type: appsv1.RollingUpdateStatefulSetStrategyType}
		}, "rollouts", "set rollingUpdate.partition"},
		{"a scheduler rollout that drops below its replicas", func(o *objects) {
			one := intstr.FromInt(1)
			for _, d := range o.deployments {
				if d.Name == "baton-scheduler" {
					d.Spec.Strategy.RollingUpdate.MaxUnavailable = &one
				}
			}
		}, "rollouts", "want rollingUpdate maxUnavailable 0"},
		{"a query of a metric baton does not export", func(o *objects) {
			query(o, "vllm-decode", "baton_queue_depth", "baton_queue_length")
		}, "scaled objects", "reads baton_queue_length, which baton does not export"},
		{"a worker matcher that picks the other pool too", func(o *objects) {
			query(o, "vllm-decode", `vllm-decode-[0-9]+`, `vllm-.*`)
		}, "scaled objects", "matches pod vllm-prefill-0"},
		{"a pool that may scale to zero", func(o *objects) {
			zero := int32(0)
			o.scaledObjects[0].Spec.MinReplicaCount = &zero
		}, "scaled objects", "no scaling to zero"},
		{"a grace period shorter than the preStop wait", func(o *objects) {
			g := int64(60)
			sts(o, "vllm-decode").Spec.Template.Spec.TerminationGracePeriodSeconds = &g
		}, "engine drain", "terminationGracePeriodSeconds 60 must be at least the preStop bound 75"},
		{"engines labelled with another role than their Service's", func(o *objects) {
			sts(o, "vllm-decode").Spec.Template.Labels["baton.io/role"] = "prefill"
		}, "discovery", "pods labelled baton.io/role=prefill, but the scheduler takes them for decode"},
		{"a decode engine without the NIXL connector in both roles", func(o *objects) {
			replaceArg(engine(o, "vllm-decode"), `"kv_role":"kv_both"`, `"kv_role":"kv_consumer"`)
		}, "discovery", "want NixlConnector as kv_both in a decode pool"},
		{"KV events replayed on another port", func(o *objects) {
			replaceArg(engine(o, "vllm-prefill"), "tcp://*:5558", "tcp://*:5559")
		}, "discovery", "discovery.worker.events_replay tcp://{host}:5558, but the engine binds"},
		{"an engine that does not report cached tokens", func(o *objects) {
			c := engine(o, "vllm-prefill")
			c.Args = slices.DeleteFunc(c.Args, func(a string) bool { return a == "--enable-prompt-tokens-details" })
		}, "discovery", "no --enable-prompt-tokens-details"},
		{"NIXL's side channel on localhost", func(o *objects) {
			c := engine(o, "vllm-prefill")
			for i := range c.Env {
				if c.Env[i].Name == "VLLM_NIXL_SIDE_CHANNEL_HOST" {
					c.Env[i] = corev1.EnvVar{Name: c.Env[i].Name, Value: "localhost"}
				}
			}
		}, "discovery", "VLLM_NIXL_SIDE_CHANNEL_HOST must be the pod IP"},
		{"a pool whose Service the selector misses", func(o *objects) {
			for _, s := range o.services {
				if s.Name == "vllm-decode" {
					s.Name = "vllm-decoders"
				}
			}
			sts(o, "vllm-decode").Spec.ServiceName = "vllm-decoders"
		}, "discovery", "StatefulSet vllm-decode: a worker pool outside the StatefulSets"},
		{"no policy for the scheduler", func(o *objects) { o.netPolicies = nil }, "peers policy", "no NetworkPolicy selects the scheduler's pods"},
		{"the peers port open to anyone", func(o *objects) {
			o.netPolicies[0].Spec.Ingress[1].From = nil
		}, "peers policy", "admits anyone to the peers port 9401"},
		{"the peers port open to the workers too", func(o *objects) {
			delete(o.netPolicies[0].Spec.Ingress[1].From[0].PodSelector.MatchLabels, "app.kubernetes.io/component")
		}, "peers policy", "also admits Deployment baton-redis's pods"},
		{"the peers port open to another namespace", func(o *objects) {
			o.netPolicies[0].Spec.Ingress[1].From[0].NamespaceSelector = &metav1.LabelSelector{}
		}, "peers policy", "admits more than the scheduler's pods"},
		{"the http port closed", func(o *objects) {
			o.netPolicies[0].Spec.Ingress = o.netPolicies[0].Spec.Ingress[1:]
		}, "peers policy", "port http (8080) is closed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := fresh(t)
			tc.mutate(o)
			r := &recorder{}
			checks[tc.check](r, o)
			if !slices.ContainsFunc(r.errs, func(e string) bool { return strings.Contains(e, tc.want) }) {
				t.Errorf("%s check: got %q, want an error containing %q", tc.check, r.errs, tc.want)
			}
		})
	}
}
