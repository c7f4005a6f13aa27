package bench

import (
	"math"
	"slices"
)

// Percentile returns the p-th percentile (0–100) of xs by linear
// interpolation between closest ranks (the method of numpy's default and
// of Excel's PERCENTILE.INC): rank = p/100 × (n−1). NaN for no samples.
// xs need not be sorted; it is not modified.
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return sortedPercentile(s, p)
}

func sortedPercentile(s []float64, p float64) float64 {
	if len(s) == 0 {
		return math.NaN()
	}
	p = min(max(p, 0), 100)
	r := p / 100 * float64(len(s)-1)
	lo := int(math.Floor(r))
	hi := min(lo+1, len(s)-1)
	return s[lo] + (s[hi]-s[lo])*(r-float64(lo))
}

// Mean returns the mean of xs, NaN for none.
func Mean(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	t := 0.0
	for _, x := range xs {
		t += x
	}
	return t / float64(len(xs))
}

// HitRate is cached / prompt tokens, 0 when no prompt tokens were counted.
func HitRate(cached, prompt int64) float64 {
	if prompt <= 0 {
		return 0
	}
	return float64(cached) / float64(prompt)
}

// Change is the relative change of v against base in percent, as
// SageMaker's table reports it: (v − base) / base × 100. NaN when base is 0.
func Change(v, base float64) float64 {
	if base == 0 || math.IsNaN(base) || math.IsNaN(v) {
		return math.NaN()
	}
	return (v - base) / base * 100
}

// bucketQuantile estimates quantile q (0–1) of a cumulative histogram
// (upper bounds and cumulative counts, the last bound may be +Inf) by
// linear interpolation within the bucket, as Prometheus's
// histogram_quantile does.
func bucketQuantile(q float64, bounds []float64, cum []float64) float64 {
	if len(cum) == 0 || cum[len(cum)-1] == 0 {
		return math.NaN()
	}
	total := cum[len(cum)-1]
	rank := q * total
	for i, c := range cum {
		if c >= rank {
			lo, prev := 0.0, 0.0
			if i > 0 {
				lo, prev = bounds[i-1], cum[i-1]
			}
			hi := bounds[i]
			if math.IsInf(hi, 1) {
				return lo
			}
			if c == prev {
				return hi
			}
			return lo + (hi-lo)*(rank-prev)/(c-prev)
		}
	}
	return bounds[len(bounds)-1]
}
