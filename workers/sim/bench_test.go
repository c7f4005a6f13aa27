package sim

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/batonllm/baton/workers/engine"
)

// benchmarkGenerate runs b.N requests, concurrency at a time, on an engine
// whose modelled clock hardly sleeps, so it measures the step loop's own
// cost per request (32 tokens each over a shared 1,024-character prefix).
func benchmarkGenerate(b *testing.B, concurrency int) {
	e := newEngine(b, Config{TimeScale: 1e9})
	prefix := strings.Repeat("shared system prompt. ", 47)
	reqs := make(chan int)
	var wg sync.WaitGroup
	for range concurrency {
		wg.Go(func() {
			for i := range reqs {
				st, err := e.Generate(context.Background(), &engine.Request{
					Model: testModel, Prompt: fmt.Sprintf("%s user %d", prefix, i%512), MaxTokens: 32,
				})
				if err != nil {
					b.Error(err)
					return
				}
				if _, err := collect(b, st); err != nil {
					b.Error(err)
					return
				}
			}
		})
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		reqs <- i
	}
	close(reqs)
	wg.Wait()
	b.StopTimer()
	s := e.Stats()
	b.ReportMetric(float64(s.Steps)/float64(b.N), "steps/req")
}

func BenchmarkGenerate1(b *testing.B)   { benchmarkGenerate(b, 1) }
func BenchmarkGenerate16(b *testing.B)  { benchmarkGenerate(b, 16) }
func BenchmarkGenerate256(b *testing.B) { benchmarkGenerate(b, 256) }
