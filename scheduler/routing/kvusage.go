package routing

import "github.com/batonllm/baton/scheduler/kvindex"

// kvUsageScorer prefers workers using less of their GPU KV cache, by their
// latest load report: 1 − used/total, and 1 for a worker that reported
// none. A worker short of free blocks preempts or queues what it is sent.
type kvUsageScorer struct{ idx *kvindex.Index }

func (kvUsageScorer) Name() string { return "kv_usage" }

func (s kvUsageScorer) Score(c *Cycle, scores []float64) {
	var (
		names [kvindex.MaxWorkers]string
		ms    [kvindex.MaxWorkers]kvindex.Match
	)
	for k := 0; k < len(c.Cands); k += len(names) {
		batch := c.Cands[k:min(k+len(names), len(c.Cands))]
		for i, w := range batch {
			names[i] = w.Name
		}
		s.idx.Lookup(nil, names[:len(batch)], ms[:len(batch)])
		for i := range batch {
			scores[k+i] = 1
			if l := ms[i].Load; l.GPUBlocksTotal > 0 {
				scores[k+i] = 1 - min(float64(l.GPUBlocksUsed)/float64(l.GPUBlocksTotal), 1)
			}
		}
	}
}

var _ Scorer = kvUsageScorer{}
