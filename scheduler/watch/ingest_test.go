package watch_test

import (
	"fmt"
	"testing"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

// BenchmarkIngest is what following an engine's KV events costs a
// scheduler per block, from the message's bytes to the index: decoding the
// batch, translating it (baton's keys from the token ids) and applying it.
// Each batch stores a fresh prompt of 32 blocks of 16 tokens on one of W
// engines in turn and removes that engine's 32 oldest blocks once its
// cache of 1,024 blocks is full, as a busy vLLM engine publishes them.
// ns/block is the cost of one block event, stored or removed.
func BenchmarkIngest(b *testing.B) {
	const (
		blockSize    = 16
		promptBlocks = 32
		cacheBlocks  = 1024
	)
	for _, enc := range []struct {
		name string
		enc  kveventstest.Encoding
	}{{"tagged-maps", kveventstest.TaggedMaps}, {"array-like", kveventstest.ArrayLike}} {
		for _, workers := range []int{8, 1000} {
			b.Run(fmt.Sprintf("%s/workers=%d", enc.name, workers), func(b *testing.B) {
				x := kvindex.New(kvindex.Config{MaxBlocks: workers * cacheBlocks})
				trs := make([]*watch.Translator, workers)
				names := make([]string, workers)
				for i := range workers {
					names[i] = fmt.Sprintf("engine-%d", i)
					if err := x.AddWorker(names[i]); err != nil {
						b.Fatal(err)
					}
					trs[i] = watch.NewTranslator(watch.TranslatorConfig{Model: "m"})
				}
				// Payloads for a few rounds of the fleet, encoded once: the
				// benchmark replays them with fresh hashes' order kept.
				const rounds = 48 // 48 × 32 > 1,024: caches fill, then churn
				payloads := make([][]byte, 0, rounds*min(workers, 64))
				engineOf := make([]int, 0, cap(payloads))
				var next uint64 = 1
				held := make([][]uint64, workers)
				for r := range rounds {
					for w := range min(workers, 64) {
						var evs []kvevents.Event
						if len(held[w]) >= cacheBlocks {
							rm := &kvevents.BlockRemoved{Medium: "GPU"}
							for _, h := range held[w][:promptBlocks] {
								rm.BlockHashes = append(rm.BlockHashes, kvevents.IntHash(h))
							}
							held[w] = held[w][promptBlocks:]
							evs = append(evs, rm)
						}
						st := &kvevents.BlockStored{BlockSize: blockSize, Medium: "GPU",
							TokenIDs: kveventstest.TokenRun(int(next*blockSize), promptBlocks*blockSize)}
						for range promptBlocks {
							st.BlockHashes = append(st.BlockHashes, kvevents.IntHash(next))
							held[w] = append(held[w], next)
							next++
						}
						evs = append(evs, st)
						p, err := kveventstest.Encode(kvevents.Batch{TS: float64(r), Events: evs}, enc.enc)
						if err != nil {
							b.Fatal(err)
						}
						payloads = append(payloads, p)
						engineOf = append(engineOf, w)
					}
				}
				blocks := 0
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; b.Loop(); i++ {
					k := i % len(payloads)
					// Engines beyond the first 64 replay their payloads: each
					// of the W engines takes its turn.
					w := engineOf[k] + 64*((i/len(payloads))%max(1, workers/64))
					if w >= workers {
						w = engineOf[k]
					}
					batch, err := kvevents.Decode(payloads[k])
					if err != nil {
						b.Fatal(err)
					}
					for _, ev := range batch.Events {
						switch ev := ev.(type) {
						case *kvevents.BlockStored:
							blocks += len(ev.BlockHashes)
						case *kvevents.BlockRemoved:
							blocks += len(ev.BlockHashes)
						}
					}
					for _, ev := range trs[w].Translate(batch) {
						if err := x.Apply(names[w], ev); err != nil {
							b.Fatal(err)
						}
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(blocks), "ns/block")
			})
		}
	}
}
