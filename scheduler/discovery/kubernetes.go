package discovery

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

// The labels (or annotations) of an EndpointSlice that give its workers'
// role and kind. Kubernetes copies a Service's labels onto its
// EndpointSlices, so label each pool's Service.
const (
	LabelRole = "baton.io/role"
	LabelKind = "baton.io/kind"
)

// DefaultKubernetesResync is the period at which the informer replays
// every EndpointSlice it holds, so that a missed event is made up for.
const DefaultKubernetesResync = 30 * time.Second

// KubernetesConfig finds workers by the EndpointSlices of their Services,
// which the scheduler's ServiceAccount may get, list and watch. The zero
// value of a field means its default.
type KubernetesConfig struct {
	// Namespace holds the EndpointSlices. Default: the scheduler's own
	// (its ServiceAccount's namespace).
	Namespace string `yaml:"namespace"`
	// Selector is a label selector of the EndpointSlices, e.g.
	// "kubernetes.io/service-name in (baton-prefill, baton-decode)".
	// Required.
	Selector string `yaml:"selector"`
	// Port names the workers' port in the EndpointSlices. Default: the
	// slice's only port (a slice with several is then skipped).
	Port string `yaml:"port"`
	// Resync is the informer's resync period. Default 30s.
	Resync time.Duration `yaml:"resync"`

	// Client talks to the API server. Nil: the in-cluster configuration.
	Client kubernetes.Interface `yaml:"-"`
}

// WithDefaults returns c with zero fields set to their defaults.
func (c KubernetesConfig) WithDefaults() KubernetesConfig {
	if c.Resync == 0 {
		c.Resync = DefaultKubernetesResync
	}
	return c
}

// Validate reports the first invalid field, by its configuration name.
func (c KubernetesConfig) Validate() error {
	c = c.WithDefaults()
	if c.Selector == "" {
		return errors.New("selector: required, e.g. kubernetes.io/service-name=baton-decode")
	}
	if _, err := labels.Parse(c.Selector); err != nil {
		return fmt.Errorf("selector: %v", err)
	}
	if c.Resync < time.Second {
		return fmt.Errorf("resync: must be at least 1s, got %s", c.Resync)
	}
	return nil
}

// serviceAccountNamespace is where a pod finds its namespace.
const serviceAccountNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// Kubernetes is a Source that follows EndpointSlices through an informer.
type Kubernetes struct {
	cfg     KubernetesConfig
	sel     labels.Selector
	log     *slog.Logger
	l       *latest
	factory informers.SharedInformerFactory
	lister  func() ([]*discoveryv1.EndpointSlice, error)
	poke    chan struct{} // a change to look at; one is enough
	cancel  context.CancelFunc
	done    chan struct{}
}

// NewKubernetes starts following the EndpointSlices cfg selects. Its first
// set comes once the informer has listed them. A member is a ready
// endpoint that is not terminating: its name is its pod's, its
// address the endpoint's first address and the port cfg.Port names; its
// role and kind are its slice's LabelRole and LabelKind, labels first,
// then annotations. A nil log discards.
func NewKubernetes(cfg KubernetesConfig, log *slog.Logger) (*Kubernetes, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.Namespace == "" {
		b, err := os.ReadFile(serviceAccountNamespace)
		if err != nil {
			return nil, fmt.Errorf("namespace: unset, and not running in a pod: %w", err)
		}
		cfg.Namespace = strings.TrimSpace(string(b))
	}
	if cfg.Client == nil {
		rc, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("kubernetes client: %w", err)
		}
		if cfg.Client, err = kubernetes.NewForConfig(rc); err != nil {
			return nil, fmt.Errorf("kubernetes client: %w", err)
		}
	}
	sel, _ := labels.Parse(cfg.Selector) // validated
	k := &Kubernetes{cfg: cfg, sel: sel, log: log, l: newLatest(), poke: make(chan struct{}, 1), done: make(chan struct{})}
	k.factory = informers.NewSharedInformerFactoryWithOptions(cfg.Client, cfg.Resync,
		informers.WithNamespace(cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = cfg.Selector }))
	inf := k.factory.Discovery().V1().EndpointSlices()
	lister := inf.Lister().EndpointSlices(cfg.Namespace)
	k.lister = func() ([]*discoveryv1.EndpointSlice, error) { return lister.List(sel) }
	poke := func() {
		select {
		case k.poke <- struct{}{}:
		default:
		}
	}
	if _, err := inf.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) { poke() },
	}); err != nil {
		return nil, err
	}
	var ctx context.Context
	ctx, k.cancel = context.WithCancel(context.Background())
	k.factory.Start(ctx.Done())
	go k.run(ctx, inf.Informer().HasSynced)
	return k, nil
}

// Updates implements Source.
func (k *Kubernetes) Updates() <-chan []Member { return k.l.ch }

// Close implements Source.
func (k *Kubernetes) Close() error {
	k.cancel()
	<-k.done
	k.factory.Shutdown()
	k.l.close()
	return nil
}

func (k *Kubernetes) run(ctx context.Context, synced cache.InformerSynced) {
	defer close(k.done)
	if !cache.WaitForCacheSync(ctx.Done(), synced) {
		return
	}
	k.log.Info("kubernetes discovery: following EndpointSlices", "namespace", k.cfg.Namespace, "selector", k.cfg.Selector)
	for {
		list, err := k.lister()
		if err != nil {
			k.log.Warn("kubernetes discovery: listing EndpointSlices", "err", err)
		} else {
			k.l.send(k.members(list))
		}
		select {
		case <-ctx.Done():
			return
		case <-k.poke:
		}
	}
}

// members returns the ready endpoints of slices, once per name.
func (k *Kubernetes) members(list []*discoveryv1.EndpointSlice) []Member {
	list = slices.Clone(list)
	slices.SortFunc(list, func(a, b *discoveryv1.EndpointSlice) int { return cmp.Compare(a.Name, b.Name) })
	var ms []Member
	for _, s := range list {
		if !k.sel.Matches(labels.Set(s.Labels)) {
			continue
		}
		port, ok := slicePort(s, k.cfg.Port)
		if !ok {
			k.log.Debug("kubernetes discovery: EndpointSlice without the port", "slice", s.Name, "port", k.cfg.Port)
			continue
		}
		role, kind := sliceMeta(s, LabelRole), sliceMeta(s, LabelKind)
		for _, e := range s.Endpoints {
			// A Service that publishes not-ready addresses marks every
			// endpoint ready, a terminating one too.
			c := e.Conditions
			if len(e.Addresses) == 0 || (c.Ready != nil && !*c.Ready) || (c.Terminating != nil && *c.Terminating) {
				continue
			}
			addr := net.JoinHostPort(e.Addresses[0], strconv.Itoa(int(port)))
			name := addr
			if e.TargetRef != nil && e.TargetRef.Name != "" {
				name = e.TargetRef.Name
			}
			ms = append(ms, Member{Name: name, Address: addr, Role: role, Kind: kind})
		}
	}
	// A dual-stack pod is in two slices: keep the first by slice name.
	return dedupe(ms)
}

// slicePort returns the port of s named name, or its only port if name is
// "".
func slicePort(s *discoveryv1.EndpointSlice, name string) (int32, bool) {
	if name == "" {
		if len(s.Ports) == 1 && s.Ports[0].Port != nil {
			return *s.Ports[0].Port, true
		}
		return 0, false
	}
	for _, p := range s.Ports {
		if p.Name != nil && *p.Name == name && p.Port != nil {
			return *p.Port, true
		}
	}
	return 0, false
}

// sliceMeta returns s's label key, else its annotation key.
func sliceMeta(s *discoveryv1.EndpointSlice, key string) string {
	if v, ok := s.Labels[key]; ok {
		return v
	}
	return s.Annotations[key]
}

var _ Source = (*Kubernetes)(nil)
