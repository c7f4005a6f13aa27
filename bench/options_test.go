package bench

import (
	"math"
	"strings"
	"testing"
)

// valid are options Validate accepts: the smallest run baton bench makes.
func valid() Options {
	return Options{Strategies: []string{"random", "kv_aware"}, Workers: 7, Speedup: 1}
}

func TestValidateAccepts(t *testing.T) {
	cases := []struct {
		name string
		edit func(*Options)
	}{
		{"as given", func(*Options) {}},
		{"defaults", func(o *Options) { o.Speedup, o.Rate, o.KVBlocks, o.CPUBlocks = 0, 0, 0, 0 }},
		{"simulator's CPU tier", func(o *Options) { o.CPUBlocks = -1 }},
		{"bounds", func(o *Options) { o.Workers, o.ConcurrencyThreshold, o.PrefixLength = 64, 1, 65536 }},
		{"fleets", func(o *Options) {
			o.Fleets = []Fleet{{Workers: 7}, {Workers: 3, Name: "colocated:3"}, {Workers: 3, Prefill: 1, Decode: 2}}
		}},
		{"target", func(o *Options) { o.Target = "http://127.0.0.1:8080"; o.Fleets = []Fleet{{Workers: 7}} }},
		{"strategy twice", func(o *Options) { o.Strategies = []string{"random", "random"} }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o := valid()
			c.edit(&o)
			if err := o.Validate(); err != nil {
				t.Errorf("Validate() = %v, want nil", err)
			}
		})
	}
}

func TestValidateRejects(t *testing.T) {
	cases := []struct {
		name string
		edit func(*Options)
		want string
	}{
		{"no workers", func(o *Options) { o.Workers = 0 }, "--workers: must be 1–1024, got 0"},
		{"too many workers", func(o *Options) { o.Workers = 1025 }, "--workers: must be 1–1024, got 1025"},
		{"negative speedup", func(o *Options) { o.Speedup = -2 }, "--speedup: must be positive, got -2"},
		{"NaN speedup", func(o *Options) { o.Speedup = math.NaN() }, "--speedup: must be positive, got NaN"},
		{"negative rate", func(o *Options) { o.Rate = -1 }, "--rate: must be positive, got -1"},
		{"NaN rate", func(o *Options) { o.Rate = math.NaN() }, "--rate: must be positive, got NaN"},
		{"negative concurrency", func(o *Options) { o.Concurrency = -1 },
			"--concurrency: must not be negative (0: open loop), got -1"},
		{"negative KV blocks", func(o *Options) { o.KVBlocks = -3 }, "--kv-blocks: must be at least 1, got -3"},
		{"CPU blocks", func(o *Options) { o.CPUBlocks = -7 },
			"--cpu-blocks: must be at least -1 (0: none; -1: the simulator's default), got -7"},
		{"shared tier bytes", func(o *Options) { o.SharedTierBytes = -1 }, "--shared-tier-bytes: must be positive, got -1"},
		{"threshold", func(o *Options) { o.ConcurrencyThreshold = 5000 }, "--concurrency-threshold: must be 1–1024, got 5000"},
		{"negative threshold", func(o *Options) { o.ConcurrencyThreshold = -1 }, "--concurrency-threshold: must be 1–1024, got -1"},
		{"prefix length", func(o *Options) { o.PrefixLength = 10 }, "--prefix-length: must be 1024–65536, got 10"},
		{"no strategy", func(o *Options) { o.Strategies = nil }, "--strategies: none given"},
		{"unknown strategy", func(o *Options) { o.Strategies = []string{"kv_aware", "fastest"} },
			`--strategies: unknown "fastest" (known: `},
		{"empty fleet", func(o *Options) { o.Fleets = []Fleet{{}} }, "--fleets: fleet "},
		{"fleet without decode", func(o *Options) { o.Fleets = []Fleet{{Workers: 2, Prefill: 2}} }, "--fleets: fleet "},
		{"fleet without prefill", func(o *Options) { o.Fleets = []Fleet{{Workers: 2, Decode: 2}} }, "--fleets: fleet "},
		{"fleet too large", func(o *Options) { o.Fleets = []Fleet{{Workers: 1025}} }, "--fleets: fleet "},
		{"fleet twice", func(o *Options) { o.Fleets = []Fleet{{Workers: 7}, {Workers: 7}} },
			"--fleets: fleet 7 colocated given twice (columns would share a label)"},
		{"target with fleets", func(o *Options) {
			o.Target = "http://127.0.0.1:8080"
			o.Fleets = []Fleet{{Workers: 2, Prefill: 1, Decode: 1}}
		}, "--fleets and --shared-tier apply to in-process fleets, not --target"},
		{"target with shared tier", func(o *Options) { o.Target = "http://127.0.0.1:8080"; o.SharedTier = true },
			"--fleets and --shared-tier apply to in-process fleets, not --target"},
		{"no replica", func(o *Options) { o.Replicas = []int{1, 0} }, "--replicas: must be 1–16 each, got 0"},
		{"too many replicas", func(o *Options) { o.Replicas = []int{17} }, "--replicas: must be 1–16 each, got 17"},
		{"replicas twice", func(o *Options) { o.Replicas = []int{2, 2} },
			"--replicas: 2 given twice (columns would share a label)"},
		{"target with replicas", func(o *Options) { o.Target = "http://127.0.0.1:8080"; o.Replicas = []int{1, 2} },
			"--replicas applies to in-process fleets, not --target"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			o := valid()
			c.edit(&o)
			err := o.Validate()
			if err == nil || !strings.HasPrefix(err.Error(), c.want) {
				t.Errorf("Validate() = %v, want an error starting %q", err, c.want)
			}
		})
	}
}

// Run refuses invalid options before starting anything.
func TestRunValidates(t *testing.T) {
	o := valid()
	o.Workers = 0
	if _, err := Run(t.Context(), o, nil); err == nil || err.Error() != "--workers: must be 1–1024, got 0" {
		t.Errorf("Run: %v", err)
	}
}
