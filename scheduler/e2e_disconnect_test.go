package scheduler_test

import (
	"bufio"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/pool"
)

// TestMassDisconnectOpensNoBreaker: hundreds of clients that hang up after
// their first chunk are the clients' doing. No breaker may open, and the
// requests that follow are all served.
func TestMassDisconnectOpensNoBreaker(t *testing.T) {
	const cut, after = 200, 400
	for _, tc := range []struct {
		name  string
		fleet func(t *testing.T, log *slog.Logger) (*scheduler.Scheduler, string)
	}{
		{"disaggregated", func(t *testing.T, log *slog.Logger) (*scheduler.Scheduler, string) {
			f := startFleetLog(t, 2, 2, fastScale, fastScale, nil, func(c *scheduler.Config) { c.Pool = pool.Config{} }, log)
			return f.s, f.addr
		}},
		{"colocated", func(t *testing.T, log *slog.Logger) (*scheduler.Scheduler, string) {
			_, wcs := startWorkers(t, 2, fastScale)
			return startSchedulerLog(t, scheduler.Config{Strategy: "prefix_aware", Workers: wcs}, log)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logs := &logRecorder{level: slog.LevelInfo}
			s, addr := tc.fleet(t, slog.New(logs))
			body := func(i int) string {
				return fmt.Sprintf(`{"model":%q,"stream":true,"max_tokens":2000,"messages":[{"role":"user","content":%q}]}`,
					model, text(fmt.Sprintf("shared document %d", i%4), 3000))
			}
			// Each client reads up to its first content chunk and closes
			// its connection, as a browser tab closed mid-answer does.
			var wg sync.WaitGroup
			var got atomic.Int64
			for i := range cut {
				wg.Go(func() {
					conn, err := net.Dial("tcp", addr)
					if err != nil {
						t.Errorf("dial: %v", err)
						return
					}
					defer conn.Close()
					b := body(i)
					fmt.Fprintf(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", addr, len(b), b)
					conn.SetReadDeadline(time.Now().Add(30 * time.Second))
					br := bufio.NewReader(conn)
					for {
						line, err := br.ReadString('\n')
						if err != nil {
							t.Errorf("client %d: reading: %v", i, err)
							return
						}
						if strings.HasPrefix(line, "data: {") && strings.Contains(line, `"content"`) {
							got.Add(1)
							return
						}
					}
				})
			}
			wg.Wait()
			if got.Load() != cut {
				t.Fatalf("%d of %d clients saw a first chunk", got.Load(), cut)
			}

			c := oaClient(t, addr)
			var failed atomic.Int64
			errs := make(chan error, after)
			sem := make(chan struct{}, 32)
			for i := range after {
				sem <- struct{}{}
				wg.Go(func() {
					defer func() { <-sem }()
					p := chatParams(text(fmt.Sprintf("shared document %d", i%4), 3000), 4)
					if _, err := c.Chat.Completions.New(ctxT(t, 30*time.Second), p); err != nil {
						failed.Add(1)
						select {
						case errs <- err:
						default:
						}
					}
				})
			}
			wg.Wait()
			close(errs)
			if n := failed.Load(); n != 0 {
				t.Errorf("%d of %d requests after the disconnects failed; first: %v", n, after, <-errs)
			}
			hc := httpClient(t)
			m := scrape(t, hc, addr)
			if v, _ := metric(m, "baton_breaker_transitions_total"); v != 0 {
				t.Errorf("baton_breaker_transitions_total = %v after client disconnects, want 0", v)
			}
			for _, p := range []*pool.Pool{s.Pool, s.PrefillPool} {
				if p == nil {
					continue
				}
				for _, w := range p.Snapshot().Workers {
					if st := w.BreakerState().String(); st != "closed" {
						t.Errorf("worker %s breaker = %s, want closed", w.Name, st)
					}
				}
			}
			// A client that hangs up is routine: nothing to warn about.
			var warnings []string
			for _, m := range logs.messages() {
				// A health check that times out on a starved machine (four
				// -race suites on two cores) is the machine's doing.
				if (strings.HasPrefix(m, "WARN") || strings.HasPrefix(m, "ERROR")) && !strings.Contains(m, "worker health changed") {
					warnings = append(warnings, m)
				}
			}
			if len(warnings) != 0 {
				t.Errorf("%d warnings logged for client disconnects, want none:\n%s\nall logs:\n%s", len(warnings), strings.Join(warnings, "\n"), strings.Join(logs.messages(), "\n"))
			}
			// Every accepted request ended in one outcome: the cut ones
			// as canceled, none as a worker error.
			eventually(t, 5*time.Second, func() error {
				m := scrape(t, hc, addr)
				acc, _ := metric(m, "baton_requests_accepted_total")
				done, _ := metric(m, "baton_requests_completed_total")
				fail, _ := metric(m, "baton_requests_failed_total")
				if acc != done+fail {
					return fmt.Errorf("accepted %v != completed %v + failed %v", acc, done, fail)
				}
				if v, _ := metric(m, "baton_requests_failed_total", `outcome="worker_error"`); v != 0 {
					return fmt.Errorf(`failed{outcome="worker_error"} = %v, want 0`, v)
				}
				return nil
			})
		})
	}
}
