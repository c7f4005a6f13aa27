// Package redistest runs throwaway redis-server processes for tests: each
// on a free loopback port, without persistence, in the test's temporary
// directory, stopped when the test ends.
//
// Tests that need Redis never skip: when no redis-server can be found (or,
// as root with apt-get, installed), they fail with the command that
// installs it. BATON_REDIS_SERVER names the binary to run; otherwise PATH's
// redis-server is used. BATON_TEST_REDIS_ADDR names an already running
// server that Shared hands out to tests that neither stop nor restart it.
package redistest

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Environment variables the package reads.
const (
	// EnvServer names the redis-server binary to run.
	EnvServer = "BATON_REDIS_SERVER"
	// EnvAddr is the host:port of a running server for Shared.
	EnvAddr = "BATON_TEST_REDIS_ADDR"
)

// startTimeout bounds the wait for a new server to answer PING.
const startTimeout = 10 * time.Second

// Server is one redis-server process on a loopback port.
type Server struct {
	t    testing.TB
	bin  string
	port int
	dir  string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
	logs *bytes.Buffer // cmd's output, for failure messages
}

// Start launches a redis-server on a free loopback port and returns once it
// answers PING; it is stopped when t ends. Start fails t, never skips it,
// when no redis-server can be had.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir()}
	t.Cleanup(s.Stop)
	// Another process may take the free port before redis-server binds
	// it; then try another.
	for attempt := 1; ; attempt++ {
		if s.port, err = freePort(); err != nil {
			t.Fatalf("redistest: finding a free port: %v", err)
		}
		err = s.start()
		if err == nil {
			return s
		}
		if attempt == 3 {
			t.Fatal(err)
		}
	}
}

// Shared returns the address of a Redis a test may use but must not stop
// or restart: BATON_TEST_REDIS_ADDR when set (CI starts one for the whole
// run), else that of a server Start launches for t.
func Shared(t testing.TB) string {
	t.Helper()
	if addr := os.Getenv(EnvAddr); addr != "" {
		if err := ping(addr, time.Second); err != nil {
			t.Fatalf("redistest: %s=%s does not answer: %v", EnvAddr, addr, err)
		}
		return addr
	}
	return Start(t).Addr()
}

// Addr returns the server's host:port; it stays the same across Restart.
func (s *Server) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// Stop kills the server (SIGKILL: to clients it vanishes, as a crashed
// Redis does) and waits for the process to exit. It is idempotent.
func (s *Server) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
	s.cmd = nil
}

// Freeze suspends the server (SIGSTOP): connections are still accepted by
// the kernel but nothing answers, as with a Redis stuck on a slow command.
// Thaw resumes it.
func (s *Server) Freeze() { s.signal(syscall.SIGSTOP) }

// Thaw resumes a frozen server (SIGCONT).
func (s *Server) Thaw() { s.signal(syscall.SIGCONT) }

func (s *Server) signal(sig syscall.Signal) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		s.t.Fatalf("redistest: signalling a stopped server")
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("redistest: %v: %v", sig, err)
	}
}

// Restart starts the server again on the same port, empty, and returns
// once it answers PING. It stops the server first if it is running.
func (s *Server) Restart() {
	s.t.Helper()
	s.Stop()
	if err := s.start(); err != nil {
		s.t.Fatal(err)
	}
}

func (s *Server) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	logs := new(bytes.Buffer)
	cmd := exec.Command(s.bin,
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--dir", s.dir,
	)
	cmd.Stdout, cmd.Stderr = logs, logs
	// Its own process group, so a Ctrl-C meant for go test is not what
	// stops it first; Stop and t.Cleanup do.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("redistest: starting %s: %v", s.bin, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	s.cmd, s.done, s.logs = cmd, done, logs

	deadline := time.Now().Add(startTimeout)
	for {
		err := ping(s.Addr(), 200*time.Millisecond)
		if err == nil {
			return nil
		}
		select {
		case <-done:
			s.cmd = nil
			return fmt.Errorf("redistest: redis-server on port %d exited: %s", s.port, strings.TrimSpace(logs.String()))
		default:
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			<-done
			s.cmd = nil
			return fmt.Errorf("redistest: redis-server on port %d did not answer PING within %v (%v): %s",
				s.port, startTimeout, err, strings.TrimSpace(logs.String()))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

var (
	installOnce sync.Once
	installErr  error
)

// Binary returns the redis-server to run: $BATON_REDIS_SERVER, else PATH's
// redis-server, else — as root with apt-get — Debian's redis-server
// package, installed once per process.
func Binary() (string, error) {
	if bin := os.Getenv(EnvServer); bin != "" {
		if _, err := os.Stat(bin); err != nil {
			return "", fmt.Errorf("redistest: %s=%s: %v", EnvServer, bin, err)
		}
		return bin, nil
	}
	if bin, err := exec.LookPath("redis-server"); err == nil {
		return bin, nil
	}
	if _, err := exec.LookPath("apt-get"); err != nil || os.Geteuid() != 0 {
		return "", errors.New("redistest: redis-server is not installed; run  sudo apt-get install -y redis-server  (or set " + EnvServer + ")")
	}
	installOnce.Do(func() { installErr = aptInstall() })
	if installErr != nil {
		return "", installErr
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return "", fmt.Errorf("redistest: apt-get installed redis-server but it is not on PATH: %v", err)
	}
	return bin, nil
}

func aptInstall() error {
	for _, args := range [][]string{
		{"update", "-qq"},
		{"install", "-y", "-qq", "redis-server"},
	} {
		cmd := exec.Command("apt-get", args...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("redistest: apt-get %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
		}
	}
	return nil
}

// freePort returns a loopback TCP port nobody listens on now.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ping sends one inline PING and expects +PONG.
func ping(addr string, timeout time.Duration) error {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "+PONG\r\n" {
		return fmt.Errorf("PING answered %q", strings.TrimSpace(line))
	}
	return nil
}
