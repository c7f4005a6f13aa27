package main

import (
	"strconv"
	"strings"
	"testing"
)

// TestDecodeKillTransferSmoke runs decode-kill-transfer on a real fleet
// with short windows: the run fails unless a push to d0 was held and cut
// by the kill, and unless the prefill workers' breakers stayed shut; every
// request ends with a completion, or, for a stream d0 was already
// decoding, the documented error event: no 503, no hang, no truncation.
func TestDecodeKillTransferSmoke(t *testing.T) {
	rows, report := smoke(t, "decode-kill-transfer")
	row := rows["decode-kill-transfer"]
	for i, col := range map[int]string{5: "429", 6: "503", 8: "truncated", 9: "hangs", 10: "other"} {
		if row[i] != "0" {
			t.Errorf("%s: got %s, want 0\n%s", col, row[i], report)
		}
	}
	n := func(i int) int {
		v, err := strconv.Atoi(row[i])
		if err != nil {
			t.Fatalf("column %d: %q", i, row[i])
		}
		return v
	}
	if sent, ok, events := n(2), n(3), n(7); sent == 0 || ok+events != sent {
		t.Errorf("sent %d, ok %d, error events %d: want every request ok or ended by an error event\n%s", sent, ok, events, report)
	}
	if !strings.Contains(row[1], "p0 →open 0, p1 →open 0") {
		t.Errorf("a prefill worker's breaker opened:\n%s", report)
	}
}
