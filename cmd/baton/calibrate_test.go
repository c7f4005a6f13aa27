package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/batonllm/baton/workers/sim"
)

func TestCalibrateFlags(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"--worker", "http://h:8000", "--lengths", "1024,x"},
		{"--worker", "http://h:8000", "--lengths", "8"},
		{"--worker", "http://h:8000", "--batch", "0"},
		{"--worker", "http://h:8000", "--repeats", "0"},
		{"--worker", "http://h:8000", "--decode-tokens", "1"},
		{"--worker", "http://h:8000", "--timeout", "-1s"},
	} {
		if err := run(context.Background(), append([]string{"calibrate"}, args...), &bytes.Buffer{}, &bytes.Buffer{}); err == nil {
			t.Errorf("calibrate %v: no error", args)
		}
	}
}

// baton calibrate against a simulated worker's OpenAI endpoint prints a
// cost block, with its progress on stderr.
func TestCalibrate(t *testing.T) {
	w, err := sim.Start(sim.Config{TimeScale: 1}, "127.0.0.1:0", "127.0.0.1:0", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	var out, errOut bytes.Buffer
	err = run(context.Background(), []string{"calibrate", "--worker", "http://" + w.HTTPAddr,
		"--lengths", "512,1024", "--repeats", "1", "--decode-tokens", "8", "--batch", "-1"}, &out, &errOut)
	if err != nil {
		t.Fatalf("calibrate: %v\n%s", err, errOut.String())
	}
	for _, want := range []string{"cost:\n", "  flops: ", "  decode_step_seconds: ", "  kv_bytes_per_block: 2097152\n"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if !strings.Contains(errOut.String(), "prefill 5") {
		t.Errorf("no progress on stderr: %q", errOut.String())
	}
}
