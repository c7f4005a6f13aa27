package deploy

import (
	"cmp"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/discovery"
)

// checkDiscovery checks a scheduler that finds its workers in
// EndpointSlices against the output: the selector picks the headless
// Service of every StatefulSet of workers (pods running baton worker, or
// labelled baton.io/role) and no other, by the labels Kubernetes gives
// their slices; each Service has the port the config names, and the role
// and kind its slices say (else the config's) are what its pods run and
// are labelled; engines are started as the config expects (checkEngine);
// the scheduler's ServiceAccount has its token mounted and may get, list
// and watch EndpointSlices, and nothing more.
func checkDiscovery(t reporter, o *objects, where string, cfg scheduler.Config, sched container) {
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
	picked := map[string]bool{} // Services whose slices the selector picks
	for _, svc := range o.services {
		if svc.Namespace != ns || !sel.Matches(sliceLabels(svc)) {
			continue
		}
		picked[svc.Name] = true
		where := fmt.Sprintf("%s: Service %s", where, svc.Name)
		var port *corev1.ServicePort
		for i, p := range svc.Spec.Ports {
			if (k.Port == "" && len(svc.Spec.Ports) == 1) || (k.Port != "" && p.Name == k.Port) {
				port = &svc.Spec.Ports[i]
			}
		}
		if port == nil {
			t.Errorf("%s: no port %q for discovery.kubernetes.port", where, k.Port)
		}
		// Kubernetes copies a Service's labels onto its slices, not its
		// annotations.
		role := cmp.Or(svc.Labels[discovery.LabelRole], cfg.Discovery.Worker.Role)
		kind := cmp.Or(svc.Labels[discovery.LabelKind], cfg.Discovery.Worker.Kind, scheduler.KindGRPC)
		n := 0
		for _, w := range o.workloads() {
			if w.kind != "StatefulSet" || w.serviceName != svc.Name || w.namespace != svc.Namespace {
				continue
			}
			n++
			where := fmt.Sprintf("%s: %s", where, w)
			roles[role] += int(w.replicas)
			for key, want := range map[string]string{discovery.LabelRole: role, discovery.LabelKind: kind} {
				if v, ok := w.pod.Labels[key]; ok && v != want {
					t.Errorf("%s: pods labelled %s=%s, but the scheduler takes them for %s", where, key, v, want)
				}
			}
			var workers []container
			for i := range w.pod.Spec.Containers {
				if c := (container{w, &w.pod.Spec.Containers[i]}); c.command() == "worker" {
					workers = append(workers, c)
				}
			}
			if kind == scheduler.KindGRPC {
				if len(workers) == 0 {
					t.Errorf("%s: kind grpc, but its pods run no baton worker", where)
				}
				for _, c := range workers {
					if flag, _ := c.flag("role"); role != "" && flag != role {
						t.Errorf("%s: role %q, but %s runs --role=%s", where, role, c, flag)
					}
				}
				continue
			}
			if len(workers) > 0 {
				t.Errorf("%s: kind %s, but its pods run baton worker", where, kind)
			}
			if port != nil {
				checkEngine(t, where, cfg.Discovery.Worker, kind, role, w, port.TargetPort)
			}
		}
		if n == 0 {
			t.Errorf("%s: picked by the selector %q, but no StatefulSet's pods are behind it", where, k.Selector)
		}
	}
	for _, w := range o.workloads() {
		_, labelled := w.pod.Labels[discovery.LabelRole]
		runs := slices.ContainsFunc(w.pod.Spec.Containers, func(c corev1.Container) bool { return (container{w, &c}).command() == "worker" })
		if (labelled || runs) && (w.kind != "StatefulSet" || !picked[w.serviceName]) {
			t.Errorf("%s: %s: a worker pool outside the StatefulSets whose headless Services the selector %q picks", where, w, k.Selector)
		}
	}
	if want := expected[o.dir].disaggregated; want != (roles[scheduler.RolePrefill] > 0 && roles[scheduler.RoleDecode] > 0) {
		t.Errorf("%s: roles %v; want prefill and decode workers: %v", where, roles, want)
	}
	checkEndpointSliceRBAC(t, o, where, sched)
}

// checkEngine checks the engine container of w, which discovery finds as a
// worker of kind and role on targetPort, against the scheduler's template
// tmpl: it serves HTTP on that port; a vllm engine publishes KV events
// where tmpl.events and events_replay subscribe, with tmpl's topic and
// block size, reports cached tokens, and in a prefill or decode pool runs
// the NixlConnector as kv_both, with NIXL's side channel on its pod IP.
func checkEngine(t reporter, where string, tmpl scheduler.WorkerConfig, kind, role string, w workload, targetPort intstr.IntOrString) {
	t.Helper()
	var c container
	for i := range w.pod.Spec.Containers {
		cc := container{w, &w.pod.Spec.Containers[i]}
		if hasPort(&corev1.PodSpec{Containers: []corev1.Container{*cc.Container}}, targetPort) {
			c = cc
		}
	}
	if c.Container == nil {
		t.Errorf("%s: no container declares port %s", where, targetPort.String())
		return
	}
	where = fmt.Sprintf("%s: container %s", where, c.Name)
	declared := func(port string) bool {
		n, err := strconv.Atoi(port)
		return err == nil && hasPort(&corev1.PodSpec{Containers: []corev1.Container{*c.Container}}, intstr.FromInt(n))
	}
	if kind != scheduler.KindVLLM {
		return // sglang and plain HTTP engines: only the port above
	}
	http := targetPort.IntVal
	for _, p := range c.Ports {
		if targetPort.Type == intstr.String && p.Name == targetPort.StrVal {
			http = p.ContainerPort
		}
	}
	if v, _ := c.flag("port"); v != strconv.Itoa(int(http)) {
		t.Errorf("%s: --port=%s, but discovery reaches it on %d", where, v, http)
	}
	if !slices.Contains(c.Args, "--enable-prompt-tokens-details") {
		t.Errorf("%s: no --enable-prompt-tokens-details: the engine would not report cached tokens", where)
	}
	if tmpl.BlockSize != 0 {
		if v, _ := c.flag("block-size"); v != strconv.Itoa(tmpl.BlockSize) {
			t.Errorf("%s: --block-size=%s, but discovery.worker.block_size is %d", where, v, tmpl.BlockSize)
		}
	}
	if tmpl.Events != "" {
		var ev struct {
			Enable   bool   `json:"enable_kv_cache_events"`
			Pub      string `json:"publisher"`
			Endpoint string `json:"endpoint"`
			Replay   string `json:"replay_endpoint"`
			Topic    string `json:"topic"`
		}
		v, _ := c.flag("kv-events-config")
		if err := json.Unmarshal([]byte(v), &ev); err != nil {
			t.Errorf("%s: --kv-events-config %q: %v", where, v, err)
		}
		if !ev.Enable || ev.Pub != "zmq" {
			t.Errorf("%s: --kv-events-config publishes no ZMQ events (%+v)", where, ev)
		}
		for _, e := range []struct{ field, sub, pub string }{{"events", tmpl.Events, ev.Endpoint}, {"events_replay", tmpl.EventsReplay, ev.Replay}} {
			_, sub, _ := strings.Cut(e.sub, "{host}:")
			_, pub, _ := strings.Cut(e.pub, "*:")
			if e.sub != "" && (sub == "" || sub != pub || !declared(pub)) {
				t.Errorf("%s: discovery.worker.%s %s, but the engine binds %q (a port it must declare)", where, e.field, e.sub, e.pub)
			}
		}
		if ev.Topic != tmpl.EventsTopic {
			t.Errorf("%s: --kv-events-config topic %q, but discovery.worker.events_topic is %q", where, ev.Topic, tmpl.EventsTopic)
		}
	}
	if role != scheduler.RolePrefill && role != scheduler.RoleDecode {
		return
	}
	var kt struct {
		Connector string `json:"kv_connector"`
		Role      string `json:"kv_role"`
	}
	v, _ := c.flag("kv-transfer-config")
	if err := json.Unmarshal([]byte(v), &kt); err != nil || kt.Connector != "NixlConnector" || kt.Role != "kv_both" {
		t.Errorf("%s: --kv-transfer-config %q: want NixlConnector as kv_both in a %s pool (%v)", where, v, role, err)
	}
	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	if h := env["VLLM_NIXL_SIDE_CHANNEL_HOST"]; h.ValueFrom == nil || h.ValueFrom.FieldRef == nil || h.ValueFrom.FieldRef.FieldPath != "status.podIP" {
		t.Errorf("%s: VLLM_NIXL_SIDE_CHANNEL_HOST must be the pod IP (fieldRef status.podIP): decode engines connect to it", where)
	}
	if p := env["VLLM_NIXL_SIDE_CHANNEL_PORT"].Value; !declared(p) {
		t.Errorf("%s: VLLM_NIXL_SIDE_CHANNEL_PORT %q is not a port of the container", where, p)
	}
}

// checkEndpointSliceRBAC checks that the scheduler's pod mounts its
// ServiceAccount's token, and that the account's Roles allow get, list and
// watch on EndpointSlices and nothing else.
func checkEndpointSliceRBAC(t reporter, o *objects, where string, sched container) {
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
