package scheduler

import (
	"errors"
	"fmt"
	"strings"
	"sync"

	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/grpcworker"
	"github.com/batonllm/baton/workers/httpengine"
	"github.com/batonllm/baton/workers/llamacpp"
	"github.com/batonllm/baton/workers/vllm"
)

// kinds are the kinds of engine a worker may be, in the order error
// messages list them. A new kind of engine is one package declaring its
// engine.Kind, and one line here (or a call of RegisterKind).
var kinds = []*engine.Kind{
	&grpcworker.Kind,
	&httpengine.Kind,
	&vllm.Kind,
	&vllm.SGLangKind,
	&llamacpp.Kind,
}

var kindsMu sync.RWMutex

// RegisterKind adds a kind of engine that workers may then be configured
// as (kind: its name), as the built-in ones are: before the configuration
// that names it is validated. It refuses a kind without a name or a
// Connect, and a name already taken.
func RegisterKind(k engine.Kind) error {
	if k.Name == "" || k.Connect == nil {
		return errors.New("scheduler: a kind of engine needs a name and a Connect")
	}
	kindsMu.Lock()
	defer kindsMu.Unlock()
	for _, old := range kinds {
		if old.Name == k.Name {
			return fmt.Errorf("scheduler: kind %q is registered already", k.Name)
		}
	}
	kinds = append(kinds, &k)
	return nil
}

// kindOf returns the kind named name, nil when there is none.
func kindOf(name string) *engine.Kind {
	kindsMu.RLock()
	defer kindsMu.RUnlock()
	for _, k := range kinds {
		if k.Name == name {
			return k
		}
	}
	return nil
}

// kindList is "a, b, c or d" (conj "or") of the kinds that have, of them
// all, what has reports (every one with a nil has).
func kindList(conj string, has func(*engine.Kind) bool) string {
	kindsMu.RLock()
	defer kindsMu.RUnlock()
	var names []string
	for _, k := range kinds {
		if has == nil || has(k) {
			names = append(names, k.Name)
		}
	}
	switch n := len(names); n {
	case 0:
		return "none"
	case 1:
		return names[0]
	default:
		return strings.Join(names[:n-1], ", ") + " " + conj + " " + names[n-1]
	}
}

// kindOfWorker is the kind of w, which the configuration checked exists;
// were it unknown, a kind that connects to nothing, with that error.
func kindOfWorker(w WorkerConfig) *engine.Kind {
	if k := kindOf(w.Kind); k != nil {
		return k
	}
	return &engine.Kind{Name: w.Kind, Connect: func(engine.Target) (engine.Client, error) {
		return nil, fmt.Errorf("unknown kind %q", w.Kind)
	}}
}

// tokenizes reports whether w's engine gives the token ids its cache
// events are keyed by.
func tokenizes(w WorkerConfig) bool {
	k := kindOf(w.Kind)
	return k != nil && k.Tokenizes
}

// Capabilities of kinds, for the configuration's checks and messages.
func canPD(k *engine.Kind) bool          { return k.PD != engine.NoPD }
func hasBootstrap(k *engine.Kind) bool   { return k.Bootstrap }
func dataParallel(k *engine.Kind) bool   { return k.DataParallel }
func hasEvents(k *engine.Kind) bool      { return k.Events }
func loadsAdapters(k *engine.Kind) bool  { return k.LoadsAdapters }
func configuredCost(k *engine.Kind) bool { return !k.SelfReported }
