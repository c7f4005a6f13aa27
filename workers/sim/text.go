package sim

import (
	"strings"

	"github.com/cespare/xxhash/v2"
)

// words are the simulated vocabulary: every word is 4 characters with its
// leading space, so one word is one token at blockkey.CharsPerToken.
var words = [64]string{
	" the", " and", " for", " are", " but", " not", " you", " all",
	" any", " can", " had", " her", " was", " one", " our", " out",
	" day", " get", " has", " him", " his", " how", " man", " new",
	" now", " old", " see", " two", " way", " who", " boy", " did",
	" its", " let", " put", " say", " she", " too", " use", " sky",
	" sea", " sun", " map", " key", " log", " run", " set", " top",
	" red", " big", " end", " far", " few", " got", " low", " own",
	" yes", " yet", " ago", " air", " art", " bed", " box", " car",
}

// Natural completion lengths, in tokens, before an end-of-sequence.
const (
	minNatural = 32
	maxNatural = 255
)

// promptHash is the seed of a prompt's deterministic completion.
func promptHash(prompt string) uint64 { return xxhash.Sum64String(prompt) }

// NaturalLength is the number of tokens the engine generates for prompt
// before stopping on its own (a completion is the shorter of it and
// max_tokens, without stop strings): for bench/vsim, which plays the
// engine on a virtual clock.
func NaturalLength(prompt string) int { return naturalLength(promptHash(prompt)) }

// naturalLength is the number of tokens the model "wants" to generate for
// a prompt of hash h before stopping on its own.
func naturalLength(h uint64) int {
	return minNatural + int(mix(h^0xa0761d6478bd642f)%(maxNatural-minNatural+1))
}

// word returns the token at position i of the completion of a prompt of
// hash h.
func word(h uint64, i int) string {
	return words[mix(h+uint64(i)*0x9e3779b97f4a7c15)%uint64(len(words))]
}

// mix is splitmix64's finalizer.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// stopper holds back generated text that might begin a stop sequence, so
// a stop sequence is never emitted.
type stopper struct {
	stop    []string
	text    strings.Builder // everything generated
	emitted int             // bytes of text already released
}

// add appends generated text and returns the text now safe to release,
// and whether a stop sequence occurred (the released text then ends just
// before it).
func (s *stopper) add(t string) (out string, stopped bool) {
	s.text.WriteString(t)
	if len(s.stop) == 0 {
		out = s.text.String()[s.emitted:]
		s.emitted += len(out)
		return out, false
	}
	pending := s.text.String()[s.emitted:]
	cut := -1
	for _, st := range s.stop {
		if i := strings.Index(pending, st); i >= 0 && (cut < 0 || i < cut) {
			cut = i
		}
	}
	if cut >= 0 {
		s.emitted += cut
		return pending[:cut], true
	}
	// Hold back the longest suffix that is a proper prefix of a stop.
	hold := 0
	for _, st := range s.stop {
		for n := min(len(st)-1, len(pending)); n > hold; n-- {
			if strings.HasSuffix(pending, st[:n]) {
				hold = n
				break
			}
		}
	}
	out = pending[:len(pending)-hold]
	s.emitted += len(out)
	return out, false
}

// flush releases the held-back text at the end of a generation that did
// not stop on a stop sequence.
func (s *stopper) flush() string {
	out := s.text.String()[s.emitted:]
	s.emitted += len(out)
	return out
}
