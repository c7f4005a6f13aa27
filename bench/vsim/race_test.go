//go:build race

package vsim

// raceEnabled: the race detector is on, and slows the simulation about
// tenfold; the long property tests run a sample of their cases.
const raceEnabled = true
