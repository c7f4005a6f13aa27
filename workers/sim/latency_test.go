package sim

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/workers/engine"
)

// oneTokenPaths sends one-token requests to one worker by three paths:
// the engine in process, the worker's gRPC API and its own OpenAI HTTP
// endpoint (streamed, read to data: [DONE]), each over one kept-alive
// connection.
type oneTokenPaths struct {
	w    *Worker
	grpc workerpb.WorkerClient
	hc   *http.Client
	url  string
}

func startOneTokenPaths(tb testing.TB, cfg Config) *oneTokenPaths {
	tb.Helper()
	w, err := Start(cfg, "127.0.0.1:0", "127.0.0.1:0", nil)
	if err != nil {
		tb.Fatal(err)
	}
	conn, err := grpc.NewClient(w.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		w.Close()
		tb.Fatal(err)
	}
	tr := &http.Transport{DisableCompression: true}
	tb.Cleanup(func() {
		tr.CloseIdleConnections()
		conn.Close()
		w.Close()
	})
	return &oneTokenPaths{w: w, grpc: workerpb.NewWorkerClient(conn), hc: &http.Client{Transport: tr},
		url: "http://" + w.HTTPAddr + "/v1/chat/completions"}
}

// The paths, in the order a round first sends them.
const (
	pathEngine = "engine"
	pathGRPC   = "grpc"
	pathHTTP   = "http"
)

var oneTokenPathNames = []string{pathEngine, pathGRPC, pathHTTP}

// send times one request with prompt down path, to its last event.
func (p *oneTokenPaths) send(path, prompt string) (time.Duration, error) {
	ctx := context.Background()
	start := time.Now()
	switch path {
	case pathEngine:
		st, err := p.w.Engine.Generate(ctx, &engine.Request{Model: testModel, Prompt: prompt, MaxTokens: 1})
		if err != nil {
			return 0, err
		}
		defer st.Close()
		for {
			if _, err := st.Recv(); errors.Is(err, io.EOF) {
				return time.Since(start), nil
			} else if err != nil {
				return 0, err
			}
		}
	case pathGRPC:
		st, err := p.grpc.Generate(ctx, &workerpb.GenerateRequest{Model: testModel, Prompt: prompt, MaxTokens: 1})
		if err != nil {
			return 0, err
		}
		for {
			if _, err := st.Recv(); errors.Is(err, io.EOF) {
				return time.Since(start), nil
			} else if err != nil {
				return 0, err
			}
		}
	}
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}],"max_tokens":1,"stream":true}`, testModel, prompt)
	resp, err := p.hc.Post(p.url, "application/json", strings.NewReader(body))
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("status %d", resp.StatusCode)
	}
	br := bufio.NewReader(resp.Body)
	for {
		line, err := br.ReadSlice('\n')
		if bytes.HasPrefix(line, []byte("data: [DONE]")) {
			d := time.Since(start)
			_, err := io.Copy(io.Discard, br)
			return d, err
		}
		if err != nil {
			return 0, fmt.Errorf("stream ended before [DONE]: %w", err)
		}
	}
}

// round sends one request down every path, the first path rotating with
// i, and adds each one's time to times.
func (p *oneTokenPaths) round(i int, times map[string][]time.Duration) error {
	prompt := fmt.Sprintf("Round %d: say one word about timers.", i)
	for j := range oneTokenPathNames {
		path := oneTokenPathNames[(i+j)%len(oneTokenPathNames)]
		d, err := p.send(path, prompt+" "+path)
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
		times[path] = append(times[path], d)
	}
	return nil
}

// A one-token answer takes one step: from Generate to the end of its
// stream, never less than the step's modelled time. How little more it
// takes (not a runtime timer's millisecond) is logged here and measured
// by BenchmarkOneTokenPaths: a loaded machine may delay any request.
func TestOneTokenStepOnTime(t *testing.T) {
	e := newEngine(t, Config{TimeScale: 20}) // a step of about 300 µs
	least := time.Hour
	for i := range 20 {
		before := e.Stats()
		start := time.Now()
		generate(t, e, &engine.Request{Prompt: fmt.Sprintf("Request %d: one word.", i), MaxTokens: 1})
		took := time.Since(start)
		// The step's statistics are recorded after its events are sent.
		waitFor(t, "the step to be counted", func() bool { return e.Stats().Steps != before.Steps })
		after := e.Stats()
		if after.Steps != before.Steps+1 {
			t.Fatalf("%d steps, want 1", after.Steps-before.Steps)
		}
		step := time.Duration((after.ModelledSeconds - before.ModelledSeconds) / 20 * float64(time.Second))
		if took < step {
			t.Errorf("request %d took %v, less than its step's %v", i, took, step)
		}
		least = min(least, took-step)
	}
	t.Logf("a one-token answer took at best %v more than its step", least)
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkOneTokenPaths times a one-token answer from one worker by its
// three paths side by side, at time scales whose modelled step (about
// 6 ms for the default preset) lasts from nanoseconds to 600 µs of real
// time. It reports each path's median and the mean step's modelled time
// in real time; ns/op is one round of the three.
func BenchmarkOneTokenPaths(b *testing.B) {
	for _, scale := range []float64{1e6, 1e4, 1e3, 100, 10} {
		b.Run(fmt.Sprintf("timescale=%g", scale), func(b *testing.B) {
			p := startOneTokenPaths(b, Config{TimeScale: scale})
			times := map[string][]time.Duration{}
			for i := range 20 { // warm the connections
				if err := p.round(i, times); err != nil {
					b.Fatal(err)
				}
			}
			clear(times)
			before := p.w.Engine.Stats()
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				if err := p.round(i, times); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			for _, path := range oneTokenPathNames {
				b.ReportMetric(float64(median(times[path]))/1e3, path+"-p50-µs")
			}
			after := p.w.Engine.Stats()
			step := (after.ModelledSeconds - before.ModelledSeconds) / float64(after.Steps-before.Steps) / scale
			b.ReportMetric(step*1e6, "step-µs")
		})
	}
}
