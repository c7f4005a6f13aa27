package discovery

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// endpoint is a pod's endpoint; ready nil leaves the condition unset.
func endpoint(pod, ip string, ready *bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses:  []string{ip},
		Conditions: discoveryv1.EndpointConditions{Ready: ready},
		TargetRef:  &corev1.ObjectReference{Kind: "Pod", Name: pod},
	}
}

func ptr[T any](v T) *T { return &v }

// slice is an EndpointSlice of service with a port named grpc (9000) and
// one named metrics (9100).
func slice(name, service string, labels map[string]string, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	l := map[string]string{discoveryv1.LabelServiceName: service}
	for k, v := range labels {
		l[k] = v
	}
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "baton", Labels: l},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   eps,
		Ports: []discoveryv1.EndpointPort{
			{Name: ptr("metrics"), Port: ptr(int32(9100))},
			{Name: ptr("grpc"), Port: ptr(int32(9000))},
		},
	}
}

// TestKubernetesFollowsEndpointSlices: the set holds the ready endpoints
// of the selected slices, with the slice's role and kind, and follows
// slices as they are added, turn not ready and are removed.
func TestKubernetesFollowsEndpointSlices(t *testing.T) {
	ctx := context.Background()
	api := fake.NewClientset(
		slice("decode-abc", "baton-decode", map[string]string{LabelRole: "decode"},
			endpoint("decode-0", "10.0.1.1", nil), endpoint("decode-1", "10.0.1.2", ptr(true))),
		// Another Service's slice: not selected.
		slice("redis-abc", "redis", nil, endpoint("redis-0", "10.0.9.9", nil)),
	)
	esl := api.DiscoveryV1().EndpointSlices("baton")
	k, err := NewKubernetes(KubernetesConfig{
		Namespace: "baton", Selector: "kubernetes.io/service-name in (baton-decode, baton-prefill)", Port: "grpc", Client: api,
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { k.Close() })

	want := []Member{
		{Name: "decode-0", Address: "10.0.1.1:9000", Role: "decode"},
		{Name: "decode-1", Address: "10.0.1.2:9000", Role: "decode"},
	}
	if diff := cmp.Diff(want, next(t, k)); diff != "" {
		t.Fatalf("first set (-want +got):\n%s", diff)
	}

	// A prefill Service's slice is added, its kind in an annotation.
	p := slice("prefill-abc", "baton-prefill", map[string]string{LabelRole: "prefill"}, endpoint("prefill-0", "10.0.2.1", ptr(true)))
	p.Annotations = map[string]string{LabelKind: "grpc"}
	if _, err := esl.Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	want = []Member{
		{Name: "decode-0", Address: "10.0.1.1:9000", Role: "decode"},
		{Name: "decode-1", Address: "10.0.1.2:9000", Role: "decode"},
		{Name: "prefill-0", Address: "10.0.2.1:9000", Role: "prefill", Kind: "grpc"},
	}
	if diff := cmp.Diff(want, next(t, k)); diff != "" {
		t.Fatalf("slice added (-want +got):\n%s", diff)
	}

	// decode-0 terminates: not ready, it leaves.
	d := slice("decode-abc", "baton-decode", map[string]string{LabelRole: "decode"},
		endpoint("decode-0", "10.0.1.1", ptr(false)), endpoint("decode-1", "10.0.1.2", ptr(true)))
	if _, err := esl.Update(ctx, d, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	want = []Member{
		{Name: "decode-1", Address: "10.0.1.2:9000", Role: "decode"},
		{Name: "prefill-0", Address: "10.0.2.1:9000", Role: "prefill", Kind: "grpc"},
	}
	if diff := cmp.Diff(want, next(t, k)); diff != "" {
		t.Fatalf("endpoint not ready (-want +got):\n%s", diff)
	}

	if err := esl.Delete(ctx, "prefill-abc", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	want = []Member{{Name: "decode-1", Address: "10.0.1.2:9000", Role: "decode"}}
	if diff := cmp.Diff(want, next(t, k)); diff != "" {
		t.Fatalf("slice removed (-want +got):\n%s", diff)
	}

	// A Service with publishNotReadyAddresses marks a terminating pod
	// ready: it leaves all the same.
	term := endpoint("decode-1", "10.0.1.2", ptr(true))
	term.Conditions.Terminating = ptr(true)
	d = slice("decode-abc", "baton-decode", map[string]string{LabelRole: "decode"}, endpoint("decode-0", "10.0.1.1", ptr(true)), term)
	if _, err := esl.Update(ctx, d, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	want = []Member{{Name: "decode-0", Address: "10.0.1.1:9000", Role: "decode"}}
	if diff := cmp.Diff(want, next(t, k)); diff != "" {
		t.Fatalf("endpoint terminating (-want +got):\n%s", diff)
	}
}

// TestKubernetesPort: without a port name a slice's only port is used, and
// a slice with several is skipped.
func TestKubernetesPort(t *testing.T) {
	one := slice("one", "a", nil, endpoint("a-0", "10.0.0.1", nil))
	one.Ports = one.Ports[1:]
	two := slice("two", "b", nil, endpoint("b-0", "10.0.0.2", nil))
	api := fake.NewClientset(one, two)
	k, err := NewKubernetes(KubernetesConfig{Namespace: "baton", Selector: "kubernetes.io/service-name", Client: api}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { k.Close() })
	want := []Member{{Name: "a-0", Address: "10.0.0.1:9000"}}
	if diff := cmp.Diff(want, next(t, k)); diff != "" {
		t.Fatalf("set (-want +got):\n%s", diff)
	}
}

func TestKubernetesConfigErrors(t *testing.T) {
	tests := []struct {
		cfg  KubernetesConfig
		want string
	}{
		{KubernetesConfig{}, "selector: required"},
		{KubernetesConfig{Selector: "a in (b"}, "selector: "},
		{KubernetesConfig{Selector: "a=b", Resync: time.Millisecond}, "resync: must be at least 1s"},
	}
	for _, tt := range tests {
		err := tt.cfg.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), tt.want) {
			t.Errorf("%+v: Validate() = %v, want %q…", tt.cfg, err, tt.want)
		}
	}
}

func TestStatic(t *testing.T) {
	s := NewStatic(members("b:1", "a:1"))
	if diff := cmp.Diff(members("a:1", "b:1"), next(t, s)); diff != "" {
		t.Fatalf("set (-want +got):\n%s", diff)
	}
	s.Close()
	if _, ok := <-s.Updates(); ok {
		t.Error("Updates open after Close")
	}
}
