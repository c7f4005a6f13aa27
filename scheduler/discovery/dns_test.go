package discovery

import (
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/miekg/dns"
)

// dnsServer is a DNS server on loopback whose records a test changes.
type dnsServer struct {
	Addr string

	mu      sync.Mutex
	a       map[string][]string // name → IPv4 or IPv6 addresses
	srv     map[string][]dns.SRV
	fail    bool // answer SERVFAIL
	queries int
	queried chan struct{} // closed and replaced at each query
}

func startDNS(t *testing.T) *dnsServer {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d := &dnsServer{Addr: pc.LocalAddr().String(), a: map[string][]string{}, srv: map[string][]dns.SRV{},
		queried: make(chan struct{})}
	s := &dns.Server{PacketConn: pc, Handler: d}
	started := make(chan struct{})
	s.NotifyStartedFunc = func() { close(started) }
	go s.ActivateAndServe()
	<-started
	t.Cleanup(func() { s.Shutdown() })
	return d
}

// set replaces name's address records.
func (d *dnsServer) set(name string, addrs ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.a[name] = addrs
}

func (d *dnsServer) setSRV(name string, srvs ...dns.SRV) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.srv[name] = srvs
}

func (d *dnsServer) setFail(fail bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.fail = fail
}

func (d *dnsServer) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.queries++
	close(d.queried)
	d.queried = make(chan struct{})
	m := new(dns.Msg)
	m.SetReply(req)
	m.Authoritative = true
	if d.fail {
		m.Rcode = dns.RcodeServerFailure
		w.WriteMsg(m)
		return
	}
	q := req.Question[0]
	name := strings.ToLower(q.Name)
	_, hasA := d.a[name]
	_, hasSRV := d.srv[name]
	if !hasA && !hasSRV {
		m.Rcode = dns.RcodeNameError
		w.WriteMsg(m)
		return
	}
	hdr := dns.RR_Header{Name: q.Name, Class: dns.ClassINET, Ttl: 1}
	switch q.Qtype {
	case dns.TypeA, dns.TypeAAAA:
		for _, s := range d.a[name] {
			ip := net.ParseIP(s)
			switch {
			case q.Qtype == dns.TypeA && ip.To4() != nil:
				h := hdr
				h.Rrtype = dns.TypeA
				m.Answer = append(m.Answer, &dns.A{Hdr: h, A: ip.To4()})
			case q.Qtype == dns.TypeAAAA && ip.To4() == nil:
				h := hdr
				h.Rrtype = dns.TypeAAAA
				m.Answer = append(m.Answer, &dns.AAAA{Hdr: h, AAAA: ip})
			}
		}
	case dns.TypeSRV:
		for _, s := range d.srv[name] {
			s.Hdr = hdr
			s.Hdr.Rrtype = dns.TypeSRV
			m.Answer = append(m.Answer, &s)
		}
	}
	w.WriteMsg(m)
}

// next returns the next set from src, failing after a generous wait (a
// hung source, not a slow one).
func next(t *testing.T, src Source) []Member {
	t.Helper()
	select {
	case ms, ok := <-src.Updates():
		if !ok {
			t.Fatal("Updates closed")
		}
		return ms
	case <-time.After(30 * time.Second):
		t.Fatal("no update in 30s")
		return nil
	}
}

func members(addrs ...string) []Member {
	var ms []Member
	for _, a := range addrs {
		ms = append(ms, Member{Name: a, Address: a})
	}
	return ms
}

// TestDNSFollowsRecords: the set follows the name's records as they
// change, a lookup that fails keeps the last set, and a name that goes
// away is an empty set.
func TestDNSFollowsRecords(t *testing.T) {
	srv := startDNS(t)
	const name = "workers.baton.test."
	srv.set(name, "10.0.0.1", "10.0.0.2", "fd00::3")
	d, err := NewDNS(DNSConfig{Name: name, Port: 9000, Server: srv.Addr, Interval: 100 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })

	want := members("10.0.0.1:9000", "10.0.0.2:9000", "[fd00::3]:9000")
	if diff := cmp.Diff(want, next(t, d)); diff != "" {
		t.Fatalf("first set (-want +got):\n%s", diff)
	}

	srv.set(name, "10.0.0.2", "fd00::3", "10.0.0.4")
	want = members("10.0.0.2:9000", "10.0.0.4:9000", "[fd00::3]:9000")
	if diff := cmp.Diff(want, next(t, d)); diff != "" {
		t.Fatalf("after a change (-want +got):\n%s", diff)
	}

	// A failing server removes no worker: the next set is the one sent
	// after it recovers, and it differs from the last.
	srv.setFail(true)
	waitQueries(t, srv, 4)
	srv.set(name, "10.0.0.2")
	srv.setFail(false)
	if diff := cmp.Diff(members("10.0.0.2:9000"), next(t, d)); diff != "" {
		t.Fatalf("after a failure (-want +got):\n%s", diff)
	}

	srv.mu.Lock()
	delete(srv.a, name)
	srv.mu.Unlock()
	if got := next(t, d); len(got) != 0 {
		t.Fatalf("name gone: set %v, want empty", got)
	}
}

// waitQueries waits until srv has answered n more queries.
func waitQueries(t *testing.T, srv *dnsServer, n int) {
	t.Helper()
	srv.mu.Lock()
	until := srv.queries + n
	srv.mu.Unlock()
	timeout := time.After(30 * time.Second)
	for {
		srv.mu.Lock()
		q, queried := srv.queries, srv.queried
		srv.mu.Unlock()
		if q >= until {
			return
		}
		select {
		case <-queried:
		case <-timeout:
			t.Fatalf("server did not see %d more queries", n)
		}
	}
}

func TestDNSSRV(t *testing.T) {
	srv := startDNS(t)
	const name = "_grpc._tcp.workers.baton.test."
	srv.setSRV(name,
		dns.SRV{Target: "w-0.workers.baton.test.", Port: 9000, Weight: 1},
		dns.SRV{Target: "w-1.workers.baton.test.", Port: 9001, Weight: 1})
	d, err := NewDNS(DNSConfig{Name: name, SRV: true, Server: srv.Addr, Interval: 100 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	want := members("w-0.workers.baton.test:9000", "w-1.workers.baton.test:9001")
	if diff := cmp.Diff(want, next(t, d)); diff != "" {
		t.Fatalf("SRV set (-want +got):\n%s", diff)
	}
}

func TestDNSConfigErrors(t *testing.T) {
	tests := []struct {
		cfg  DNSConfig
		want string
	}{
		{DNSConfig{Port: 9000}, "name: required"},
		{DNSConfig{Name: "w"}, "port: must be 1–65535, got 0"},
		{DNSConfig{Name: "w", Port: 70000}, "port: must be 1–65535, got 70000"},
		{DNSConfig{Name: "w", SRV: true, Port: 9000}, "port: SRV records give the port"},
		{DNSConfig{Name: "w", Port: 1, Interval: time.Millisecond}, "interval: must be at least 100ms"},
		{DNSConfig{Name: "w", Port: 1, Interval: time.Second, Timeout: 2 * time.Second}, "timeout: must be positive and at most interval"},
		{DNSConfig{Name: "w", Port: 1, Server: "10.0.0.1"}, "server: address 10.0.0.1: missing port"},
	}
	for _, tt := range tests {
		err := tt.cfg.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), tt.want) {
			t.Errorf("%+v: Validate() = %v, want %q…", tt.cfg, err, tt.want)
		}
	}
	if err := (DNSConfig{Name: "w", Port: 1}).Validate(); err != nil {
		t.Errorf("valid config: %v", err)
	}
}
