package scheduler

import (
	"fmt"
	"strconv"
	"strings"
)

// SGLang started with --dp-size N (and --enable-dp-attention, for each
// rank to publish its events on its own port) is the same: its ranks
// stamp their events attn_dp_rank, label their metrics dp_rank="<rank>"
// and take the same header.

// A vLLM engine started with --data-parallel-size N runs N engines, each
// with its own KV cache, behind one OpenAI server: each publishes its KV
// events on the configured port plus its rank (vLLM's
// ZmqEventPublisher.offset_endpoint_port), labels its metrics
// engine="<rank>", and serves the requests sent to it with the
// X-data-parallel-rank header. baton routes to each rank as a worker of
// its own, so that the index, the load and kv_aware's estimates are per
// KV cache.

// maxDataParallelSize bounds data_parallel_size.
const maxDataParallelSize = 512

// ranks returns the workers baton routes to for wc: wc itself, or, for an
// engine with DataParallelSize N > 1, one per rank r, named <name>/dp<r>,
// sent its requests with X-data-parallel-rank r and subscribed to its
// rank's events.
func (wc WorkerConfig) ranks() []WorkerConfig {
	if wc.DataParallelSize <= 1 {
		return []WorkerConfig{wc}
	}
	out := make([]WorkerConfig, wc.DataParallelSize)
	for r := range out {
		rc := wc
		rc.Name = wc.Name + rankSuffix + strconv.Itoa(r)
		rc.rank = r
		rc.Events, _ = offsetPort(wc.Events, r)
		rc.EventsReplay, _ = offsetPort(wc.EventsReplay, r)
		out[r] = rc
	}
	return out
}

// rankSuffix precedes the rank in a rank's worker name.
const rankSuffix = "/dp"

// dpRank returns the rank a worker of ranks routes to: 0 for an engine
// of one rank. It is kept beside the name, never parsed back out of it,
// so that any name an operator chooses is a valid one.
func (wc WorkerConfig) dpRank() int { return wc.rank }

// dpTarget returns the rank and the ranks of a rank's worker, as its
// engine's client takes them (0, 0: an engine of one rank).
func (wc WorkerConfig) dpTarget() (rank, size int) {
	if wc.DataParallelSize <= 1 {
		return 0, 0
	}
	return wc.dpRank(), wc.DataParallelSize
}

// offsetPort returns a tcp:// endpoint with its port plus r, as vLLM's
// rank r binds or connects it; "" stays "".
func offsetPort(endpoint string, r int) (string, error) {
	if endpoint == "" || r == 0 {
		return endpoint, nil
	}
	i := strings.LastIndexByte(endpoint, ':')
	if !strings.HasPrefix(endpoint, "tcp://") || i < len("tcp://") {
		return "", fmt.Errorf("a tcp:// endpoint with a port, got %q", endpoint)
	}
	port, err := strconv.Atoi(endpoint[i+1:])
	if err != nil || port < 1 || port+r > 65535 {
		return "", fmt.Errorf("a port that rank %d's, plus %d, keeps in 1–65535, got %q", r, r, endpoint)
	}
	return endpoint[:i+1] + strconv.Itoa(port+r), nil
}

// validateRanks reports what is wrong with w's data_parallel_size,
// prefixed with field. w may be discovery's template: each endpoint
// discovered is then an engine of that many ranks.
func validateRanks(w WorkerConfig, field string) error {
	kind := kindOfWorker(w)
	n := w.DataParallelSize
	switch {
	case n == 0 || n == 1:
		return nil
	case n < 0 || n > maxDataParallelSize:
		return fmt.Errorf("%s.data_parallel_size: must be 1–%d, got %d", field, maxDataParallelSize, n)
	case !kind.DataParallel:
		return fmt.Errorf("%s.data_parallel_size: only %s workers have it (kind is %s)", field, kindList("and", dataParallel), w.Kind)
	case kind.DataParallelColocated && w.Role != "" && w.Role != RoleBoth:
		// Its decode ranks would need the prefill rank's index
		// (disagg_prefill_dp_rank), which baton does not send.
		return fmt.Errorf("%s.data_parallel_size: %s ranks serve colocated only (role is %s)", field, w.Kind, w.Role)
	}
	for _, e := range []struct{ name, endpoint string }{{"events", w.Events}, {"events_replay", w.EventsReplay}} {
		if _, err := offsetPort(e.endpoint, n-1); err != nil {
			return fmt.Errorf("%s.%s: with data_parallel_size %d, each rank publishes on the port plus its rank: %v", field, e.name, n, err)
		}
	}
	return nil
}
