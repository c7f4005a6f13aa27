package routing

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/internal/strictyaml"
	"github.com/google/go-cmp/cmp"
)

// profiles decodes the profiles of a configuration file's YAML, as the
// scheduler's LoadConfig does.
func profiles(t testing.TB, text string) []ProfileConfig {
	t.Helper()
	var c struct {
		Profiles []ProfileConfig `yaml:"profiles"`
	}
	if err := strictyaml.Unmarshal([]byte(text), &c); err != nil {
		t.Fatalf("decoding %q: %v", text, err)
	}
	return c.Profiles
}

// Two prefix scorers with their own thresholds and weights: the loose one
// keeps a request on its busy home until the home reaches its threshold,
// past the strict one's; each is timed under its own name.
func TestTwoInstancesOfOneScorerRouteAndDoNotAllocate(t *testing.T) {
	pcs := profiles(t, `
profiles:
  - name: graded
    filters: [available, model, {type: adapter, options: {load: false}}]
    scorers:
      - {name: prefix_loose, type: prefix, weight: 1, options: {concurrency_threshold: 8}}
      - {name: prefix_strict, type: prefix, weight: 1, options: {concurrency_threshold: 2}}
      - {name: load, weight: 0.5}
    picker: max
`)
	var reg Registry
	RegisterBuiltins(&reg)
	if err := reg.RegisterProfile(pcs[0]); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	timed := map[string]int{}
	timer := func(_, part string) func(time.Duration) {
		return func(time.Duration) { mu.Lock(); timed[part]++; mu.Unlock() }
	}
	s, err := reg.New("graded", Params{}, Deps{Rand: SeededRand(1), PartTimer: timer})
	if err != nil {
		t.Fatal(err)
	}
	f := newFleet(t, 4)
	req := &Request{Model: "llama", PrefixKey: 42}
	home := pick(t, s, req, f.snap()).Worker.Name
	for _, tt := range []struct {
		load   int
		spill  bool
		reason Reason
	}{
		{0, false, ReasonHome}, // 1 + 1 + 0.5
		{3, false, ReasonHome}, // 0 + 1 + 0.125 against 0.5 elsewhere
		{9, true, ReasonSpill}, // 0 + 0 + 0.05 against 0.5
	} {
		f.load(home, tt.load-f.worker(home).InFlight()) // loads only add
		d := pick(t, s, req, f.snap())
		if got := d.Worker.Name != home; got != tt.spill || d.Reason != tt.reason {
			t.Errorf("home at %d in flight: picked %s (%s), home %s; want spill %v (%s)", tt.load, d.Worker.Name, d.Reason, home, tt.spill, tt.reason)
		}
	}
	snap := f.snap()
	if n := testing.AllocsPerRun(100, func() { _, _ = s.Pick(req, snap) }); n != 0 && !raceEnabled {
		t.Errorf("Pick allocates %v times, want 0", n)
	}
	for _, part := range []string{"filters", "prefix_loose", "prefix_strict", "load", "picker"} {
		if timed[part] != 4+101 {
			t.Errorf("part %s timed %d times, want 105 (timed: %v)", part, timed[part], timed)
		}
	}
}

// An option a part does not know, or an invalid one, is refused when the
// profile is registered (at start), naming the field by its path.
func TestProfileOptionErrors(t *testing.T) {
	for _, tt := range []struct {
		yaml, want string
	}{
		{`{name: p, scorers: [{name: strict, type: prefix, options: {threshold: 4}}]}`,
			`scorers[0].options.threshold: line 2: unknown field (known: concurrency_threshold)`},
		{`{name: p, scorers: [{name: strict, type: prefix, options: {concurrency_threshold: 2000}}]}`,
			`scorers[0].options.concurrency_threshold: must be 1–1024, got 2000`},
		{`{name: p, scorers: [{name: strict, type: prefix, options: {concurrency_threshold: many}}]}`,
			`scorers[0].options.concurrency_threshold: line 2: "many" is not an integer`},
		{`{name: p, scorers: [{name: load}, {name: load2, type: load, options: {scale: 2}}]}`,
			`scorers[1].options.scale: line 2: unknown field (there are none)`},
		{`{name: p, scorers: [{name: fast, type: prefx}]}`,
			`scorers[0].type: unknown scorer "prefx" (known: kv, kv_usage, load, prefix)`},
		{`{name: p, filters: [available, {type: adapter, options: {lod: true}}]}`,
			`filters[1].options.lod: line 2: unknown field; did you mean load?`},
		{`{name: p, picker: {type: max, options: {ties: first}}}`,
			`picker.options.ties: line 2: unknown field (there are none)`},
	} {
		pcs := profiles(t, "profiles:\n  - "+tt.yaml+"\n")
		var reg Registry
		RegisterBuiltins(&reg)
		if err := reg.RegisterProfile(pcs[0]); err == nil || err.Error() != tt.want {
			t.Errorf("%s: got %v, want %s", tt.yaml, err, tt.want)
		}
	}
	// The shape itself is checked as the file is read.
	for _, tt := range []struct{ yaml, want string }{
		{`{name: p, scorers: [{name: load, options: 3}]}`, `profiles[0].scorers[0].options: line 2: must be a mapping`},
		{`{name: p, picker: {type: max, opts: {}}}`, `profiles[0].picker.opts: line 2: unknown field (known: type, options)`},
		{`{name: p, filters: [[available]]}`, `profiles[0].filters[0]: line 2: a list is not a mapping of fields`},
	} {
		var c struct {
			Profiles []ProfileConfig `yaml:"profiles"`
		}
		err := strictyaml.Unmarshal([]byte("profiles:\n  - "+tt.yaml+"\n"), &c)
		if err == nil || err.Error() != tt.want {
			t.Errorf("%s: got %v, want %s", tt.yaml, err, tt.want)
		}
	}
}

// nthPicker picks candidate n (modulo their number): a registered picker
// with options.
type nthPicker struct{ n int }

func (nthPicker) Name() string                     { return "nth" }
func (p nthPicker) Pick(c *Cycle, _ []float64) int { return p.n % len(c.Cands) }

type nthOptions struct {
	N int `yaml:"n"`
}

func (o *nthOptions) Validate() error {
	if o.N < 0 {
		return fmt.Errorf("n: must not be negative, got %d", o.N)
	}
	return nil
}

func TestRegisteredPickerWithOptions(t *testing.T) {
	var reg Registry
	RegisterBuiltins(&reg)
	RegisterPickerWith(&reg, "nth", func(o nthOptions, _ Params, _ Deps) (Picker, error) { return nthPicker{o.N}, nil })
	f := newFleet(t, 0)
	for _, name := range []string{"a", "b", "c"} {
		f.add(name, "llama")
	}
	pcs := profiles(t, `
profiles:
  - {name: second, picker: {type: nth, options: {n: 1}}}
  - {name: first, picker: nth}
  - {name: bad, picker: {type: nth, options: {n: -1}}}
`)
	for _, pc := range pcs[:2] {
		if err := reg.RegisterProfile(pc); err != nil {
			t.Fatal(err)
		}
	}
	if err := reg.RegisterProfile(pcs[2]); err == nil || err.Error() != "picker.options.n: must not be negative, got -1" {
		t.Errorf("bad: %v", err)
	}
	for name, want := range map[string]string{"second": "b", "first": "a"} {
		s, err := reg.New(name, Params{}, Deps{})
		if err != nil {
			t.Fatal(err)
		}
		if d := pick(t, s, &Request{Model: "llama"}, f.snap()); d.Worker.Name != want || d.Reason != ReasonScored {
			t.Errorf("%s picked %s (%s), want %s (scored)", name, d.Worker.Name, d.Reason, want)
		}
	}
}

// The YAML shorthand (a part by its name, a scorer by its type's name)
// and the long form describe the same profile.
func TestProfileShorthand(t *testing.T) {
	pcs := profiles(t, `
profiles:
  - name: short
    filters: [available, model]
    scorers: [{name: prefix, weight: 2}, {name: load}]
    picker: round_robin
  - name: short
    filters: [{type: available}, {type: model}]
    scorers: [{name: prefix, type: prefix, weight: 2}, {name: load, type: load}]
    picker: {type: round_robin}
`)
	var reg Registry
	RegisterBuiltins(&reg)
	a, errA := reg.plan(pcs[0])
	b, errB := reg.plan(pcs[1])
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	names := func(p *profilePlan) []any {
		out := []any{len(p.filters)}
		for _, s := range p.scorers {
			out = append(out, s.name, s.weight)
		}
		return out
	}
	if diff := cmp.Diff(names(a), names(b)); diff != "" {
		t.Errorf("shorthand and long form differ (-short +long):\n%s", diff)
	}
	if pcs[0].Picker.Type != "round_robin" || pcs[0].Picker.Type != pcs[1].Picker.Type {
		t.Errorf("pickers %q and %q", pcs[0].Picker.Type, pcs[1].Picker.Type)
	}
}

// FuzzProfileConfig: no profiles list, however malformed, panics the
// decoder, the registry or a pick of a profile it accepted; what it
// refuses it refuses with an error.
func FuzzProfileConfig(f *testing.F) {
	f.Add([]byte("profiles: [{name: p, filters: [available, {type: adapter, options: {load: true}}], scorers: [{name: a, type: prefix, options: {concurrency_threshold: 2}}, {name: load, weight: 3}], picker: max}]\n"))
	f.Add([]byte("profiles: [{name: kv2, scorers: [{name: kv}, {name: kv_usage, weight: 0.5}], picker: {type: kv_aware, options: {replicate: false}}}]\n"))
	f.Add([]byte("profiles: [{name: p, picker: {type: round_robin, options: &o {x: 1}}, scorers: [{name: s, type: load, options: *o}]}]\n"))
	f.Add([]byte("profiles: [{name: p, scorers: [{name: a, options: {<<: {concurrency_threshold: 3}}}]}]\n"))
	fl := newKVFleet(f, 3)
	f.Fuzz(func(t *testing.T, b []byte) {
		var c struct {
			Profiles []ProfileConfig `yaml:"profiles"`
		}
		if strictyaml.Unmarshal(b, &c) != nil {
			return
		}
		var reg Registry
		RegisterBuiltins(&reg)
		for _, pc := range c.Profiles {
			if reg.RegisterProfile(pc) != nil {
				continue
			}
			s, err := reg.New(pc.Name, Params{}, Deps{Rand: SeededRand(1), Index: fl.idx})
			if err != nil {
				continue
			}
			if _, err := s.Pick(kvRequest(prompt(1)), fl.snap()); err != nil && err != ErrNoWorker {
				t.Errorf("%s: Pick: %v", pc.Name, err)
			}
		}
	})
}

// A profile may combine the kv scorer with others and keep kv_aware's
// choice through its picker: with KV usage weighed in, the worker holding
// less of the prompt but with room in its cache wins; at the threshold
// the kv_aware picker passes it over (a spill), where max would not.
func TestKVScorerBesideOthersRoutesAndDoesNotAllocate(t *testing.T) {
	ks := prompt(1)
	f := newKVFleet(t, 3)
	f.store("w00", workerpb.Tier_TIER_GPU, ks[:400])
	f.store("w01", workerpb.Tier_TIER_GPU, ks[:300])
	f.report("w00", &workerpb.LoadReport{GpuBlocksUsed: 950, GpuBlocksTotal: 1000})
	f.report("w01", &workerpb.LoadReport{GpuBlocksUsed: 100, GpuBlocksTotal: 1000})
	f.report("w02", &workerpb.LoadReport{GpuBlocksUsed: 100, GpuBlocksTotal: 1000})
	var reg Registry
	RegisterBuiltins(&reg)
	for _, pc := range profiles(t, `
profiles:
  - name: roomy
    scorers: [{name: kv}, {name: kv_usage, weight: 2}]
    picker: kv_aware
  - name: roomy_max
    scorers: [{name: kv}, {name: kv_usage, weight: 2}]
`) {
		if err := reg.RegisterProfile(pc); err != nil {
			t.Fatal(err)
		}
	}
	deps := Deps{Rand: SeededRand(1), Index: f.idx}
	for _, tt := range []struct {
		strategy string
		busy     int // requests in flight on w01
		want     string
		cached   int
		spill    bool
		reason   Reason
	}{
		{KVAware, 0, "w00", 400 * 16, false, ReasonKVAware},
		{"roomy", 0, "w01", 300 * 16, false, ReasonScored},
		{"roomy_max", 0, "w01", 300 * 16, false, ReasonScored},
		{"roomy", 2, "w02", 0, true, ReasonScored},
		{"roomy_max", 2, "w01", 300 * 16, false, ReasonAllFull},
	} {
		s, err := reg.New(tt.strategy, Params{ConcurrencyThreshold: 2}, deps)
		if err != nil {
			t.Fatal(err)
		}
		if !UsesKeys(s) {
			t.Errorf("%s does not use keys", tt.strategy)
		}
		f.load("w01", tt.busy-f.worker("w01").InFlight()) // loads only add
		d := pick(t, s, kvRequest(ks), f.snap())
		if d.Worker.Name != tt.want || d.PredictedCached != tt.cached || d.Spill != tt.spill || d.Reason != tt.reason {
			t.Errorf("%s, w01 with %d in flight: %s (cached %d, spill %t, %s), want %s (cached %d, spill %t, %s)",
				tt.strategy, tt.busy, d.Worker.Name, d.PredictedCached, d.Spill, d.Reason, tt.want, tt.cached, tt.spill, tt.reason)
		}
		req, snap := kvRequest(ks), f.snap()
		if n := testing.AllocsPerRun(100, func() { _, _ = s.Pick(req, snap) }); n != 0 && !raceEnabled {
			t.Errorf("%s: Pick allocates %v times, want 0", tt.strategy, n)
		}
	}
}

// The kv_aware strategy is a profile of the kv scorer and the kv_aware
// picker: a custom profile of the same parts decides alike.
func TestKVAwareIsItsParts(t *testing.T) {
	var reg Registry
	RegisterBuiltins(&reg)
	pcs := profiles(t, `
profiles:
  - name: mine
    filters: [available, model, {type: adapter, options: {load: true}}]
    scorers: [{name: kv}]
    picker: kv_aware
`)
	if err := reg.RegisterProfile(pcs[0]); err != nil {
		t.Fatal(err)
	}
	for seed := range uint64(20) {
		f := newKVFleet(t, 6)
		rng := SeededRand(seed)
		for i, w := range f.snap().Workers {
			ks := prompt(rng(3))
			f.store(w.Name, workerpb.Tier_TIER_GPU, ks[:rng(500)])
			f.report(w.Name, &workerpb.LoadReport{Running: int32(rng(4)), WaitingPrefillTokens: int64(rng(3)) * 4000})
			f.load(w.Name, i%3)
		}
		deps := Deps{Rand: SeededRand(seed), Index: f.idx}
		kv, err := reg.New(KVAware, Params{ConcurrencyThreshold: 2}, deps)
		if err != nil {
			t.Fatal(err)
		}
		mine, err := reg.New("mine", Params{ConcurrencyThreshold: 2}, deps)
		if err != nil {
			t.Fatal(err)
		}
		for p := range uint64(4) {
			req := kvRequest(prompt(p))
			a, b := summary(pick(t, kv, req, f.snap())), summary(pick(t, mine, req, f.snap()))
			if a.Reason == ReasonKVAware && b.Reason == ReasonScored {
				b.Reason = a.Reason // kv_aware names its own
			}
			if diff := cmp.Diff(a, b); diff != "" {
				t.Errorf("seed %d prompt %d: kv_aware and its parts differ (-kv_aware +parts):\n%s", seed, p, diff)
			}
		}
	}
}

// decisionSummary is a Decision with its workers by name, to compare.
type decisionSummary struct {
	Worker, Home    string
	Spill           bool
	PredictedCached int
	Estimate        time.Duration
	Reason          Reason
}

func summary(d Decision) decisionSummary {
	s := decisionSummary{Worker: d.Worker.Name, Spill: d.Spill, PredictedCached: d.PredictedCached, Estimate: d.Estimate, Reason: d.Reason}
	if d.Home != nil {
		s.Home = d.Home.Name
	}
	return s
}
