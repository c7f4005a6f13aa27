package kvindex

import "sync/atomic"

// A Roster is a list of workers whose places in an index are found once,
// by name, for every visit of some of them (Visit) until the index's
// membership changes, rather than on each visit: a caller that visits
// the workers of the same list request after request, such as a pool
// snapshot's, keeps a Roster of them. It is safe for concurrent use.
type Roster struct {
	x     *Index
	names []string
	cur   atomic.Pointer[rosterPlaces]
}

// rosterPlaces are a roster's workers' places, by position, as of the
// index's membership generation gen (workers.gen).
type rosterPlaces struct {
	gen    uint64
	places []place
}

// Roster returns a roster of the named workers, which may be tracked or
// not, and may join or leave the index later. It keeps names, which the
// caller must not change.
func (x *Index) Roster(names []string) *Roster {
	return &Roster{x: x, names: names}
}

// Len returns the number of the roster's workers.
func (r *Roster) Len() int { return len(r.names) }

// Visit is Index.Visit over the roster's workers at[0], at[1]…: it hands
// v, for each i in order, the match of the worker at position at[i] of
// the roster's names. It allocates only on the first visit after the
// index's membership changed (a worker tracked or removed), which finds
// the roster's places again.
func (r *Roster) Visit(keys []uint64, at []int, v MatchVisitor) {
	x := r.x
	now := x.cfg.Now().UnixNano()
	x.workers.mu.RLock()
	defer x.workers.mu.RUnlock()
	rp := r.cur.Load()
	if rp == nil || rp.gen != x.workers.gen {
		rp = r.find()
		r.cur.Store(rp)
	}
	ls := lookupScratchPool.Get().(*lookupScratch) // put back only if all went well: see lookupScratch
	found := ls.places(len(at))
	for i, j := range at {
		found[i] = rp.places[j]
	}
	x.visitPlaces(ls, keys, found, now, nil, v)
}

// find returns the places of r's workers now. workers.mu is held for
// reading.
func (r *Roster) find() *rosterPlaces {
	ws := &r.x.workers
	rp := &rosterPlaces{gen: ws.gen, places: make([]place, len(r.names))}
	for i, name := range r.names {
		rp.places[i] = noPlace
		if w := ws.get(name); w != nil {
			rp.places[i] = w.at()
		}
	}
	return rp
}
