package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"
)

// Defaults of DNSConfig.
const (
	DefaultDNSInterval = 5 * time.Second
	DefaultDNSTimeout  = 2 * time.Second
)

// DNSConfig finds workers by the records of a DNS name, as a headless
// Service publishes one per ready pod. The zero value of a field means
// its default.
type DNSConfig struct {
	// Name is the name to resolve, e.g.
	// baton-decode.baton.svc.cluster.local. Required.
	Name string `yaml:"name"`
	// Port is the workers' port, for the addresses of A and AAAA records.
	// Required unless SRV.
	Port int `yaml:"port"`
	// SRV looks up Name's SRV records instead (as
	// _grpc._tcp.baton-decode.baton.svc.cluster.local), which give each
	// worker's host and port.
	SRV bool `yaml:"srv"`
	// Interval is the time between two lookups; a worker that joins or
	// leaves is seen within it. Default 5s.
	Interval time.Duration `yaml:"interval"`
	// Timeout bounds one lookup. Default 2s, or Interval if shorter.
	Timeout time.Duration `yaml:"timeout"`
	// Server is the host:port of the DNS server to ask. Default: the
	// system's resolvers.
	Server string `yaml:"server"`
}

// WithDefaults returns c with zero fields set to their defaults.
func (c DNSConfig) WithDefaults() DNSConfig {
	if c.Interval == 0 {
		c.Interval = DefaultDNSInterval
	}
	if c.Timeout == 0 {
		c.Timeout = min(DefaultDNSTimeout, c.Interval)
	}
	return c
}

// Validate reports the first invalid field, by its configuration name.
func (c DNSConfig) Validate() error {
	c = c.WithDefaults()
	switch {
	case c.Name == "":
		return errors.New("name: required")
	case c.SRV && c.Port != 0:
		return fmt.Errorf("port: SRV records give the port; leave it unset (got %d)", c.Port)
	case !c.SRV && (c.Port < 1 || c.Port > 65535):
		return fmt.Errorf("port: must be 1–65535, got %d", c.Port)
	case c.Interval < 100*time.Millisecond:
		return fmt.Errorf("interval: must be at least 100ms, got %s", c.Interval)
	case c.Timeout < 0 || c.Timeout > c.Interval:
		return fmt.Errorf("timeout: must be positive and at most interval (%s), got %s", c.Interval, c.Timeout)
	}
	if c.Server != "" {
		if _, _, err := net.SplitHostPort(c.Server); err != nil {
			return fmt.Errorf("server: %v", err)
		}
	}
	return nil
}

// DNS is a Source that resolves a name every interval.
type DNS struct {
	cfg    DNSConfig
	r      *net.Resolver
	log    *slog.Logger
	l      *latest
	cancel context.CancelFunc
	done   chan struct{}
}

// NewDNS starts resolving cfg.Name; its first set comes after the first
// lookup that succeeds. A lookup that fails keeps the last set (a
// resolver's hiccup removes no worker); a name that does not exist, or has
// no records, is an empty set. A nil log discards.
func NewDNS(cfg DNSConfig, log *slog.Logger) (*DNS, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &DNS{cfg: cfg.WithDefaults(), r: net.DefaultResolver, log: log, l: newLatest(), done: make(chan struct{})}
	if cfg.Server != "" {
		d.r = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var dl net.Dialer
			return dl.DialContext(ctx, network, cfg.Server)
		}}
	}
	var ctx context.Context
	ctx, d.cancel = context.WithCancel(context.Background())
	go d.run(ctx)
	return d, nil
}

// Updates implements Source.
func (d *DNS) Updates() <-chan []Member { return d.l.ch }

// Close implements Source.
func (d *DNS) Close() error {
	d.cancel()
	<-d.done
	d.l.close()
	return nil
}

func (d *DNS) run(ctx context.Context) {
	defer close(d.done)
	t := time.NewTicker(d.cfg.Interval)
	defer t.Stop()
	failing := false
	for {
		ms, err := d.lookup(ctx)
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			if !failing {
				d.log.Warn("dns discovery: lookup failed; keeping the workers known", "name", d.cfg.Name, "err", err)
			}
			failing = true
		default:
			if failing {
				d.log.Info("dns discovery: lookup succeeds again", "name", d.cfg.Name)
			}
			failing = false
			d.l.send(ms)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// lookup resolves the name once.
func (d *DNS) lookup(ctx context.Context) ([]Member, error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
	defer cancel()
	var ms []Member
	if d.cfg.SRV {
		_, srvs, err := d.r.LookupSRV(ctx, "", "", d.cfg.Name)
		if notFound(err) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		for _, s := range srvs {
			addr := net.JoinHostPort(strings.TrimSuffix(s.Target, "."), strconv.Itoa(int(s.Port)))
			ms = append(ms, Member{Name: addr, Address: addr})
		}
	} else {
		ips, err := d.r.LookupIPAddr(ctx, d.cfg.Name)
		if notFound(err) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		for _, ip := range ips {
			addr := net.JoinHostPort(ip.IP.String(), strconv.Itoa(d.cfg.Port))
			ms = append(ms, Member{Name: addr, Address: addr})
		}
	}
	return dedupe(ms), nil
}

// notFound reports whether err says the name has no records.
func notFound(err error) bool {
	var de *net.DNSError
	return errors.As(err, &de) && de.IsNotFound
}

// dedupe drops members whose name came before.
func dedupe(ms []Member) []Member {
	seen := make(map[string]bool, len(ms))
	out := ms[:0]
	for _, m := range ms {
		if !seen[m.Name] {
			seen[m.Name] = true
			out = append(out, m)
		}
	}
	return out
}

var _ Source = (*DNS)(nil)
