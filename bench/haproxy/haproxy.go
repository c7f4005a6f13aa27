// Package haproxy runs HAProxy, the plain load balancer that baton is
// measured beside and deployed behind, as a process of its own on a
// loopback port: for proxybench's latency comparison, the fault matrix's
// clients and the tests of several scheduler replicas behind one address.
package haproxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// Binary returns the HAProxy to run: bin if not empty, else PATH's
// haproxy, else Debian's /usr/sbin/haproxy, else, as root with apt-get,
// Debian's haproxy package, installed once per process. Its error names
// the command that installs it.
func Binary(bin string) (string, error) {
	if bin != "" {
		if _, err := os.Stat(bin); err != nil {
			return "", fmt.Errorf("haproxy: %w", err)
		}
		return bin, nil
	}
	if p, ok := find(); ok {
		return p, nil
	}
	if _, err := exec.LookPath("apt-get"); err != nil || os.Geteuid() != 0 {
		return "", errors.New("haproxy is missing: run  sudo apt-get install -y haproxy")
	}
	installOnce.Do(func() { installErr = aptInstall() })
	if installErr != nil {
		return "", installErr
	}
	if p, ok := find(); ok {
		return p, nil
	}
	return "", errors.New("haproxy: apt-get installed haproxy but it is neither on PATH nor /usr/sbin/haproxy")
}

var (
	installOnce sync.Once
	installErr  error
)

func find() (string, bool) {
	if p, err := exec.LookPath("haproxy"); err == nil {
		return p, true
	}
	if _, err := os.Stat("/usr/sbin/haproxy"); err == nil { // Debian's, off a user's PATH
		return "/usr/sbin/haproxy", true
	}
	return "", false
}

func aptInstall() error {
	for _, args := range [][]string{{"update", "-qq"}, {"install", "-y", "-qq", "haproxy"}} {
		cmd := exec.Command("apt-get", args...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("haproxy: apt-get %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
		}
	}
	return nil
}

// Version returns bin's version as "HAProxy 2.6.12", or "HAProxy ?".
func Version(bin string) string {
	out, err := exec.Command(bin, "-v").Output()
	if err != nil {
		return "HAProxy ?"
	}
	v, _, _ := strings.Cut(string(out), " - ")
	v = strings.TrimSpace(strings.TrimPrefix(v, "HAProxy version "))
	return "HAProxy " + strings.Fields(v + " ?")[0]
}

// Proxy is a running HAProxy.
type Proxy struct {
	// Addr is the loopback host:port its frontend listens on.
	Addr string
	// Version is what Version says of its binary.
	Version string

	cmd    *exec.Cmd
	dir    string
	exited chan struct{}
	out    bytes.Buffer // what it printed, for errors
	outMu  sync.Mutex
}

// Start runs bin in the foreground with the configuration config returns
// for a free loopback address (the frontend's bind), and returns once
// that address accepts connections, or with an error that quotes what
// HAProxy printed.
func Start(bin string, config func(bind string) string) (*Proxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := l.Addr().String()
	l.Close() // HAProxy binds it itself
	dir, err := os.MkdirTemp("", "baton-haproxy-")
	if err != nil {
		return nil, err
	}
	cfg := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfg, []byte(config(addr)), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	p := &Proxy{Addr: addr, Version: Version(bin), dir: dir, exited: make(chan struct{})}
	// -db: in the foreground, one process.
	p.cmd = exec.Command(bin, "-db", "-f", cfg)
	p.cmd.Stdout, p.cmd.Stderr = (*lockedWriter)(p), (*lockedWriter)(p)
	if err := p.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("starting haproxy: %w", err)
	}
	go func() { p.cmd.Wait(); close(p.exited) }()
	if err := p.waitListening(10 * time.Second); err != nil {
		p.Stop()
		return nil, fmt.Errorf("haproxy: %w: %s", err, p.Output())
	}
	return p, nil
}

type lockedWriter Proxy

func (w *lockedWriter) Write(b []byte) (int, error) {
	w.outMu.Lock()
	defer w.outMu.Unlock()
	if w.out.Len() < 64<<10 {
		w.out.Write(b)
	}
	return len(b), nil
}

// Output returns what HAProxy printed so far (its first 64 KiB).
func (p *Proxy) Output() string {
	p.outMu.Lock()
	defer p.outMu.Unlock()
	return strings.TrimSpace(p.out.String())
}

// Pid is the process's id.
func (p *Proxy) Pid() int { return p.cmd.Process.Pid }

func (p *Proxy) waitListening(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", p.Addr)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-p.exited:
			return errors.New("exited")
		case <-ctx.Done():
			return fmt.Errorf("does not listen on %s", p.Addr)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Stop kills the process and removes its configuration.
func (p *Proxy) Stop() {
	p.cmd.Process.Kill()
	<-p.exited
	os.RemoveAll(p.dir)
}

// Replicas returns a configuration of HAProxy in front of baton serve
// replicas (host:port each) as an operator would put it: bound to bind,
// round robin per request, each replica's /readyz checked every
// CheckInterval (a draining replica answers 503 there before it stops
// accepting: its drain_delay should cover a few checks), and a refused
// connection tried again on another replica, never a request already
// sent.
func Replicas(bind string, servers []string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `global
	maxconn 4096

defaults
	mode http
	timeout connect 1s
	timeout client 60s
	timeout server 60s
	timeout http-keep-alive 60s
	retries 3
	option redispatch 1

frontend fe
	bind %s
	default_backend baton

backend baton
	balance roundrobin
	option httpchk GET /readyz
	default-server inter %dms fall 1 rise 1
`, bind, CheckInterval.Milliseconds())
	for i, s := range servers {
		fmt.Fprintf(&b, "\tserver r%d %s check\n", i, s)
	}
	return b.String()
}

// CheckInterval is how often Replicas's configuration checks each
// replica's /readyz.
const CheckInterval = 100 * time.Millisecond
