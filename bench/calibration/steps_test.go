package calibration

import (
	"slices"
	"testing"
	"time"
)

// stepped is a stream whose chunks arrive every step from its first,
// carrying perChunk tokens each.
func stepped(start time.Time, first, chunks, perChunk int, step time.Duration) sample {
	s := sample{tokens: chunks * perChunk, prompt: 100}
	for i := range chunks {
		s.at = append(s.at, start.Add(time.Duration(first+i)*step))
	}
	s.firstAt, s.last = s.at[0], s.at[len(s.at)-1]
	return s
}

// Only the gaps while every stream decodes count: from the last stream's
// first chunk to the first stream's last.
func TestInStep(t *testing.T) {
	t0 := time.Unix(0, 0)
	gaps, tokens := inStep([]sample{
		stepped(t0, 0, 10, 1, time.Millisecond), // chunks at 0..9 ms
		stepped(t0, 3, 10, 1, time.Millisecond), // 3..12 ms
	})
	// Window 3..9 ms: six gaps in each stream.
	if got, want := len(gaps), 12; got != want {
		t.Errorf("%d gaps, want %d", got, want)
	}
	if i := slices.IndexFunc(gaps, func(g time.Duration) bool { return g != time.Millisecond }); i >= 0 {
		t.Errorf("gap %v, want every gap 1ms", gaps[i])
	}
	if tokens != 200 {
		t.Errorf("prompt tokens %d, want 200", tokens)
	}
}

func TestTokensPerChunk(t *testing.T) {
	t0 := time.Unix(0, 0)
	late := stepped(t0, 0, 30, 1, time.Millisecond)
	late.tokens += 2 // two chunks of 30 carried two tokens
	for _, tc := range []struct {
		name string
		out  []sample
		want int
	}{
		{"one token a chunk", []sample{stepped(t0, 0, 30, 1, time.Millisecond)}, 1},
		{"a reader late twice", []sample{late}, 1},
		{"four tokens a chunk", []sample{stepped(t0, 0, 30, 4, time.Millisecond), stepped(t0, 0, 8, 4, time.Millisecond)}, 4},
		{"one chunk", []sample{stepped(t0, 0, 1, 32, time.Millisecond)}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tokensPerChunk(tc.out); got != tc.want {
				t.Errorf("tokensPerChunk = %d, want %d", got, tc.want)
			}
		})
	}
}
