package vllm

import (
	"bytes"
	"math"
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// textSeeds are lines of the text format as engines write them, and
// their edge cases.
var textSeeds = []string{
	"# HELP vllm:num_requests_running Number of requests in model execution batches.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n",
	"vllm:num_requests_waiting{model_name=\"m\"} 0\nvllm:num_requests_running 1 1700000000000\n",
	"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\",cache_dtype=\"auto\"} 1.0\n",
	"vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a,b\",waiting_lora_adapters=\"\"} 1.7e+09\n",
	"x{a=\"q\\\"uote\\\\back\\nline\",b=\"\"} NaN\ny +Inf\nz -Inf\n",
	"x{a=\"1\",} 2\n",
	"x {a=\"1\"} 2\n",
	"x{a=\"1\"}2\n",
	"  x\t 2 \t\n",
	"x 2 3 4\n",
	"x{a=\"1\",a=\"2\"} 2\n",
	"x{a=\"\\q\"} 2\n",
	"x 0x1p-2\n",
	"x 1_000\n",
	"# TYPE x gauge\n# TYPE x gauge\n",
	"x 1\n# TYPE x gauge\n",
	"# TYPE x histogram\nx 1\n",
	"# TYPE x info\n",
	"x 1\ny 2\nx 3\n",
	"# HELP x a\n# HELP x b\n",
	"#  TYPE x counter\nx 1\n",
	"# some comment\n",
	"1x 2\n",
	"x{1a=\"1\"} 2\n",
	"x{a:b=\"1\"} 2\n",
	"x\n",
	"x{a=\"1\" 2\n",
	"x 1\r\n",
	"x{a=\"é\"} 2\n",
	"x 1e400\n",
	"x{a=\"\xff\"} 1\n",
	"x infinity\n",
}

// baton's parser reads what expfmt's reads: a page one accepts, the other
// does, with the same families, types, labels and values.
func FuzzParseText(f *testing.F) {
	for _, s := range textSeeds {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, text []byte) {
		if !bytes.HasSuffix(text, []byte("\n")) {
			text = append(text, '\n')
		}
		if outsideEngines(text) {
			return
		}
		got, err := parseText(text)
		tp := expfmt.NewTextParser(model.UTF8Validation)
		want, werr := tp.TextToMetricFamilies(bytes.NewReader(text))
		if (err == nil) != (werr == nil) {
			t.Fatalf("%q: error %v, expfmt's %v", text, err, werr)
		}
		if err != nil {
			return
		}
		for name, wf := range want {
			gf := got[name]
			if len(wf.GetMetric()) == 0 {
				continue // a family of comments only
			}
			if gf == nil {
				t.Fatalf("%q: family %s missing", text, name)
			}
			if len(gf.samples) != len(wf.GetMetric()) {
				t.Fatalf("%q: %s has %d samples, expfmt %d", text, name, len(gf.samples), len(wf.GetMetric()))
			}
			if gt, wt := gf.typ, strings.ToLower(wf.GetType().String()); gt != wt {
				t.Fatalf("%q: %s of type %s, expfmt %s", text, name, gt, wt)
			}
			for i, wm := range wf.GetMetric() {
				gs := &gf.samples[i]
				if gv, wv := gf.val(gs), expfmtValue(wm); gv != wv && !(math.IsNaN(gv) && math.IsNaN(wv)) {
					t.Fatalf("%q: %s sample %d value %v, expfmt %v", text, name, i, gv, wv)
				}
				var wl []label
				for _, l := range wm.GetLabel() {
					wl = append(wl, label{l.GetName(), l.GetValue()})
				}
				if gl := gs.labels; !slices.Equal(gl, wl) {
					t.Fatalf("%q: %s sample %d labels %v, expfmt %v", text, name, i, gl, wl)
				}
			}
		}
		for name, gf := range got {
			if len(gf.samples) > 0 && want[name] == nil {
				t.Fatalf("%q: family %s that expfmt does not have", text, name)
			}
		}
	})
}

// outsideEngines reports text that no engine's families baton reads
// hold, and whose reading expfmt complicates: histograms and summaries
// (whose _bucket, _sum and _count samples join one family), quoted
// (UTF-8) metric and label names, and the reserved __name__ label.
func outsideEngines(text []byte) bool {
	lower := bytes.ToLower(text)
	for _, s := range []string{"histogram", "summary", "__name__"} {
		if bytes.Contains(lower, []byte(s)) {
			return true
		}
	}
	// A quote that does not open a label value (after '=') quotes a name.
	in := false
	for i := 0; i < len(text); i++ {
		switch {
		case in && text[i] == '\\':
			i++
		case in && text[i] == '"':
			in = false
		case !in && text[i] == '"':
			if i == 0 || text[i-1] != '=' {
				return true
			}
			in = true
		case !in && text[i] == '#':
			for i < len(text) && text[i] != '\n' {
				i++
			}
		}
	}
	return false
}

func expfmtValue(m *dto.Metric) float64 {
	switch {
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Untyped != nil:
		return m.Untyped.GetValue()
	}
	return math.NaN()
}
