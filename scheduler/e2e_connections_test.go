package scheduler_test

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/frontend"
)

// TestMaxConnections: past max_connections a new client connection is not
// served until an open one closes; baton_http_connections counts them.
func TestMaxConnections(t *testing.T) {
	_, workers := startWorkers(t, 1, fastScale)
	cfg := scheduler.Config{Strategy: "random", Workers: workers, Pool: fastPool()}
	cfg.MaxConnections = 2
	_, addr := startScheduler(t, cfg)

	// Two clients keep their connections open after a request each.
	var held []net.Conn
	for i := range 2 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		fmt.Fprintf(c, "GET /healthz HTTP/1.1\r\nHost: baton\r\n\r\n")
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("held connection %d: %v", i, err)
		}
		resp.Body.Close()
		held = append(held, c)
	}

	get := func(timeout time.Duration) (*http.Response, error) {
		hc := &http.Client{Timeout: timeout, Transport: &http.Transport{DisableKeepAlives: true}}
		return hc.Get("http://" + addr + "/healthz")
	}
	if resp, err := get(300 * time.Millisecond); err == nil {
		resp.Body.Close()
		t.Fatalf("a third connection was served (%s) while two were open with max_connections 2", resp.Status)
	}

	held[0].Close()
	resp, err := get(20 * time.Second)
	if err != nil {
		t.Fatalf("after one connection closed: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("after one connection closed: %s", resp.Status)
	}
	held[1].Close()
	eventually(t, 10*time.Second, func() error {
		m := scrape(t, &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}, addr)
		// The scrape's own connection is open while it is counted.
		if v, ok := metric(m, "baton_http_connections"); !ok || v != 1 {
			return fmt.Errorf("baton_http_connections = %v (present %v), want 1: the scrape's", v, ok)
		}
		return nil
	})
}

func TestMaxConnectionsValidate(t *testing.T) {
	for _, tt := range []struct {
		n       int
		wantErr bool
	}{{-2, true}, {-1, false}, {0, false}, {1, false}} {
		err := frontend.Config{MaxConnections: tt.n}.Validate()
		if tt.wantErr && (err == nil || !strings.HasPrefix(err.Error(), "max_connections:")) {
			t.Errorf("max_connections %d: error %v, want one naming max_connections", tt.n, err)
		}
		if !tt.wantErr && err != nil {
			t.Errorf("max_connections %d: %v", tt.n, err)
		}
	}
}
