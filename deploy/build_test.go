package deploy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"go.yaml.in/yaml/v3"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// expected says what each kustomization's output may hold. A new
// kustomization needs an entry, so that someone decides each.
var expected = map[string]struct {
	gpu            bool // requests nvidia.com/gpu
	serviceMonitor bool // needs the Prometheus Operator's CRDs
	keda           bool // needs KEDA's CRDs (ScaledObjects)
	disaggregated  bool // the scheduler has prefill and decode workers
}{
	"base":                   {disaggregated: true},
	"overlays/sim":           {disaggregated: true},
	"overlays/sim-monitored": {disaggregated: true, serviceMonitor: true},
	"overlays/vllm":          {gpu: true},
	"overlays/vllm-disagg":   {gpu: true, serviceMonitor: true, keda: true, disaggregated: true},
}

// kustomizationFile is the part of a kustomization.yaml the tests read.
type kustomizationFile struct {
	Kind    string `yaml:"kind"`
	Patches []struct {
		Path  string `yaml:"path"`
		Patch string `yaml:"patch"`
	} `yaml:"patches"`
	PatchesStrategicMerge []string `yaml:"patchesStrategicMerge"`
}

// kustomizations returns the kustomization files under deploy/, Components
// included, by the slash path of their directory.
func kustomizations(t *testing.T) map[string]kustomizationFile {
	t.Helper()
	out := map[string]kustomizationFile{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "kustomization.yaml" {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		var k kustomizationFile
		if err := yaml.Unmarshal(b, &k); err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		out[filepath.ToSlash(filepath.Dir(path))] = k
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// manifest is one object of kustomize's output.
type manifest struct {
	id   string // kind, name and namespace, as kustomize prints them
	json []byte
}

// build runs kustomize on dir as `kubectl kustomize` does, and returns the
// output in its order. A panic in kustomize comes back as
// an error: kustomize v5.5 (kubectl 1.32) crashed on the vllm overlay when
// one patch file held several `$patch: delete` documents.
func build(fsys filesys.FileSystem, dir string) (out []manifest, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("kustomize build %s panicked: %v", dir, r)
		}
	}()
	opts := krusty.MakeDefaultOptions()
	opts.Reorder = krusty.ReorderOptionUnspecified // kubectl's order: sortOptions, else legacy
	m, err := krusty.MakeKustomizer(opts).Run(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	for _, r := range m.Resources() {
		b, err := r.MarshalJSON()
		if err != nil {
			return nil, fmt.Errorf("kustomize build %s: %s: %w", dir, r.CurId(), err)
		}
		out = append(out, manifest{r.CurId().String(), b})
	}
	return out, nil
}

// serviceMonitor is the part of the Prometheus Operator's ServiceMonitor
// that deploy/ uses; any other field is an error, as for the built-in
// kinds.
type serviceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector  metav1.LabelSelector `json:"selector"`
		Endpoints []struct {
			Port          string `json:"port"`
			Path          string `json:"path"`
			Interval      string `json:"interval"`
			ScrapeTimeout string `json:"scrapeTimeout"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// DeepCopyObject makes serviceMonitor a runtime.Object.
func (m *serviceMonitor) DeepCopyObject() runtime.Object {
	c := *m
	m.ObjectMeta.DeepCopyInto(&c.ObjectMeta)
	m.Spec.Selector.DeepCopyInto(&c.Spec.Selector)
	c.Spec.Endpoints = slices.Clone(m.Spec.Endpoints)
	return &c
}

// scaledObject is the part of KEDA's ScaledObject (keda.sh/v1alpha1) that
// deploy/ uses; any other field is an error. A trigger's metadata is
// free-form in KEDA's schema too: the tests check its keys per trigger
// type.
type scaledObject struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		ScaleTargetRef struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Name       string `json:"name"`
		} `json:"scaleTargetRef"`
		MinReplicaCount *int32 `json:"minReplicaCount,omitempty"`
		MaxReplicaCount *int32 `json:"maxReplicaCount,omitempty"`
		PollingInterval *int32 `json:"pollingInterval,omitempty"`
		CooldownPeriod  *int32 `json:"cooldownPeriod,omitempty"`
		Advanced        *struct {
			HorizontalPodAutoscalerConfig *struct {
				Behavior *autoscalingv2.HorizontalPodAutoscalerBehavior `json:"behavior,omitempty"`
			} `json:"horizontalPodAutoscalerConfig,omitempty"`
		} `json:"advanced,omitempty"`
		Triggers []struct {
			Type       string            `json:"type"`
			Name       string            `json:"name,omitempty"`
			MetricType string            `json:"metricType,omitempty"`
			Metadata   map[string]string `json:"metadata"`
		} `json:"triggers"`
	} `json:"spec"`
}

// DeepCopyObject makes scaledObject a runtime.Object.
func (o *scaledObject) DeepCopyObject() runtime.Object {
	b, err := json.Marshal(o)
	if err != nil {
		panic(err)
	}
	c := &scaledObject{}
	if err := json.Unmarshal(b, c); err != nil {
		panic(err)
	}
	return c
}

// decoder decodes a manifest into the Go type its apiVersion and kind name,
// strictly: unknown, duplicate and miscased fields are errors, as they are
// to the API server's strict field validation. Kinds the scheme lacks are
// errors too, so a new kind needs a decision here.
var decoder = sync.OnceValue(func() runtime.Decoder {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, policyv1.AddToScheme, rbacv1.AddToScheme, networkingv1.AddToScheme} {
		if err := add(s); err != nil {
			panic(err)
		}
	}
	s.AddKnownTypeWithName(schema.GroupVersionKind{Group: "monitoring.coreos.com", Version: "v1", Kind: "ServiceMonitor"}, &serviceMonitor{})
	s.AddKnownTypeWithName(schema.GroupVersionKind{Group: "keda.sh", Version: "v1alpha1", Kind: "ScaledObject"}, &scaledObject{})
	return serializer.NewCodecFactory(s, serializer.EnableStrict).UniversalDeserializer()
})

// objects is one kustomization's output, decoded.
type objects struct {
	dir             string
	all             []object
	namespaces      []*corev1.Namespace
	services        []*corev1.Service
	configMaps      []*corev1.ConfigMap
	serviceAccounts []*corev1.ServiceAccount
	deployments     []*appsv1.Deployment
	statefulSets    []*appsv1.StatefulSet
	pdbs            []*policyv1.PodDisruptionBudget
	netPolicies     []*networkingv1.NetworkPolicy
	roles           []*rbacv1.Role
	roleBindings    []*rbacv1.RoleBinding
	serviceMonitors []*serviceMonitor
	scaledObjects   []*scaledObject
}

type object interface {
	runtime.Object
	metav1.Object
}

func decode(dir string, ms []manifest) (*objects, error) {
	o := &objects{dir: dir}
	var errs []error
	for _, m := range ms {
		obj, _, err := decoder().Decode(m.json, nil, nil)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", m.id, err))
			continue
		}
		switch obj := obj.(type) {
		case *corev1.Namespace:
			o.namespaces = append(o.namespaces, obj)
		case *corev1.Service:
			o.services = append(o.services, obj)
		case *corev1.ConfigMap:
			o.configMaps = append(o.configMaps, obj)
		case *corev1.ServiceAccount:
			o.serviceAccounts = append(o.serviceAccounts, obj)
		case *appsv1.Deployment:
			o.deployments = append(o.deployments, obj)
		case *appsv1.StatefulSet:
			o.statefulSets = append(o.statefulSets, obj)
		case *policyv1.PodDisruptionBudget:
			o.pdbs = append(o.pdbs, obj)
		case *networkingv1.NetworkPolicy:
			o.netPolicies = append(o.netPolicies, obj)
		case *rbacv1.Role:
			o.roles = append(o.roles, obj)
		case *rbacv1.RoleBinding:
			o.roleBindings = append(o.roleBindings, obj)
		case *serviceMonitor:
			o.serviceMonitors = append(o.serviceMonitors, obj)
		case *scaledObject:
			o.scaledObjects = append(o.scaledObjects, obj)
		default:
			errs = append(errs, fmt.Errorf("%s: a kind the tests do not check", m.id))
			continue
		}
		o.all = append(o.all, obj.(object))
	}
	return o, errors.Join(errs...)
}

// builds holds every kustomization's output, built once per test binary.
var builds struct {
	once sync.Once
	dirs []string
	objs map[string]*objects
	errs map[string]error
}

// built returns the decoded output of every kustomization that built and
// decoded without error; TestBuild reports the others.
func built(t *testing.T) []*objects {
	t.Helper()
	builds.once.Do(func() {
		builds.objs = map[string]*objects{}
		builds.errs = map[string]error{}
		for dir, k := range kustomizations(t) {
			if k.Kind == "Component" {
				continue // built only inside a kustomization that lists it
			}
			builds.dirs = append(builds.dirs, dir)
			ms, err := build(filesys.MakeFsOnDisk(), dir)
			if err != nil {
				builds.errs[dir] = err
				continue
			}
			o, err := decode(dir, ms)
			builds.objs[dir] = o
			builds.errs[dir] = err
		}
		slices.Sort(builds.dirs)
	})
	var out []*objects
	for _, dir := range builds.dirs {
		if builds.errs[dir] == nil {
			out = append(out, builds.objs[dir])
		}
	}
	if len(out) == 0 {
		t.Fatal("no kustomization built")
	}
	return out
}

// TestBuild builds the base and every overlay with kustomize, and decodes
// every object strictly.
func TestBuild(t *testing.T) {
	built(t)
	for dir := range expected {
		if !slices.Contains(builds.dirs, dir) {
			t.Errorf("%s: no kustomization.yaml", dir)
		}
	}
	for _, dir := range builds.dirs {
		if _, ok := expected[dir]; !ok {
			t.Errorf("%s: a kustomization missing from expected (does it request GPUs, a ServiceMonitor?)", dir)
		}
		if err := builds.errs[dir]; err != nil {
			t.Errorf("%s: %v", dir, err)
		} else if len(builds.objs[dir].all) == 0 {
			t.Errorf("%s: builds no objects", dir)
		}
	}
}

// panicFS stands in for a kustomize bug: reading any file panics.
type panicFS struct{ filesys.FileSystem }

func (panicFS) ReadFile(string) ([]byte, error) { panic("a kustomize bug") }

// TestBuildRecoversPanic checks that a panic inside kustomize comes back as
// an error naming the kustomization, so that TestBuild reports it instead
// of crashing the test binary.
func TestBuildRecoversPanic(t *testing.T) {
	fsys := filesys.MakeFsInMemory()
	if err := fsys.WriteFile("overlays/app/kustomization.yaml", []byte("resources: []\n")); err != nil {
		t.Fatal(err)
	}
	_, err := build(panicFS{fsys}, "overlays/app")
	if err == nil || !strings.Contains(err.Error(), "overlays/app") || !strings.Contains(err.Error(), "panicked") {
		t.Errorf("build: %v, want an error naming overlays/app and the panic", err)
	}
}

// TestDeletePatchesStandAlone checks that a `$patch: delete` patch is
// alone in its file or inline patch, in kustomizations and Components:
// kustomize v5.5, the one kubectl 1.32
// embeds, panics on the document after a delete. The kustomize these tests
// build with (api v0.21.2) builds such a file, so TestBuild cannot catch it.
func TestDeletePatchesStandAlone(t *testing.T) {
	for dir, k := range kustomizations(t) {
		patches := map[string][]byte{}
		paths := slices.Clone(k.PatchesStrategicMerge)
		for i, p := range k.Patches {
			if p.Patch != "" {
				patches[fmt.Sprintf("patches[%d]", i)] = []byte(p.Patch)
			}
			if p.Path != "" {
				paths = append(paths, p.Path)
			}
		}
		for _, path := range paths {
			b, err := os.ReadFile(filepath.Join(dir, path))
			if err != nil {
				t.Errorf("%s: %v", dir, err)
				continue
			}
			patches[path] = b
		}
		for name, b := range patches {
			var docs, deletes int
			dec := yaml.NewDecoder(bytes.NewReader(b))
			for {
				var doc any
				err := dec.Decode(&doc)
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Errorf("%s: %s: %v", dir, name, err)
					break
				}
				docs++
				if m, _ := doc.(map[string]any); m["$patch"] == "delete" {
					deletes++
				}
			}
			if deletes > 0 && docs > 1 {
				t.Errorf("%s: %s: %d documents, %d of them $patch: delete; kubectl 1.32 panics on it (give each delete its own patch)", dir, name, docs, deletes)
			}
		}
	}
}
