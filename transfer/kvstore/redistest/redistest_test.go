package redistest

import (
	"testing"
	"time"
)

func TestStartStopRestart(t *testing.T) {
	s := Start(t)
	if err := ping(s.Addr(), time.Second); err != nil {
		t.Fatalf("PING after Start: %v", err)
	}
	s.Stop()
	if err := ping(s.Addr(), time.Second); err == nil {
		t.Fatal("PING after Stop answered")
	}
	s.Stop() // idempotent
	s.Restart()
	if err := ping(s.Addr(), time.Second); err != nil {
		t.Fatalf("PING after Restart: %v", err)
	}
}

func TestFreezeThaw(t *testing.T) {
	s := Start(t)
	s.Freeze()
	if err := ping(s.Addr(), 100*time.Millisecond); err == nil {
		t.Fatal("PING to a frozen server answered")
	}
	s.Thaw()
	if err := ping(s.Addr(), time.Second); err != nil {
		t.Fatalf("PING after Thaw: %v", err)
	}
}

func TestShared(t *testing.T) {
	if err := ping(Shared(t), time.Second); err != nil {
		t.Fatalf("PING the shared server: %v", err)
	}
}

func TestBinaryFromEnv(t *testing.T) {
	t.Setenv(EnvServer, "/nonexistent/redis-server")
	if _, err := Binary(); err == nil {
		t.Fatal("Binary with a missing $" + EnvServer + ": no error")
	}
}
