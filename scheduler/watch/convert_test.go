package watch

import (
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/scheduler/kvindex"
)

func TestFromProto(t *testing.T) {
	ks := []uint64{1, 2, 3}
	tests := []struct {
		name string
		in   *workerpb.WatchEvent
		want kvindex.Event
	}{
		{"snapshot", &workerpb.WatchEvent{Seq: 1, Event: &workerpb.WatchEvent_Snapshot{Snapshot: &workerpb.Snapshot{
			Load: &workerpb.LoadReport{Running: 2, Waiting: 1, WaitingPrefillTokens: 300, GpuBlocksUsed: 40, GpuBlocksTotal: 100, CpuBlocksUsed: 5, CpuBlocksTotal: 50},
			Blocks: []*workerpb.CacheEvent{
				{Kind: workerpb.CacheEvent_KIND_STORED, Tier: workerpb.Tier_TIER_GPU, Keys: ks},
				{Kind: workerpb.CacheEvent_KIND_STORED, Tier: workerpb.Tier_TIER_CPU, Keys: ks[:1]},
			}}}},
			kvindex.Event{Seq: 1, Snapshot: &kvindex.Snapshot{
				Load: kvindex.Load{Running: 2, Waiting: 1, WaitingPrefillTokens: 300, GPUBlocksUsed: 40, GPUBlocksTotal: 100, CPUBlocksUsed: 5, CPUBlocksTotal: 50},
				Blocks: []kvindex.CacheEvent{
					{Kind: kvindex.Stored, Tier: kvindex.TierGPU, Keys: ks},
					{Kind: kvindex.Stored, Tier: kvindex.TierCPU, Keys: ks[:1]},
				}}}},
		{"load", &workerpb.WatchEvent{Seq: 7, Event: &workerpb.WatchEvent_Load{Load: &workerpb.LoadReport{Running: 3}}},
			kvindex.Event{Seq: 7, Load: &kvindex.Load{Running: 3}}},
		{"stored, tier unspecified", &workerpb.WatchEvent{Seq: 8, Event: &workerpb.WatchEvent_Cache{Cache: &workerpb.CacheEvent{
			Kind: workerpb.CacheEvent_KIND_STORED, Keys: ks}}},
			kvindex.Event{Seq: 8, Cache: &kvindex.CacheEvent{Kind: kvindex.Stored, Tier: kvindex.TierGPU, Keys: ks}}},
		{"removed from redis", &workerpb.WatchEvent{Seq: 9, Event: &workerpb.WatchEvent_Cache{Cache: &workerpb.CacheEvent{
			Kind: workerpb.CacheEvent_KIND_REMOVED, Tier: workerpb.Tier_TIER_REDIS, Keys: ks}}},
			kvindex.Event{Seq: 9, Cache: &kvindex.CacheEvent{Kind: kvindex.Removed, Tier: kvindex.TierRedis, Keys: ks}}},
		{"moved", &workerpb.WatchEvent{Seq: 10, Event: &workerpb.WatchEvent_Cache{Cache: &workerpb.CacheEvent{
			Kind: workerpb.CacheEvent_KIND_TIER_CHANGED, Tier: workerpb.Tier_TIER_CPU, FromTier: workerpb.Tier_TIER_GPU, Keys: ks}}},
			kvindex.Event{Seq: 10, Cache: &kvindex.CacheEvent{Kind: kvindex.Moved, Tier: kvindex.TierCPU, From: kvindex.TierGPU, HasFrom: true, Keys: ks}}},
		{"moved, from unspecified", &workerpb.WatchEvent{Seq: 11, Event: &workerpb.WatchEvent_Cache{Cache: &workerpb.CacheEvent{
			Kind: workerpb.CacheEvent_KIND_TIER_CHANGED, Tier: workerpb.Tier_TIER_CPU, Keys: ks}}},
			kvindex.Event{Seq: 11, Cache: &kvindex.CacheEvent{Kind: kvindex.Moved, Tier: kvindex.TierCPU, Keys: ks}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, FromProto(tt.in)); diff != "" {
				t.Errorf("FromProto (-want +got):\n%s", diff)
			}
		})
	}
}

func TestInfoFromProto(t *testing.T) {
	got := InfoFromProto(&workerpb.InfoResponse{BlockChars: 128, RedisTier: true, Cost: &workerpb.CostParams{Layers: 80}})
	want := kvindex.DefaultCost
	want.Layers = 80
	if got.BlockTokens != 32 || !got.RedisTier || !got.HasCost || got.Cost != want {
		t.Errorf("InfoFromProto = %+v, want 32 block tokens, the Redis tier and 80 layers over the default cost", got)
	}
	if got := InfoFromProto(&workerpb.InfoResponse{}); got.BlockTokens != 0 || got.HasCost || got.Cost != kvindex.DefaultCost {
		t.Errorf("InfoFromProto of an empty Info = %+v, want defaults", got)
	}
}
