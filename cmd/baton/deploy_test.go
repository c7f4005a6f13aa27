package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
)

// The Kubernetes deployment under deploy/ has no cluster to be tried on
// here; these tests check what can be checked without one: the YAML
// parses, the scheduler configs load and validate, the baton containers
// use only flags the CLI defines, the worker addresses match the
// StatefulSets, and the dashboard queries only metrics baton exports.

const deployDir = "../../deploy"

// manifest is one YAML document of a file under deploy/.
type manifest struct {
	path string // relative to deploy/
	doc  any
}

// readManifests parses every YAML file under deploy/, all documents.
func readManifests(t *testing.T) []manifest {
	t.Helper()
	var out []manifest
	err := filepath.WalkDir(deployDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || (filepath.Ext(path) != ".yaml" && filepath.Ext(path) != ".yml") {
			return nil
		}
		rel, _ := filepath.Rel(deployDir, path)
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		dec := yaml.NewDecoder(bytes.NewReader(b))
		for i := 0; ; i++ {
			var doc any
			err := dec.Decode(&doc)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Errorf("%s: document %d: %v", rel, i, err)
				break
			}
			if doc != nil {
				out = append(out, manifest{rel, doc})
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(out) == 0 {
		t.Fatal("no YAML under deploy/")
	}
	return out
}

// Accessors over decoded YAML; a missing or mistyped step gives the zero
// value.
func get(v any, keys ...string) any {
	for _, k := range keys {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

func str(v any, keys ...string) string { s, _ := get(v, keys...).(string); return s }
func list(v any, keys ...string) []any { l, _ := get(v, keys...).([]any); return l }

func strs(v any) []string {
	var out []string
	for _, x := range list(v) {
		switch x := x.(type) {
		case string:
			out = append(out, x)
		default:
			out = append(out, fmt.Sprint(x))
		}
	}
	return out
}

// podSpec returns the pod spec of a workload (Deployment, StatefulSet,
// DaemonSet, Job) or of a strategic-merge patch of one.
func podSpec(doc any) any {
	switch str(doc, "kind") {
	case "Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet":
		return get(doc, "spec", "template", "spec")
	case "Pod":
		return get(doc, "spec")
	}
	return nil
}

// batonCommands are the subcommands a baton container may run.
var batonCommands = []string{"serve", "worker"}

// batonContainer reports whether c runs the baton binary: its image is
// baton's, or (in a patch, which may omit the image) its first argument is
// a baton subcommand.
func batonContainer(c any) bool {
	if img := str(c, "image"); img != "" {
		repo := img
		if i := strings.LastIndex(repo, "/"); i >= 0 {
			repo = repo[i+1:]
		}
		repo, _, _ = strings.Cut(repo, ":")
		return repo == "baton"
	}
	args := strs(get(c, "args"))
	return len(args) > 0 && slices.Contains(batonCommands, args[0])
}

func TestDeployManifestsParse(t *testing.T) {
	ms := readManifests(t)
	for _, m := range ms {
		if _, ok := m.doc.(map[string]any); !ok {
			t.Errorf("%s: a document is %T, not a mapping", m.path, m.doc)
			continue
		}
		if str(m.doc, "kind") == "" && filepath.Base(m.path) != "scheduler-config.yaml" {
			t.Errorf("%s: a document has no kind", m.path)
		}
		// The base runs simulated workers on CPU: GPUs only in overlays.
		if strings.HasPrefix(m.path, "base"+string(filepath.Separator)) {
			if b, _ := yaml.Marshal(m.doc); bytes.Contains(b, []byte("nvidia.com/gpu")) {
				t.Errorf("%s: the base requests nvidia.com/gpu", m.path)
			}
		}
		if str(m.doc, "kind") == "ServiceMonitor" && !strings.HasPrefix(m.path, "components") {
			t.Errorf("%s: ServiceMonitor outside components/ (it needs the Prometheus Operator, so only opt-in overlays may include it)", m.path)
		}
	}
}

// schedulerConfigs returns every scheduler config file under deploy/, by
// path relative to deploy/: the files configMapGenerators turn into
// config.yaml, and config.yaml keys of literal ConfigMaps.
func schedulerConfigs(t *testing.T, ms []manifest) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	for _, m := range ms {
		dir := filepath.Dir(m.path)
		for _, g := range list(m.doc, "configMapGenerator") {
			if str(g, "name") != "baton-scheduler-config" {
				continue
			}
			for _, f := range strs(get(g, "files")) {
				key, path, ok := strings.Cut(f, "=")
				if !ok {
					key, path = filepath.Base(f), f
				}
				if key != "config.yaml" {
					continue
				}
				rel := filepath.Join(dir, path)
				b, err := os.ReadFile(filepath.Join(deployDir, rel))
				if err != nil {
					t.Fatal(err)
				}
				out[rel] = b
			}
		}
		if str(m.doc, "kind") == "ConfigMap" {
			if c := str(m.doc, "data", "config.yaml"); c != "" {
				out[m.path+"#"+str(m.doc, "metadata", "name")] = []byte(c)
			}
		}
	}
	return out
}

func TestDeploySchedulerConfigs(t *testing.T) {
	ms := readManifests(t)
	cfgs := schedulerConfigs(t, ms)
	for _, want := range []string{"base/scheduler-config.yaml", "overlays/vllm/scheduler-config.yaml"} {
		if _, ok := cfgs[filepath.FromSlash(want)]; !ok {
			t.Errorf("no scheduler config from %s (found %d)", want, len(cfgs))
		}
	}
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	dir := t.TempDir()
	for name, b := range cfgs {
		path := filepath.Join(dir, "config.yaml")
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := scheduler.LoadConfig(path)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if err := cfg.Validate(reg); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		// In a pod the scheduler must listen beyond loopback, on the port
		// the Service targets.
		if host, port, _ := net.SplitHostPort(cfg.WithDefaults().Listen); host == "127.0.0.1" || host == "localhost" || port != "8080" {
			t.Errorf("%s: listen %q: want a non-loopback address on port 8080", name, cfg.Listen)
		}
	}
	// The base config's grpc workers name the base's StatefulSet pods.
	base, ok := cfgs[filepath.FromSlash("base/scheduler-config.yaml")]
	if !ok {
		return
	}
	path := filepath.Join(dir, "base.yaml")
	if err := os.WriteFile(path, base, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := scheduler.LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Strategy != "prefix_aware" {
		t.Errorf("base strategy %q, want prefix_aware", cfg.Strategy)
	}
	if cfg.Discovery.Mode != "" {
		return // deploy's tests check discovery against the built output
	}
	checkWorkersMatchStatefulSets(t, cfg, ms)
}

// checkWorkersMatchStatefulSets checks each grpc worker address,
// <sts>-<i>.<service>.<namespace>.svc.cluster.local:<port>, against the
// base: the StatefulSet exists with more than i replicas, its serviceName
// is <service>, its baton container listens on <port> with --role the
// config's role.
func checkWorkersMatchStatefulSets(t *testing.T, cfg scheduler.Config, ms []manifest) {
	t.Helper()
	sts := map[string]any{}
	headless := map[string]bool{}
	for _, m := range ms {
		if !strings.HasPrefix(m.path, "base"+string(filepath.Separator)) {
			continue
		}
		switch str(m.doc, "kind") {
		case "StatefulSet":
			sts[str(m.doc, "metadata", "name")] = m.doc
		case "Service":
			if str(m.doc, "spec", "clusterIP") == "None" {
				headless[str(m.doc, "metadata", "name")] = true
			}
		}
	}
	addr := regexp.MustCompile(`^([a-z0-9-]+)-([0-9]+)\.([a-z0-9-]+)\.baton\.svc\.cluster\.local$`)
	roles := map[string]int{}
	for _, w := range cfg.Workers {
		host, port, err := net.SplitHostPort(w.Address)
		if err != nil {
			t.Errorf("worker %s: %v", w.Name, err)
			continue
		}
		m := addr.FindStringSubmatch(host)
		if m == nil {
			t.Errorf("worker %s: address %q is not a StatefulSet pod DNS name in namespace baton", w.Name, w.Address)
			continue
		}
		set, ordinal, svc := m[1], m[2], m[3]
		doc, ok := sts[set]
		if !ok {
			t.Errorf("worker %s: no StatefulSet %s in the base", w.Name, set)
			continue
		}
		if got := str(doc, "spec", "serviceName"); got != svc || !headless[svc] {
			t.Errorf("worker %s: service %s, but StatefulSet %s has serviceName %q (headless service: %v)", w.Name, svc, set, got, headless[svc])
		}
		i, _ := strconv.Atoi(ordinal)
		if n, _ := get(doc, "spec", "replicas").(int); i >= n {
			t.Errorf("worker %s: StatefulSet %s has %d replicas", w.Name, set, n)
		}
		if w.Name != set+"-"+ordinal {
			t.Errorf("worker %s: name differs from its pod name %s-%s (the worker's --name)", w.Name, set, ordinal)
		}
		roles[w.Role]++
		for _, c := range list(podSpec(doc), "containers") {
			if !batonContainer(c) {
				continue
			}
			args := strs(get(c, "args"))
			if !slices.Contains(args, "--role="+w.Role) {
				t.Errorf("worker %s: role %s, but StatefulSet %s runs %q", w.Name, w.Role, set, args)
			}
			if !slices.Contains(args, "--listen=0.0.0.0:"+port) {
				t.Errorf("worker %s: port %s, but StatefulSet %s runs %q", w.Name, port, set, args)
			}
		}
	}
	if roles[scheduler.RolePrefill] == 0 || roles[scheduler.RoleDecode] == 0 {
		t.Errorf("base fleet roles %v: want prefill and decode workers", roles)
	}
}

// definedFlags returns the flags of a baton subcommand, read from its
// usage text.
func definedFlags(t *testing.T, cmd string) map[string]bool {
	t.Helper()
	var usage bytes.Buffer
	if err := run(context.Background(), []string{cmd, "-h"}, &usage, io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("baton %s -h: %v", cmd, err)
	}
	flags := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z0-9][a-z0-9-]*)`).FindAllStringSubmatch(usage.String(), -1) {
		flags[m[1]] = true
	}
	if len(flags) == 0 {
		t.Fatalf("baton %s -h: no flags in %q", cmd, usage.String())
	}
	return flags
}

func TestDeployContainerFlags(t *testing.T) {
	defined := map[string]map[string]bool{}
	for _, c := range batonCommands {
		defined[c] = definedFlags(t, c)
	}
	seen := map[string]int{}
	for _, m := range readManifests(t) {
		for _, c := range list(podSpec(m.doc), "containers") {
			if !batonContainer(c) {
				continue
			}
			where := fmt.Sprintf("%s: %s %s container %s", m.path, str(m.doc, "kind"), str(m.doc, "metadata", "name"), str(c, "name"))
			if len(strs(get(c, "command"))) > 0 {
				t.Errorf("%s: sets command; the image's entrypoint is baton", where)
			}
			args := strs(get(c, "args"))
			if len(args) == 0 || !slices.Contains(batonCommands, args[0]) {
				t.Errorf("%s: args %q do not start with a baton subcommand (%s)", where, args, strings.Join(batonCommands, ", "))
				continue
			}
			cmd := args[0]
			seen[cmd]++
			for i, a := range args[1:] {
				if !strings.HasPrefix(a, "-") {
					// Flags are written --name=value, so a bare word is an
					// extra positional argument the CLI does not take.
					t.Errorf("%s: argument %d %q is not a --flag=value", where, i+1, a)
					continue
				}
				name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
				if !defined[cmd][name] {
					t.Errorf("%s: baton %s has no flag --%s", where, cmd, name)
				}
			}
		}
	}
	for _, c := range batonCommands {
		if seen[c] == 0 {
			t.Errorf("no container runs baton %s", c)
		}
	}
}

// TestDeployWorkerProbes checks the worker probes ask the gRPC health
// service for the service name the worker registers.
func TestDeployWorkerProbes(t *testing.T) {
	want := workerpb.Worker_ServiceDesc.ServiceName
	n := 0
	for _, m := range readManifests(t) {
		if str(m.doc, "kind") != "StatefulSet" {
			continue
		}
		for _, c := range list(podSpec(m.doc), "containers") {
			args := strs(get(c, "args"))
			if !batonContainer(c) || len(args) == 0 || args[0] != "worker" || str(c, "image") == "" {
				continue
			}
			n++
			for _, p := range []string{"readinessProbe", "livenessProbe"} {
				if got := str(c, p, "grpc", "service"); got != want {
					t.Errorf("%s: %s %s: %s grpc service %q, want %q", m.path, str(m.doc, "metadata", "name"), str(c, "name"), p, got, want)
				}
			}
		}
	}
	if n == 0 {
		t.Error("no worker StatefulSet")
	}
}

func TestDeployDashboardMetrics(t *testing.T) {
	src, err := os.ReadFile("../../scheduler/metrics/metrics.go")
	if err != nil {
		t.Fatal(err)
	}
	defined := map[string]bool{}
	for _, m := range regexp.MustCompile(`"(baton_[a-z0-9_]+)"`).FindAllSubmatch(src, -1) {
		defined[string(m[1])] = true
	}
	b, err := os.ReadFile(filepath.Join(deployDir, "grafana", "baton-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Title  string `json:"title"`
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(b, &dash); err != nil {
		t.Fatalf("dashboard: %v", err)
	}
	used := map[string]bool{}
	for _, p := range dash.Panels {
		if p.Type == "row" {
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q: no queries", p.Title)
		}
		for _, q := range p.Targets {
			if q.Expr == "" {
				t.Errorf("panel %q: an empty query", p.Title)
			}
		}
	}
	for _, m := range regexp.MustCompile(`baton_[a-z0-9_]+`).FindAll(b, -1) {
		name := string(m)
		base := name
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			if s, ok := strings.CutSuffix(name, suffix); ok && defined[s] {
				base = s
			}
		}
		if !defined[base] {
			t.Errorf("dashboard: %s is not a metric of scheduler/metrics/metrics.go", name)
		}
		used[base] = true
	}
	for _, m := range []string{
		"baton_requests_total", "baton_time_to_first_token_seconds", "baton_inter_token_latency_seconds",
		"baton_cached_tokens_total", "baton_prompt_tokens_total", "baton_worker_in_flight",
		"baton_worker_breaker_state", "baton_overflow_spills_total", "baton_transfer_bytes_total",
		"baton_transfer_failures_total", "baton_disagg_decisions_total",
	} {
		if !used[m] {
			t.Errorf("dashboard: no panel shows %s", m)
		}
	}
}
