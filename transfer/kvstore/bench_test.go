package kvstore_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

// BenchmarkRedisGet fetches blocksPerCall blocks per call from a local
// redis-server: through kvstore.Redis.Get (tier: pipelined GETs, header
// and block verification), and with a raw go-redis client on the same
// values (raw: pipelined GETs and Bytes, no verification; raw-mget: one
// MGET, whose string replies need a copy to become []byte).
func BenchmarkRedisGet(b *testing.B) {
	const blocksPerCall = 32
	srv := redistest.Start(b)
	tier, err := kvstore.NewRedis(kvstore.RedisConfig{Addr: srv.Addr()})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { tier.Close() })
	client := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	b.Cleanup(func() { client.Close() })
	ctx := context.Background()

	for _, size := range []int{64 << 10, 1 << 20} {
		ns := transfer.Namespace{Model: "bench", Salt: uint64(size)}
		keys := make([]uint64, blocksPerCall)
		names := make([]string, blocksPerCall)
		for i := range keys {
			keys[i] = uint64(i + 1)
			names[i] = transfer.StoreKey(ns, keys[i])
		}
		if err := tier.Put(ctx, ns, blocks(size, keys...)); err != nil {
			b.Fatal(err)
		}
		label := fmt.Sprintf("block=%dKiB", size>>10)

		b.Run("tier/"+label, func(b *testing.B) {
			b.SetBytes(int64(blocksPerCall * size))
			b.ReportAllocs()
			for b.Loop() {
				data, err := tier.Get(ctx, ns, keys, size)
				if err != nil {
					b.Fatal(err)
				}
				if data[blocksPerCall-1] == nil {
					b.Fatal("block missing")
				}
			}
		})
		b.Run("raw/"+label, func(b *testing.B) {
			b.SetBytes(int64(blocksPerCall * size))
			b.ReportAllocs()
			cmds := make([]*redis.StringCmd, blocksPerCall)
			for b.Loop() {
				pipe := client.Pipeline()
				for i, name := range names {
					cmds[i] = pipe.Get(ctx, name)
				}
				if _, err := pipe.Exec(ctx); err != nil {
					b.Fatal(err)
				}
				for _, cmd := range cmds {
					if v, err := cmd.Bytes(); err != nil || len(v) < size {
						b.Fatalf("GET: %d bytes, %v", len(v), err)
					}
				}
			}
		})
		b.Run("raw-mget/"+label, func(b *testing.B) {
			b.SetBytes(int64(blocksPerCall * size))
			b.ReportAllocs()
			data := make([][]byte, blocksPerCall)
			for b.Loop() {
				vals, err := client.MGet(ctx, names...).Result()
				if err != nil {
					b.Fatal(err)
				}
				for i, v := range vals {
					s, _ := v.(string)
					if data[i] = []byte(s); len(data[i]) < size {
						b.Fatalf("MGET: %d bytes", len(data[i]))
					}
				}
			}
		})
	}
}
