//go:build !race

package vsim

const raceEnabled = false
