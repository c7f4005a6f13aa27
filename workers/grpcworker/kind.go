package grpcworker

import "github.com/batonllm/baton/workers/engine"

// Kind is a baton worker (baton worker) driven over the worker gRPC API:
// it reports its cache, cost and role itself, loads adapters on demand
// and hands KV blocks through baton's transfer service.
var Kind = engine.Kind{
	Name: "grpc", PD: engine.PDBaton, SelfReported: true, DescribesRole: true, LoadsAdapters: true,
	Connect: func(t engine.Target) (engine.Client, error) {
		var opts []Option
		if t.Credentials != nil {
			opts = append(opts, WithTransportCredentials(t.Credentials))
		}
		c, err := Dial(t.Address, opts...)
		if err != nil {
			return nil, err
		}
		return c, nil
	},
}
