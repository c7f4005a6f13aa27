package scheduler_test

import (
	"net"
	"testing"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/routing"
)

// A scheduler closed before it serves (a process stopped while starting)
// has nothing to report: Serve returns nil and closes the listener.
func TestServeAfterClose(t *testing.T) {
	cfg := loadYAML(t, `
strategy: prefix_aware
workers:
  - {address: "127.0.0.1:1"}
`)
	var reg routing.Registry
	routing.RegisterBuiltins(&reg)
	s, err := scheduler.New(cfg, &reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Serve(l); err != nil {
		t.Errorf("Serve after Close = %v, want nil", err)
	}
	if _, err := l.Accept(); err == nil {
		t.Error("the listener is still open")
	}
}
