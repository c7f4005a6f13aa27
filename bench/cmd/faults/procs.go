package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// proc is one child process the harness runs (a baton worker or serve, a
// redis-server), restartable with the same arguments. Its output goes to
// a log file in the run's directory.
type proc struct {
	name string
	bin  string
	args []string
	log  string // path of its output

	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
}

func newProc(dir, name, bin string, args ...string) *proc {
	return &proc{name: name, bin: bin, args: args, log: filepath.Join(dir, name+".log")}
}

// start launches the process; its output is appended to its log.
func (p *proc) start() error {
	out, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = childAttr()
	if err := cmd.Start(); err != nil {
		out.Close()
		return fmt.Errorf("%s: %w", p.name, err)
	}
	p.cmd, p.done = cmd, make(chan struct{})
	go func(done chan struct{}) {
		cmd.Wait()
		out.Close()
		close(done)
	}(p.done)
	return nil
}

// running reports whether the process was started and has not exited.
func (p *proc) running() bool {
	if p.cmd == nil {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// kill sends SIGKILL and waits for the exit.
func (p *proc) kill() {
	if !p.running() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop sends SIGTERM and waits up to grace for the exit, then kills.
func (p *proc) stop(grace time.Duration) {
	if !p.running() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		p.kill()
	}
}

// tail returns the last bytes of the process's log, for error messages.
func (p *proc) tail() string {
	b, _ := os.ReadFile(p.log)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(bytes.TrimSpace(b))
}

// freePort returns a loopback port nothing listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func loopback(port int) string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(port)) }

// waitTCP waits until addr accepts connections, or p exits, or timeout.
func waitTCP(p *proc, addr string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if !p.running() {
			return fmt.Errorf("%s exited: %s", p.name, p.tail())
		}
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s: %s not listening after %s", p.name, addr, timeout)
}

// waitReady waits until base's /readyz answers 200 and its scheduler
// counts want workers available.
func waitReady(ctx context.Context, p *proc, base string, want int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		if !p.running() {
			return fmt.Errorf("%s exited: %s", p.name, p.tail())
		}
		last = func() error {
			resp, err := http.Get(base + "/readyz")
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("/readyz: HTTP %d", resp.StatusCode)
			}
			m, err := scrape(ctx, base)
			if err != nil {
				return err
			}
			if got := m.sum("baton_workers_available", nil); int(got) < want {
				return fmt.Errorf("%v of %d workers available (%s)", got, want, unavailable(m))
			}
			return nil
		}()
		if last == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return fmt.Errorf("%s not ready after %s: %v; its log ends:\n%s", p.name, timeout, last, p.tail())
}

// unavailable says which workers a scheduler's metrics show unhealthy or
// with a breaker not closed, and which it does not list at all (pending).
func unavailable(m metrics) string {
	healthy := m.byLabels("baton_worker_healthy", "worker")
	breaker := m.byLabels("baton_worker_breaker_state", "worker")
	var out []string
	for _, w := range slices.Sorted(maps.Keys(healthy)) {
		switch {
		case healthy[w] == 0:
			out = append(out, w+" unhealthy")
		case breaker[w] == 2:
			out = append(out, w+" breaker open")
		case breaker[w] == 1:
			out = append(out, w+" breaker half-open")
		}
	}
	return fmt.Sprintf("%d listed: %s", len(healthy), strings.Join(out, ", "))
}

// redisServer finds redis-server: $BATON_REDIS_SERVER, PATH's, or Debian's.
func redisServer() (string, error) {
	if bin := os.Getenv("BATON_REDIS_SERVER"); bin != "" {
		return bin, nil
	}
	if bin, err := exec.LookPath("redis-server"); err == nil {
		return bin, nil
	}
	if _, err := os.Stat("/usr/bin/redis-server"); err == nil {
		return "/usr/bin/redis-server", nil
	}
	return "", errors.New("redis-server not found: sudo apt-get install -y redis-server, or set BATON_REDIS_SERVER")
}

// redisArgs runs a throwaway server: loopback, no persistence.
func redisArgs(port int, dir string) []string {
	return []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--dir", dir, "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"}
}
