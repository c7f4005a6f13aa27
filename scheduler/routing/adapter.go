package routing

import "github.com/batonllm/baton/scheduler/pool"

// adapterFilter keeps, for a request naming a LoRA adapter
// (Request.Adapter), the workers that hold it; every worker for other
// requests. Loading the adapter where none holds it, or where its holders
// are busy, is the front end's part: the filter only reads what the
// workers hold.
type adapterFilter struct{}

func (adapterFilter) Name() string { return "adapter" }

func (adapterFilter) Keep(req *Request, w *pool.Worker) bool {
	return req.Adapter == "" || w.HoldsAdapter(req.Adapter)
}

var _ Filter = adapterFilter{}
