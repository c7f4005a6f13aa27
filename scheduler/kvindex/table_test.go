package kvindex

import (
	"slices"
	"testing"
)

// The keys warmBisect loads are every key the next bisectLevels steps of
// walk's bisection can read, whichever way each step goes.
func TestBisectKeysCoverEveryPath(t *testing.T) {
	for _, span := range [][2]int{{0, 9}, {0, 17}, {3, 40}, {8, 264}, {100, 1100}, {0, 4096}} {
		var pos [warmBatch]int
		got := pos[:bisectKeys(span[0], span[1], walkStride, &pos)]
		for path := range 1 << bisectLevels {
			lo, hi := span[0], span[1]
			for step := range bisectLevels {
				if hi-lo <= walkStride {
					break
				}
				mid := lo + (hi-lo)/2
				if !slices.Contains(got, mid) {
					t.Fatalf("span %v, path %04b: step %d reads %d, not among the warmed %v", span, path, step, mid, got)
				}
				if path>>step&1 == 0 {
					lo = mid
				} else {
					hi = mid
				}
			}
		}
	}
}
