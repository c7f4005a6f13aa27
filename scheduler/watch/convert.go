package watch

import (
	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/workers/engine/cost"
)

// FromProto converts a worker's watch event into the index's own.
func FromProto(ev *workerpb.WatchEvent) kvindex.Event {
	out := kvindex.Event{Seq: ev.GetSeq()}
	switch e := ev.GetEvent().(type) {
	case *workerpb.WatchEvent_Snapshot:
		s := &kvindex.Snapshot{Load: loadFromProto(e.Snapshot.GetLoad())}
		for _, ce := range e.Snapshot.GetBlocks() {
			s.Blocks = append(s.Blocks, cacheFromProto(ce))
		}
		out.Snapshot = s
	case *workerpb.WatchEvent_Load:
		l := loadFromProto(e.Load)
		out.Load = &l
	case *workerpb.WatchEvent_Cache:
		c := cacheFromProto(e.Cache)
		out.Cache = &c
	}
	return out
}

// InfoFromProto converts what a worker's Info tells the index.
func InfoFromProto(info *workerpb.InfoResponse) kvindex.Info {
	out := kvindex.Info{RedisTier: info.GetRedisTier()}
	out.Cost, out.HasCost = cost.FromProto(info.GetCost())
	if bc := info.GetBlockChars(); bc > 0 {
		out.BlockTokens = int(bc+3) / 4 // 4 characters a token
	}
	return out
}

func loadFromProto(l *workerpb.LoadReport) kvindex.Load {
	return kvindex.Load{
		Running:              int(l.GetRunning()),
		Waiting:              int(l.GetWaiting()),
		WaitingPrefillTokens: l.GetWaitingPrefillTokens(),
		GPUBlocksUsed:        l.GetGpuBlocksUsed(),
		GPUBlocksTotal:       l.GetGpuBlocksTotal(),
		CPUBlocksUsed:        l.GetCpuBlocksUsed(),
		CPUBlocksTotal:       l.GetCpuBlocksTotal(),
	}
}

func cacheFromProto(ce *workerpb.CacheEvent) kvindex.CacheEvent {
	out := kvindex.CacheEvent{Keys: ce.GetKeys(), Tier: tierFromProto(ce.GetTier())}
	switch ce.GetKind() {
	case workerpb.CacheEvent_KIND_REMOVED:
		out.Kind = kvindex.Removed
	case workerpb.CacheEvent_KIND_TIER_CHANGED:
		out.Kind = kvindex.Moved
		if f := ce.GetFromTier(); f != workerpb.Tier_TIER_UNSPECIFIED {
			out.From, out.HasFrom = tierFromProto(f), true
		}
	}
	return out
}

// tierFromProto maps a wire tier; unspecified is GPU, as workers that
// predate tiers reported.
func tierFromProto(t workerpb.Tier) kvindex.Tier {
	switch t {
	case workerpb.Tier_TIER_CPU:
		return kvindex.TierCPU
	case workerpb.Tier_TIER_REDIS:
		return kvindex.TierRedis
	}
	return kvindex.TierGPU
}
