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
	"crypto/tls"
	"crypto/x509"
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

// Options configure a server StartWith launches. The zero value is
// Start's server: plaintext, no password.
type Options struct {
	// Password turns on requirepass: clients must AUTH with it.
	Password string
	// TLS, if not nil, makes the server speak TLS only, on its one port.
	TLS *TLS
}

// TLS names a TLS server's PEM files (make them with tlsconf/tlstest).
type TLS struct {
	// CertFile and KeyFile are the server's certificate, which must name
	// 127.0.0.1 and be good for client authentication too: the readiness
	// PING presents it when ClientCerts is set.
	CertFile, KeyFile string
	// CAFile signs the server's certificate and, with ClientCerts, the
	// clients'.
	CAFile string
	// ClientCerts requires clients to present a certificate the CA
	// signed (tls-auth-clients yes).
	ClientCerts bool
}

// Server is one redis-server process on a loopback port.
type Server struct {
	t    testing.TB
	bin  string
	port int
	dir  string
	opts Options

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
	return StartWith(t, Options{})
}

// StartWith is Start with a password or TLS. A redis-server built without
// TLS support skips t when o.TLS is set, saying so.
func StartWith(t testing.TB, o Options) *Server {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		t.Fatal(err)
	}
	s := &Server{t: t, bin: bin, dir: t.TempDir(), opts: o}
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
		if errors.Is(err, errNoTLS) {
			t.Skip(err)
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
	args := []string{
		"--port", strconv.Itoa(s.port),
		"--bind", "127.0.0.1",
		"--save", "",
		"--appendonly", "no",
		"--dir", s.dir,
	}
	if s.opts.Password != "" {
		args = append(args, "--requirepass", s.opts.Password)
	}
	if tc := s.opts.TLS; tc != nil {
		auth := "no"
		if tc.ClientCerts {
			auth = "yes"
		}
		args = append(args, "--port", "0", "--tls-port", strconv.Itoa(s.port),
			"--tls-cert-file", tc.CertFile, "--tls-key-file", tc.KeyFile,
			"--tls-ca-cert-file", tc.CAFile, "--tls-auth-clients", auth)
	}
	cmd := exec.Command(s.bin, args...)
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
		err := s.ping(200 * time.Millisecond)
		if err == nil {
			return nil
		}
		select {
		case <-done:
			s.cmd = nil
			out := strings.TrimSpace(logs.String())
			if s.opts.TLS != nil && noTLS(out) {
				return fmt.Errorf("%w (%s): %s", errNoTLS, s.bin, out)
			}
			return fmt.Errorf("redistest: redis-server on port %d exited: %s", s.port, out)
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

// errNoTLS is start's error when redis-server lacks TLS support.
var errNoTLS = errors.New("redistest: this redis-server was built without TLS support (BUILD_TLS=no), so the TLS tests cannot run")

// noTLS reports whether a redis-server's output says it cannot serve
// TLS: 7.0 logs "this Redis was not built with TLS support", older ones
// reject tls-port as a bad directive.
func noTLS(out string) bool {
	for _, s := range []string{"TLS support", "Bad directive", "TLS is not"} {
		if strings.Contains(out, s) {
			return true
		}
	}
	return false
}

// ping is the package's ping with the server's password and TLS.
func (s *Server) ping(timeout time.Duration) error {
	var tc *tls.Config
	if o := s.opts.TLS; o != nil {
		b, err := os.ReadFile(o.CAFile)
		if err != nil {
			return err
		}
		roots := x509.NewCertPool()
		roots.AppendCertsFromPEM(b)
		tc = &tls.Config{RootCAs: roots, ServerName: "127.0.0.1"}
		if o.ClientCerts {
			pair, err := tls.LoadX509KeyPair(o.CertFile, o.KeyFile)
			if err != nil {
				return err
			}
			tc.Certificates = []tls.Certificate{pair}
		}
	}
	return pingWith(s.Addr(), timeout, s.opts.Password, tc)
}

// ping sends one inline PING and expects +PONG.
func ping(addr string, timeout time.Duration) error {
	return pingWith(addr, timeout, "", nil)
}

// pingWith is ping over TLS when tc is not nil, after AUTH password
// when it is not empty.
func pingWith(addr string, timeout time.Duration, password string, tc *tls.Config) error {
	var c net.Conn
	var err error
	if tc != nil {
		c, err = tls.DialWithDialer(&net.Dialer{Timeout: timeout}, "tcp", addr, tc)
	} else {
		c, err = net.DialTimeout("tcp", addr, timeout)
	}
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(timeout))
	r := bufio.NewReader(c)
	if password != "" {
		// RESP, not inline: the password may hold spaces.
		if _, err := fmt.Fprintf(c, "*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n", len(password), password); err != nil {
			return err
		}
		line, err := r.ReadString('\n')
		if err != nil {
			return err
		}
		if line != "+OK\r\n" {
			return fmt.Errorf("AUTH answered %q", strings.TrimSpace(line))
		}
	}
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := r.ReadString('\n')
	if err != nil {
		return err
	}
	if line != "+PONG\r\n" {
		return fmt.Errorf("PING answered %q", strings.TrimSpace(line))
	}
	return nil
}

// ProtectedModeReply is what redis-server 7.0 in protected mode (no
// password, its default) writes to a client on another host than
// loopback, before it closes the connection without reading.
const ProtectedModeReply = "-DENIED Redis is running in protected mode because protected mode is enabled and no password is set for the default user. In this mode connections are only accepted from the loopback interface.\r\n"

// ProtectedMode listens on loopback, answers every connection as a Redis
// in protected mode answers one from another host (ProtectedModeReply,
// then close) and returns its address. A real redis-server does so only
// to a client on a non-loopback address, which a test cannot have on
// demand.
func ProtectedMode(t testing.TB) string { return TurningAway(t, ProtectedModeReply) }

// MaxClientsReply is what redis-server writes to a connection past its
// maxclients, before it closes it.
const MaxClientsReply = "-ERR max number of clients reached\r\n"

// TurningAway listens on loopback, answers every connection with reply
// without reading, closes it, and returns its address: a Redis that turns
// clients away (ProtectedModeReply, MaxClientsReply).
func TurningAway(t testing.TB, reply string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte(reply))
			c.Close()
		}
	}()
	return ln.Addr().String()
}
