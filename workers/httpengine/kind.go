package httpengine

import "github.com/batonllm/baton/workers/engine"

// Kind is any OpenAI-compatible HTTP engine: its responses are relayed
// as they come; it serves colocated only.
var Kind = engine.Kind{Name: "http", URL: true, Connect: Connect(engine.NoPD)}

// Connect returns the Connect of a kind of OpenAI-compatible engine that
// hands KV blocks by pd: the client of one such engine, with its
// data-parallel rank and, for a prefill or decode worker, pd's protocol.
func Connect(pd engine.PD) func(engine.Target) (engine.Client, error) {
	return func(t engine.Target) (engine.Client, error) {
		opts := []Option{WithTLS(t.TLS)}
		if t.DPSize > 1 {
			opts = append(opts, WithDataParallelRank(t.Rank))
		}
		p := Colocated
		if t.Role == engine.RolePrefill || t.Role == engine.RoleDecode {
			switch pd {
			case engine.PDNIXL:
				p = NIXL
			case engine.PDBootstrap:
				p = Bootstrap
			}
		}
		c, err := New(t.Address, append(opts, WithProtocol(p, t.BootstrapHost, t.BootstrapPort))...)
		if err != nil {
			return nil, err
		}
		return c, nil
	}
}
