package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/batonllm/baton/bench/calibration"
	"github.com/batonllm/baton/workers/engine/cost"
)

// calibrateCmd runs baton calibrate: one engine measured, its cost
// figures printed as a worker's cost block.
func calibrateCmd(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("calibrate", "--worker URL [flags]\n\nMeasures an engine's prefill (cold and warm) and decode step through its OpenAI API\nand prints its cost figures as the cost block of its worker's configuration.")
	worker := fs.String("worker", "", "base `URL` of the engine's OpenAI API, as http://10.0.0.7:8000 (required)")
	model := fs.String("model", "", "model to request (default: the first the engine lists)")
	preset := fs.String("preset", cost.DefaultModel, "model preset whose shape (layers, hidden size, KV bytes) the figures assume")
	lengths := fs.String("lengths", "1024,2048,4096", "comma-separated prompt lengths measured, in tokens of about 4 characters")
	repeats := fs.Int("repeats", 3, "prompts measured per length, decode streams, and batches of each kind (the least time to first token and the median step are kept)")
	decode := fs.Int("decode-tokens", 64, "tokens each decode stream generates")
	batch := fs.Int("batch", 8, "streams decoded together for the HBM bandwidth, with long prompts and then short ones (-1: skip)")
	batchCtx := fs.Int("batch-context", 4096, "prompt tokens of each of the long streams")
	maxReq := fs.Int("max-requests", 200, "bound on the requests sent")
	timeout := fs.Duration("timeout", 0, "bound on the whole measurement (default 5m)")
	quiet := fs.Bool("quiet", false, "no progress lines on stderr")
	if err := parseFlags(fs, args, stdout, stderr); err != nil {
		return err
	}
	if *worker == "" {
		return fmt.Errorf("--worker: required")
	}
	cfg := calibration.Config{URL: *worker, Model: *model, Preset: *preset, Repeats: *repeats, DecodeTokens: *decode,
		Batch: *batch, BatchContext: *batchCtx, MaxRequests: *maxReq, Timeout: *timeout}
	for _, s := range strings.Split(*lengths, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 16 {
			return fmt.Errorf("--lengths: %q is not a length of 16 tokens or more", s)
		}
		cfg.Lengths = append(cfg.Lengths, n)
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"repeats", *repeats}, {"decode-tokens", *decode}, {"batch-context", *batchCtx}, {"max-requests", *maxReq}} {
		if f.v < 1 || f.name == "decode-tokens" && f.v < 2 {
			return fmt.Errorf("--%s: must be positive (decode-tokens at least 2), got %d", f.name, f.v)
		}
	}
	if *batch == 0 || *batch < -1 {
		return fmt.Errorf("--batch: must be positive, or -1 to skip, got %d", *batch)
	}
	if *timeout < 0 {
		return fmt.Errorf("--timeout: must be positive, got %s", *timeout)
	}
	if !*quiet {
		cfg.Progress = stderr
	}
	res, err := calibration.Run(ctx, cfg)
	if err != nil {
		return fmt.Errorf("calibrating %s: %w", *worker, err)
	}
	fmt.Fprintf(stdout, "# %s, measured with %d requests; shape of preset %s\n", *worker, res.Requests, *preset)
	fmt.Fprint(stdout, res.YAML())
	return nil
}
