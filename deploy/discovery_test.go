package deploy

import (
	"fmt"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/discovery"
)

// checkDiscovery checks a scheduler that finds its workers in
// EndpointSlices against the output: the selector picks the headless
// Service of every StatefulSet of baton workers and no other, by the
// labels Kubernetes gives their slices; each Service has the port the
// config names and the role label its pods run; the scheduler's
// ServiceAccount has its token mounted and may get, list and watch
// EndpointSlices, and nothing more.
func checkDiscovery(t *testing.T, o *objects, where string, cfg scheduler.Config, sched container) {
	t.Helper()
	k := cfg.Discovery.Kubernetes
	sel, err := labels.Parse(k.Selector)
	if err != nil {
		t.Errorf("%s: discovery.kubernetes.selector: %v", where, err)
		return
	}
	ns := sched.w.namespace
	if k.Namespace != "" && k.Namespace != ns {
		t.Errorf("%s: discovery.kubernetes.namespace %s, but the scheduler runs in %s", where, k.Namespace, ns)
	}
	// The labels the EndpointSlice controller puts on a Service's slices.
	sliceLabels := func(svc *corev1.Service) labels.Set {
		l := labels.Set{discoveryv1.LabelServiceName: svc.Name}
		for key, v := range svc.Labels {
			l[key] = v
		}
		return l
	}
	roles := map[string]int{}
	workerServices := map[string]bool{}
	for _, w := range o.workloads() {
		var workers []container
		for i := range w.pod.Spec.Containers {
			if c := (container{w, &w.pod.Spec.Containers[i]}); c.command() == "worker" {
				workers = append(workers, c)
			}
		}
		if len(workers) == 0 {
			continue
		}
		where := fmt.Sprintf("%s: %s", where, w)
		i := slices.IndexFunc(o.services, func(s *corev1.Service) bool { return s.Name == w.serviceName && s.Namespace == w.namespace })
		if w.kind != "StatefulSet" || i < 0 {
			t.Errorf("%s: baton workers outside a StatefulSet with a headless Service", where)
			continue
		}
		svc := o.services[i]
		workerServices[svc.Name] = true
		if w.namespace != ns {
			t.Errorf("%s: in namespace %s, the scheduler's is %s", where, w.namespace, ns)
		}
		if !sel.Matches(sliceLabels(svc)) {
			t.Errorf("%s: the selector %q does not pick Service %s's EndpointSlices (labels %v)", where, k.Selector, svc.Name, sliceLabels(svc))
		}
		if !slices.ContainsFunc(svc.Spec.Ports, func(p corev1.ServicePort) bool {
			return (k.Port == "" && len(svc.Spec.Ports) == 1) || (k.Port != "" && p.Name == k.Port)
		}) {
			t.Errorf("%s: Service %s has no port %q for discovery.kubernetes.port", where, svc.Name, k.Port)
		}
		role := svc.Labels[discovery.LabelRole]
		if role == "" {
			role = cfg.Discovery.Worker.Role
		}
		kind := svc.Labels[discovery.LabelKind]
		if kind == "" {
			kind = cfg.Discovery.Worker.Kind
		}
		if kind != "" && kind != scheduler.KindGRPC {
			t.Errorf("%s: kind %s, but its pods run baton worker", where, kind)
		}
		for _, c := range workers {
			if flag, _ := c.flag("role"); role != "" && flag != role {
				t.Errorf("%s: Service %s says role %q, but %s runs --role=%s", where, svc.Name, role, c, flag)
			}
		}
		roles[role] += int(w.replicas)
	}
	for _, svc := range o.services {
		if svc.Namespace == ns && !workerServices[svc.Name] && sel.Matches(sliceLabels(svc)) {
			t.Errorf("%s: the selector %q picks Service %s, whose pods are no baton workers", where, k.Selector, svc.Name)
		}
	}
	if want := expected[o.dir].disaggregated; want != (roles[scheduler.RolePrefill] > 0 && roles[scheduler.RoleDecode] > 0) {
		t.Errorf("%s: roles %v; want prefill and decode workers: %v", where, roles, want)
	}
	checkEndpointSliceRBAC(t, o, where, sched)
}

// checkEndpointSliceRBAC checks that the scheduler's pod mounts its
// ServiceAccount's token, and that the account's Roles allow get, list and
// watch on EndpointSlices and nothing else.
func checkEndpointSliceRBAC(t *testing.T, o *objects, where string, sched container) {
	t.Helper()
	spec := sched.w.pod.Spec
	sa := spec.ServiceAccountName
	if sa == "" {
		t.Errorf("%s: %s runs under the default ServiceAccount; give it its own", where, sched.w)
		return
	}
	i := slices.IndexFunc(o.serviceAccounts, func(a *corev1.ServiceAccount) bool { return a.Name == sa && a.Namespace == sched.w.namespace })
	if i < 0 {
		t.Errorf("%s: no ServiceAccount %s", where, sa)
		return
	}
	mounted := o.serviceAccounts[i].AutomountServiceAccountToken == nil || *o.serviceAccounts[i].AutomountServiceAccountToken
	if spec.AutomountServiceAccountToken != nil {
		mounted = *spec.AutomountServiceAccountToken
	}
	if !mounted {
		t.Errorf("%s: %s does not mount ServiceAccount %s's token, which discovery needs", where, sched.w, sa)
	}
	verbs := map[string]bool{}
	for _, b := range o.roleBindings {
		if b.Namespace != sched.w.namespace || !slices.ContainsFunc(b.Subjects, func(s rbacv1.Subject) bool {
			return s.Kind == rbacv1.ServiceAccountKind && s.Name == sa && (s.Namespace == "" || s.Namespace == sched.w.namespace)
		}) {
			continue
		}
		i := slices.IndexFunc(o.roles, func(r *rbacv1.Role) bool { return r.Name == b.RoleRef.Name && r.Namespace == b.Namespace })
		if b.RoleRef.Kind != "Role" || i < 0 {
			t.Errorf("%s: RoleBinding %s refers to %s %s, not a Role of the output", where, b.Name, b.RoleRef.Kind, b.RoleRef.Name)
			continue
		}
		for _, r := range o.roles[i].Rules {
			if !slices.Equal(r.APIGroups, []string{discoveryv1.GroupName}) || !slices.Equal(r.Resources, []string{"endpointslices"}) || len(r.ResourceNames) > 0 || len(r.NonResourceURLs) > 0 {
				t.Errorf("%s: Role %s grants %+v; want EndpointSlices alone", where, o.roles[i].Name, r)
				continue
			}
			for _, v := range r.Verbs {
				if v != "get" && v != "list" && v != "watch" {
					t.Errorf("%s: Role %s grants %s on EndpointSlices; want get, list and watch alone", where, o.roles[i].Name, v)
				}
				verbs[v] = true
			}
		}
	}
	for _, v := range []string{"get", "list", "watch"} {
		if !verbs[v] {
			t.Errorf("%s: ServiceAccount %s may not %s EndpointSlices", where, sa, v)
		}
	}
}
