package routing_test

import (
	"fmt"
	"strings"

	"github.com/batonllm/baton/scheduler/internal/strictyaml"
	"github.com/batonllm/baton/scheduler/pool"
	"github.com/batonllm/baton/scheduler/routing"
)

// A copy of the parts of docs/strategies.md ("Write a scorer"), and the
// profile it configures them in.

// headroomScorer prefers workers far from a ceiling of requests in
// flight: 1 when idle, falling to 0 at the ceiling and past it.
type headroomScorer struct{ ceiling int }

// headroomOptions are the scorer's options in a profile.
type headroomOptions struct {
	// Ceiling is the requests in flight at which a worker scores 0;
	// 0 means the strategy's concurrency_threshold.
	Ceiling int `yaml:"ceiling"`
}

func (o *headroomOptions) Validate() error {
	if o.Ceiling < 0 || o.Ceiling > 1024 {
		return fmt.Errorf("ceiling: must be 0–1024, got %d", o.Ceiling)
	}
	return nil
}

func newHeadroom(o headroomOptions, p routing.Params, _ routing.Deps) (routing.Scorer, error) {
	if o.Ceiling == 0 {
		o.Ceiling = p.ConcurrencyThreshold
	}
	return headroomScorer{ceiling: o.Ceiling}, nil
}

func (headroomScorer) Name() string { return "headroom" }

// Score reads only the candidates' atomic in-flight counts: it neither
// blocks nor allocates, and writes nothing but scores.
func (s headroomScorer) Score(c *routing.Cycle, scores []float64) {
	for i, w := range c.Cands {
		if n := w.InFlight(); n < s.ceiling {
			scores[i] = 1 - float64(n)/float64(s.ceiling)
		}
	}
}

// Reason names a decision for a worker past the ceiling all_full, and
// leaves the others to the profile.
func (s headroomScorer) Reason(_ *routing.Cycle, w *pool.Worker) (routing.Reason, bool) {
	return routing.ReasonAllFull, w.InFlight() >= s.ceiling
}

// noCanary drops the workers named canary-*, in the profiles that list it.
type noCanary struct{}

func (noCanary) Name() string { return "no_canary" }

func (noCanary) Keep(_ *routing.Request, w *pool.Worker) bool {
	return !strings.HasPrefix(w.Name, "canary-")
}

// maxLeastLoaded picks the highest total, ties to the worker with the
// fewest requests in flight.
type maxLeastLoaded struct{}

func (maxLeastLoaded) Name() string { return "max_least_loaded" }

func (maxLeastLoaded) Pick(c *routing.Cycle, totals []float64) int {
	best := 0
	for i := 1; i < len(totals); i++ {
		if totals[i] > totals[best] ||
			totals[i] == totals[best] && c.Cands[i].InFlight() < c.Cands[best].InFlight() {
			best = i
		}
	}
	return best
}

var (
	_ routing.Scorer   = headroomScorer{}
	_ routing.Reasoner = headroomScorer{}
	_ routing.Filter   = noCanary{}
	_ routing.Picker   = maxLeastLoaded{}
)

// Register adds the parts to r, next to routing.RegisterBuiltins(r).
func Register(r *routing.Registry) {
	routing.RegisterScorerWith(r, "headroom", newHeadroom)
	r.RegisterFilter(noCanary{})
	r.RegisterPicker("max_least_loaded", func(routing.Params, routing.Deps) (routing.Picker, error) {
		return maxLeastLoaded{}, nil
	})
}

func Example_writeAScorer() {
	var r routing.Registry
	routing.RegisterBuiltins(&r)
	Register(&r)
	var cfg struct {
		Profiles []routing.ProfileConfig `yaml:"profiles"`
	}
	err := strictyaml.Unmarshal([]byte(`
profiles:
  - name: roomy
    filters: [available, model, no_canary]
    scorers:
      - {name: prefix, weight: 2}
      - {name: headroom, weight: 1}
      - {name: headroom_tight, type: headroom, weight: 0.5, options: {ceiling: 4}}
    picker: max_least_loaded
  - name: too_roomy
    scorers:
      - {name: headroom, options: {ceiling: 5000}}
`), &cfg)
	if err != nil {
		panic(err)
	}
	for i, pc := range cfg.Profiles {
		if err := r.RegisterProfile(pc); err != nil {
			fmt.Printf("profiles[%d].%v\n", i, err)
			continue
		}
		s, err := r.New(pc.Name, routing.Params{}, routing.Deps{})
		fmt.Println(s.Name(), err)
	}
	// Output:
	// roomy <nil>
	// profiles[1].scorers[0].options.ceiling: must be 0–1024, got 5000
}
