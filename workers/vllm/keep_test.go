package vllm

import (
	"bytes"
	"testing"
)

// keep, which matches sample lines by their names' lengths, keeps exactly
// the lines keepSlow keeps by reading every line's name.
func FuzzKeep(f *testing.F) {
	f.Add([]byte("vllm:num_requests_running{engine=\"0\"} 3.0\nvllm:num_requests_running_x 1\n"))
	f.Add([]byte("# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 2"))
	f.Add([]byte("vllm:num_requests_waiting\n vllm:num_requests_waiting 1\n\tvllm:kv_cache_usage_perc\t0.5\r\n"))
	f.Add([]byte("vllm:num_requests_running"))
	f.Add([]byte("sglang:num_queue_reqs{dp_rank=\"1\"} 4\nsglang:num_queue_reqsX 4\n\n\n#\n# TYPE\n"))
	f.Add([]byte("# HELP  vllm:num_requests_running x\n#  TYPE vllm:num_requests_running gauge\n# HELP vllm:num_requests_runningx\n# TYPE \tvllm:cache_config_info info\n"))
	f.Add([]byte("vllm:time_to_first_token_seconds_bucket{le=\"0.001\"} 0\nvllm:cache_config_info{block_size=\"16\"} 1\n"))
	f.Fuzz(func(t *testing.T, page []byte) {
		for e, n := range engineNames {
			fast := n.keep(page, nil)
			slow := n.keepSlow(page, nil)
			if !bytes.Equal(fast, slow) {
				t.Fatalf("%v: keep kept\n%q\nkeepSlow kept\n%q", e, fast, slow)
			}
		}
	})
}

// Every engine's names are grouped by length, shortest first, each once.
func TestGroupByLen(t *testing.T) {
	for e, n := range engineNames {
		seen := 0
		for i, g := range n.byLen {
			if i > 0 && g.n <= n.byLen[i-1].n {
				t.Errorf("%v: lengths out of order: %d after %d", e, g.n, n.byLen[i-1].n)
			}
			for _, name := range g.names {
				if len(name) != g.n {
					t.Errorf("%v: %q in the group of length %d", e, name, g.n)
				}
				if _, ok := n.read[name]; !ok {
					t.Errorf("%v: %q grouped but not read", e, name)
				}
				seen++
			}
		}
		if seen != len(n.read) {
			t.Errorf("%v: %d names grouped of %d read", e, seen, len(n.read))
		}
	}
}
