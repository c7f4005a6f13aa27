package routing

import "github.com/batonllm/baton/scheduler/pool"

// adapterFilter keeps, for a request naming a LoRA adapter
// (Request.Adapter), the workers that hold it; every worker for other
// requests. With load set (kv_aware, which counts the load in its
// estimate) and Request.LoadAdapter, it also keeps the workers the
// adapter could be loaded onto. Loading it is the front end's part: the
// filter only reads what the workers hold.
type adapterFilter struct{ load bool }

func (adapterFilter) Name() string { return "adapter" }

func (f adapterFilter) Keep(req *Request, w *pool.Worker) bool {
	return req.Adapter == "" || w.HoldsAdapter(req.Adapter) ||
		f.load && req.LoadAdapter && w.AdapterSlots() > 0 && w.CanTakeAdapter(req.Adapter)
}

func (f adapterFilter) keepAt(req *Request, s *pool.Snapshot, keep []bool) {
	if req.Adapter == "" {
		return
	}
	for i, ok := range keep {
		if ok && !f.Keep(req, s.Workers[i]) {
			keep[i] = false
		}
	}
}

// adapterOptions are the adapter filter's options in a profile.
type adapterOptions struct {
	// Load also keeps, for a request that may load its adapter
	// (Request.LoadAdapter), the workers it could be loaded onto, as
	// kv_aware does; for profiles whose scorers count the load.
	Load bool `yaml:"load"`
}

func newAdapterFilter(o adapterOptions, _ Params, _ Deps) (Filter, error) {
	return adapterFilter{load: o.Load}, nil
}

// adapterPart is the adapter filter a profile that lists none gets.
var adapterPart = newPart(newAdapterFilter)

var (
	_ Filter   = adapterFilter{}
	_ filterAt = adapterFilter{}
)
