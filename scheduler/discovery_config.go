package scheduler

import (
	"errors"
	"fmt"

	"github.com/batonllm/baton/scheduler/discovery"
	"github.com/batonllm/baton/transfer/tlsconf"
)

// Discovery modes.
const (
	// DiscoveryStatic routes to the workers list (the default).
	DiscoveryStatic = "static"
	// DiscoveryDNS routes to the addresses of a DNS name's records.
	DiscoveryDNS = "dns"
	// DiscoveryKubernetes routes to the ready endpoints of EndpointSlices.
	DiscoveryKubernetes = "kubernetes"
)

// DiscoveryConfig says where the scheduler finds its workers. The zero
// value is the static workers list.
type DiscoveryConfig struct {
	// Mode is static (default: the workers list), dns or kubernetes. In dns
	// and kubernetes modes workers join and leave while the scheduler
	// runs: a new one is routed to once it describes itself, a departing
	// one gets no new request and keeps its requests in flight until they
	// end; workers must be empty.
	Mode string `yaml:"mode"`
	// DNS is the name to resolve in dns mode.
	DNS discovery.DNSConfig `yaml:"dns"`
	// Kubernetes selects the EndpointSlices in kubernetes mode. The
	// scheduler's ServiceAccount needs get, list and watch on
	// discovery.k8s.io endpointslices.
	Kubernetes discovery.KubernetesConfig `yaml:"kubernetes"`
	// Worker is what every discovered worker shares: a workers entry
	// without name and address, which discovery gives. An EndpointSlice's
	// baton.io/kind and baton.io/role labels (or annotations) override
	// kind and role. In events and events_replay, {host} stands for the
	// worker's address (tcp://{host}:5557).
	Worker WorkerConfig `yaml:"worker"`
}

// discovered reports whether workers come from dns or kubernetes.
func (c DiscoveryConfig) discovered() bool {
	return c.Mode == DiscoveryDNS || c.Mode == DiscoveryKubernetes
}

// workersToValidate checks the discovery fields, and returns the workers
// Config.Validate checks and the field name of each: the workers list, or
// in dns and kubernetes modes the worker template, standing for every
// discovered worker.
func (c DiscoveryConfig) workersToValidate(workers []WorkerConfig) ([]WorkerConfig, func(int) string, error) {
	switch c.Mode {
	case "", DiscoveryStatic:
		if c.DNS != (discovery.DNSConfig{}) || c.Kubernetes != (discovery.KubernetesConfig{}) {
			return nil, nil, errors.New("discovery.mode: dns or kubernetes settings are given, but mode is static")
		}
		if len(c.Worker.Models) > 0 || c.Worker.Kind != "" || c.Worker.Role != "" || c.Worker.Name != "" || c.Worker.Address != "" || c.Worker.TLS != (tlsconf.Config{}) {
			return nil, nil, errors.New("discovery.worker: only dns and kubernetes discovery have it; list static workers in workers")
		}
		if len(workers) == 0 {
			return nil, nil, errors.New("workers: at least one worker is required (or discovery.mode dns or kubernetes)")
		}
		return workers, func(i int) string { return fmt.Sprintf("workers[%d]", i) }, nil
	case DiscoveryDNS, DiscoveryKubernetes:
	default:
		return nil, nil, fmt.Errorf("discovery.mode: must be %s, %s or %s, got %q", DiscoveryStatic, DiscoveryDNS, DiscoveryKubernetes, c.Mode)
	}
	if len(workers) > 0 {
		return nil, nil, fmt.Errorf("workers: must be empty with discovery.mode %s (discovery.worker configures the workers found)", c.Mode)
	}
	var err error
	if c.Mode == DiscoveryDNS {
		if c.Kubernetes != (discovery.KubernetesConfig{}) {
			return nil, nil, errors.New("discovery.kubernetes: set, but mode is dns")
		}
		if err = c.DNS.Validate(); err != nil {
			err = fmt.Errorf("discovery.dns.%w", err)
		}
	} else {
		if c.DNS != (discovery.DNSConfig{}) {
			return nil, nil, errors.New("discovery.dns: set, but mode is kubernetes")
		}
		if err = c.Kubernetes.Validate(); err != nil {
			err = fmt.Errorf("discovery.kubernetes.%w", err)
		}
	}
	if err != nil {
		return nil, nil, err
	}
	w := c.Worker
	switch {
	case w.Name != "":
		return nil, nil, errors.New("discovery.worker.name: discovery names each worker; leave it unset")
	case w.Address != "":
		return nil, nil, errors.New("discovery.worker.address: discovery finds each worker's address; leave it unset")
	}
	// Stand-ins for what discovery gives, so that the template is checked
	// as a worker is.
	if w.Kind == "" {
		w.Kind = KindGRPC
	}
	w.Name, w.Address = "discovered", "127.0.0.1:1"
	if k := kindOf(w.Kind); k != nil && k.URL {
		w.Address = "http://127.0.0.1:1"
		if w.TLS != (tlsconf.Config{}) {
			w.Address = "https://127.0.0.1:1" // as members gives it
		}
	}
	return []WorkerConfig{w}, func(int) string { return "discovery.worker" }, nil
}
