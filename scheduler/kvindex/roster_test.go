package kvindex

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// A roster's visit hands the visitor what Visit does for the same
// workers, in the order at names them: over several groups, with
// workers never indexed, and after workers join the index, leave it and
// a new one takes a freed slot.
func TestRosterVisitIsVisit(t *testing.T) {
	now := time.Unix(1000, 0)
	x := New(Config{Now: func() time.Time { return now }})
	names := make([]string, 3*MaxWorkers)
	index := func(i int) {
		ks := keys(0, uint64(i%40+3))
		mustApply(t, x, names[i], snapshot(&Load{Running: i}, stored(gpu, ks[:i%40+1]), stored(cpu, ks[i%40+1:])))
		if err := x.SetInfo(names[i], Info{BlockTokens: 16 + i%3, RedisTier: i%2 == 0}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range names {
		names[i] = fmt.Sprintf("w%03d", i)
		if i%7 != 3 { // the others are indexed later
			index(i)
		}
	}
	mustApply(t, x, names[0], event(2, stored(redis, keys(0, 50))))
	x.Predict(names[100], keys(0, 45))
	r := x.Roster(names)
	rng := rand.New(rand.NewPCG(1, 2))
	check := func(when string) {
		t.Helper()
		at := rng.Perm(len(names))[:len(names)-20]
		order := make([]string, len(at))
		for i, j := range at {
			order[i] = names[j]
		}
		for _, prompt := range [][]uint64{nil, keys(0, 50), keys(1000, 1010)} {
			var want, got visits
			x.Visit(prompt, order, &want)
			r.Visit(prompt, at, &got)
			if d := cmp.Diff([]Match(want), []Match(got)); d != "" {
				t.Errorf("%s, prompt of %d keys: the roster's visit differs from Visit (-Visit +roster):\n%s", when, len(prompt), d)
			}
		}
	}
	check("first visit")
	check("second visit")
	for i := 3; i < len(names); i += 7 {
		index(i)
	}
	check("after workers joined")
	x.RemoveWorker(names[5])
	x.RemoveWorker(names[70])
	check("after workers left")
	extra := "x-new"
	mustApply(t, x, extra, snapshot(&Load{Running: 99}, stored(gpu, keys(0, 10))))
	index(5)
	check("after a worker took a freed slot and another came back")
}
