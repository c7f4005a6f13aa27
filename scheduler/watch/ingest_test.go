package watch_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/workers/vllm"
	"github.com/batonllm/baton/workers/vllm/kvevents"
	"github.com/batonllm/baton/workers/vllm/kvevents/kveventstest"
)

// BenchmarkIngest is what following an engine's KV events costs a
// scheduler per block, from the message's bytes to the index: decoding the
// batch (into a reused Decoder's memory, as subscribers do), translating
// it (baton's keys from the token ids) and applying it. Each batch stores
// a fresh prompt of 32 blocks of 16 tokens on one of W engines in turn and
// removes that engine's 32 oldest blocks once its cache of 1,024 blocks is
// full, as a busy vLLM engine publishes them. ns/block is the cost of one
// block event, stored or removed.
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
				c := newChurn(workers, blockSize, promptBlocks, cacheBlocks)
				for r := range rounds {
					for w := range min(workers, 64) {
						p, err := kveventstest.Encode(kvevents.Batch{TS: float64(r), Events: c.batch(w)}, enc.enc)
						if err != nil {
							b.Fatal(err)
						}
						payloads = append(payloads, p)
						engineOf = append(engineOf, w)
					}
				}
				blocks := 0
				var dec kvevents.Decoder // as subscribers decode, into reused memory
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
					batch, err := dec.Decode(payloads[k])
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

// ingestPublisherEnv, when set in a test binary's environment, makes
// TestIngestPublisher the publishing engines of BenchmarkIngestZMQ: it
// holds "engines encoding".
const ingestPublisherEnv = "BATON_INGEST_PUBLISHER"

// Shape of BenchmarkIngestZMQ's batches: as BenchmarkIngest's, a fresh
// prompt of zmqPromptBlocks blocks on each engine in turn, and the engine's
// oldest blocks removed once its cache of zmqCacheBlocks is full.
const (
	zmqBlockSize    = 16
	zmqPromptBlocks = 32
	zmqCacheBlocks  = 1024
)

// zmqBlocks returns the block events of an engine's first n batches.
func zmqBlocks(n int) int {
	full := zmqCacheBlocks / zmqPromptBlocks // batches before removals start
	return n*zmqPromptBlocks + max(0, n-full)*zmqPromptBlocks
}

// BenchmarkIngestZMQ is what following W engines' KV events costs a
// scheduler per block event as baton serve follows them: each engine's
// subscriber (a zmq4 SUB socket over loopback) receives and decodes its
// batches, and the watcher's engine goroutine translates and applies them
// to the index. The engines are zmq4 PUB sockets in a child process (this
// test binary, as TestIngestPublisher), so that the figures are this
// process's alone: cpu-ns/block is its CPU time (getrusage, every
// goroutine) per block event, allocs/block its allocations.
func BenchmarkIngestZMQ(b *testing.B) {
	for _, enc := range []kveventstest.Encoding{kveventstest.TaggedMaps, kveventstest.ArrayLike} {
		for _, engines := range []int{8, 1000} {
			b.Run(fmt.Sprintf("%s/workers=%d", enc, engines), func(b *testing.B) {
				benchIngestZMQ(b, enc, engines)
			})
		}
	}
}

func benchIngestZMQ(b *testing.B, enc kveventstest.Encoding, engines int) {
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestIngestPublisher$")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d %d", ingestPublisherEnv, engines, enc))
	cmd.Stderr = os.Stderr
	grants, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		grants.Close()
		_ = cmd.Wait()
	})
	lines := bufio.NewScanner(stdout)
	line := func() string {
		if !lines.Scan() {
			b.Fatalf("publisher process: %v", lines.Err())
		}
		return lines.Text()
	}

	idx := kvindex.New(kvindex.Config{MaxBlocks: engines * zmqCacheBlocks})
	w := watch.New(idx, watch.Config{})
	b.Cleanup(func() { w.Close() })
	metrics := &fakeMetrics{m: vllm.Metrics{HasLoad: true, BlockSize: zmqBlockSize}}
	for i := range engines {
		err := w.AddEngine(fmt.Sprintf("engine-%d", i), watch.EngineConfig{
			Metrics: metrics, ScrapeInterval: time.Hour, // the first scrape only
			Events: kvevents.SubscriberConfig{Endpoint: line(), Topic: "kv"},
			Model:  func() string { return "m" },
		})
		if err != nil {
			b.Fatal(err)
		}
	}
	if got := line(); got != "subscribed" {
		b.Fatalf("publisher process said %q, want subscribed", got)
	}

	// publish has the publishers send n more batches, engines in turn,
	// at most window ahead of what the index applied, and waits until
	// the index applied them all.
	published := 0
	applied := func() int {
		n := 0
		for _, st := range w.Engines() {
			n += int(st.Translated.Stored + st.Translated.Removed)
		}
		return n
	}
	want := func(batches int) int {
		// The first batches%engines engines published one batch more.
		q, r := batches/engines, batches%engines
		return r*zmqBlocks(q+1) + (engines-r)*zmqBlocks(q)
	}
	// Batches in flight: a few hundred ms of work, so that the polls of
	// w.Engines, every 200 ms, cost the process little.
	const window = 8192
	publish := func(n int) {
		target := published + n
		for {
			got := applied()
			done := published
			for done > 0 && want(done) > got {
				done -= min(done, 64)
			}
			if more := min(target-published, done+window-published); more > 0 {
				fmt.Fprintln(grants, more)
				published += more
			}
			if got >= want(target) {
				return
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	// Every engine's cache full, and churning.
	publish(engines * (zmqCacheBlocks/zmqPromptBlocks + 2))

	blocks0 := applied()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	mallocs0 := ms.Mallocs
	cpu0 := cpuTime()
	b.ResetTimer()
	publish(b.N)
	b.StopTimer()
	cpu := cpuTime() - cpu0
	runtime.ReadMemStats(&ms)
	blocks := applied() - blocks0
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(blocks), "cpu-ns/block")
	b.ReportMetric(float64(ms.Mallocs-mallocs0)/float64(blocks), "allocs/block")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(blocks), "ns/block")
}

// cpuTime returns the process's CPU time so far, user and system.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// TestIngestPublisher is BenchmarkIngestZMQ's engines, in the process the
// benchmark starts: it binds one publisher per engine and prints their
// endpoints, then "subscribed" once each has its subscriber, then
// publishes as many batches as each line of its input says, engines in
// turn, until its input ends. Run otherwise, it skips.
func TestIngestPublisher(t *testing.T) {
	var engines int
	var enc kveventstest.Encoding
	if _, err := fmt.Sscan(os.Getenv(ingestPublisherEnv), &engines, &enc); err != nil {
		t.Skip("BenchmarkIngestZMQ's publisher process only")
	}
	pubs := make([]*kveventstest.Publisher, engines)
	for i := range pubs {
		p, err := kveventstest.NewPublisher(kveventstest.PublisherConfig{
			Endpoint: "tcp://127.0.0.1:0", Topic: "kv", Encoding: enc})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		pubs[i] = p
		fmt.Println(p.Endpoint())
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, p := range pubs {
		if err := p.WaitSubscribed(ctx); err != nil {
			t.Fatal(err)
		}
	}
	fmt.Println("subscribed")

	c := newChurn(engines, zmqBlockSize, zmqPromptBlocks, zmqCacheBlocks)
	e := 0
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		n, err := strconv.Atoi(in.Text())
		if err != nil {
			t.Fatal(err)
		}
		for range n {
			if _, err := pubs[e].Publish(kvevents.Batch{TS: float64(c.next), Events: c.batch(e)}); err != nil {
				t.Fatal(err)
			}
			e = (e + 1) % engines
		}
	}
}

// churn makes the batches of a busy fleet's engines: each batch stores a
// fresh prompt on one engine and, once that engine's cache is full,
// removes its oldest prompt's blocks.
type churn struct {
	blockSize, promptBlocks, cacheBlocks int
	held                                 [][]uint64 // each engine's blocks, oldest first
	next                                 uint64     // the next fresh block hash
}

func newChurn(engines, blockSize, promptBlocks, cacheBlocks int) *churn {
	return &churn{blockSize: blockSize, promptBlocks: promptBlocks, cacheBlocks: cacheBlocks,
		held: make([][]uint64, engines), next: 1}
}

// batch returns engine e's next batch's events.
func (c *churn) batch(e int) []kvevents.Event {
	var evs []kvevents.Event
	if len(c.held[e]) >= c.cacheBlocks {
		rm := &kvevents.BlockRemoved{Medium: "GPU"}
		for _, h := range c.held[e][:c.promptBlocks] {
			rm.BlockHashes = append(rm.BlockHashes, kvevents.IntHash(h))
		}
		c.held[e] = c.held[e][c.promptBlocks:]
		evs = append(evs, rm)
	}
	st := &kvevents.BlockStored{BlockSize: c.blockSize, Medium: "GPU",
		TokenIDs: kveventstest.TokenRun(int(c.next)*c.blockSize, c.promptBlocks*c.blockSize)}
	for range c.promptBlocks {
		st.BlockHashes = append(st.BlockHashes, kvevents.IntHash(c.next))
		c.held[e] = append(c.held[e], c.next)
		c.next++
	}
	return append(evs, st)
}
