//go:build race

package routing

import "testing"

// raceEnabled: the race detector is on, and sync.Pool drops items at
// random, so allocation counts mean nothing.
const raceEnabled = true

// skipUnderRace skips a test that counts allocations; make test runs
// those again without the race detector.
func skipUnderRace(t *testing.T) {
	t.Skip("counts allocations: run without -race")
}
