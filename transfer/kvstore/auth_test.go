package kvstore_test

import (
	"bytes"
	"context"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
)

// openURL opens the Redis tier of url with edit applied to its config,
// and returns it with its Check's error.
func openURL(t *testing.T, url string, edit func(*kvstore.RedisConfig)) (*kvstore.Redis, error) {
	t.Helper()
	cfg, err := kvstore.ParseRedisURL(url)
	if err != nil {
		t.Fatalf("ParseRedisURL: %v", err)
	}
	if edit != nil {
		edit(&cfg)
	}
	r, err := kvstore.NewRedis(cfg)
	if err != nil {
		t.Fatalf("NewRedis: %v", err)
	}
	t.Cleanup(func() { r.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return r, r.Check(ctx)
}

// roundTrip writes a block through r and reads it back.
func roundTrip(t *testing.T, r *kvstore.Redis) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ns := transfer.Namespace{Model: "auth"}
	b := block(7, 1024)
	data := b.Data
	if err := r.Put(ctx, ns, []transfer.Block{b}); err != nil {
		t.Fatalf("Put: %v", err)
	}
	got, err := r.Get(ctx, ns, []uint64{7}, len(data))
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if len(got) != 1 || !bytes.Equal(got[0], data) {
		t.Fatalf("Get returned %d values, want the block written", len(got))
	}
}

func TestRedisPassword(t *testing.T) {
	const password = "s3cret-pass"
	s := redistest.StartWith(t, redistest.Options{Password: password})
	cases := []struct {
		name, url string
		refused   string // "" when served; else what the error quotes
	}{
		{"right password", "redis://:" + password + "@" + s.Addr(), ""},
		{"default user and password", "redis://default:" + password + "@" + s.Addr(), ""},
		{"wrong password", "redis://:not-it@" + s.Addr(), "WRONGPASS"},
		{"no password", "redis://" + s.Addr(), "NOAUTH"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, err := openURL(t, tc.url, nil)
			if tc.refused == "" {
				if err != nil {
					t.Fatalf("Check: %v", err)
				}
				roundTrip(t, r)
				return
			}
			if !errors.Is(err, kvstore.ErrRefused) || !strings.Contains(err.Error(), tc.refused) {
				t.Fatalf("Check: %v, want ErrRefused quoting %s", err, tc.refused)
			}
			if strings.Contains(err.Error(), "not-it") {
				t.Errorf("Check's error shows the password: %v", err)
			}
		})
	}
	// A server that is down is not a refusal: it may come back.
	s.Stop()
	if _, err := openURL(t, "redis://:"+password+"@"+s.Addr(), nil); err == nil || errors.Is(err, kvstore.ErrRefused) {
		t.Errorf("server down: %v, want an error other than ErrRefused", err)
	}
}

func TestRedisTLS(t *testing.T) {
	ca := tlstest.NewCA(t, "redis")
	srv := ca.Issue("127.0.0.1")
	const password = "tls-pass"
	s := redistest.StartWith(t, redistest.Options{Password: password, TLS: &redistest.TLS{
		CertFile: srv.CertFile, KeyFile: srv.KeyFile, CAFile: ca.File,
	}})
	other := tlstest.NewCA(t, "other")
	url := "rediss://:" + password + "@" + s.Addr()

	r, err := openURL(t, url, func(c *kvstore.RedisConfig) { c.TLSCAFile = ca.File })
	if err != nil {
		t.Fatalf("rediss with the server's CA: %v", err)
	}
	roundTrip(t, r)

	if _, err := openURL(t, url, func(c *kvstore.RedisConfig) { c.TLSCAFile = other.File }); !errors.Is(err, kvstore.ErrRefused) ||
		!strings.Contains(err.Error(), "unknown authority") {
		t.Errorf("rediss trusting another CA: %v, want ErrRefused for an unknown authority", err)
	}
	if _, err := openURL(t, "rediss://:wrong@"+s.Addr(), func(c *kvstore.RedisConfig) { c.TLSCAFile = ca.File }); !errors.Is(err, kvstore.ErrRefused) ||
		!strings.Contains(err.Error(), "WRONGPASS") {
		t.Errorf("rediss with a wrong password: %v, want ErrRefused for WRONGPASS", err)
	}
	if _, err := openURL(t, "redis://:"+password+"@"+s.Addr(), nil); err == nil {
		t.Error("plaintext client of a TLS server: Check passed")
	}
}

func TestRedisMutualTLS(t *testing.T) {
	ca := tlstest.NewCA(t, "redis")
	srv := ca.Issue("127.0.0.1")
	s := redistest.StartWith(t, redistest.Options{TLS: &redistest.TLS{
		CertFile: srv.CertFile, KeyFile: srv.KeyFile, CAFile: ca.File, ClientCerts: true,
	}})
	client := ca.Issue("worker")
	foreign := tlstest.NewCA(t, "foreign").Issue("worker")
	url := "rediss://" + s.Addr()

	r, err := openURL(t, url, func(c *kvstore.RedisConfig) {
		c.TLSCAFile, c.TLSCertFile, c.TLSKeyFile = ca.File, client.CertFile, client.KeyFile
	})
	if err != nil {
		t.Fatalf("client certificate the CA signed: %v", err)
	}
	roundTrip(t, r)
	// Refused client certificates surface as an alert or a closed
	// connection, whichever the client reads first: any error.
	if _, err := openURL(t, url, func(c *kvstore.RedisConfig) { c.TLSCAFile = ca.File }); err == nil {
		t.Error("no client certificate: Check passed")
	}
	if _, err := openURL(t, url, func(c *kvstore.RedisConfig) {
		c.TLSCAFile, c.TLSCertFile, c.TLSKeyFile = ca.File, foreign.CertFile, foreign.KeyFile
	}); err == nil {
		t.Error("client certificate another CA signed: Check passed")
	}
}

func TestRedisTLSConfigErrors(t *testing.T) {
	ca := tlstest.NewCA(t, "cfg")
	p := ca.Issue("worker")
	missing := t.TempDir() + "/missing.pem"
	cases := []struct {
		name string
		cfg  kvstore.RedisConfig
		want string
	}{
		{"CA without TLS", kvstore.RedisConfig{Addr: "127.0.0.1:6379", TLSCAFile: ca.File}, "redis.tls_ca_file: set without redis.tls"},
		{"cert without TLS", kvstore.RedisConfig{Addr: "127.0.0.1:6379", TLSCertFile: p.CertFile, TLSKeyFile: p.KeyFile}, "redis.tls_cert_file: set without redis.tls"},
		{"missing CA", kvstore.RedisConfig{Addr: "127.0.0.1:6379", TLS: true, TLSCAFile: missing}, "redis.tls_ca_file: "},
		{"cert without key", kvstore.RedisConfig{Addr: "127.0.0.1:6379", TLS: true, TLSCertFile: p.CertFile}, "redis.tls_key_file: required"},
		{"key not the cert's", kvstore.RedisConfig{Addr: "127.0.0.1:6379", TLS: true, TLSCertFile: p.CertFile, TLSKeyFile: ca.File}, "redis.tls_cert_file: "},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.cfg.Validate(); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
				t.Fatalf("Validate: %v, want an error starting %q", err, tc.want)
			}
		})
	}
}

// TestRedisProtectedMode: a Redis that turns the connection away is
// refused with its reason, not reported as an EOF of a server that did
// not answer (which the breaker would keep retrying).
func TestRedisProtectedMode(t *testing.T) {
	addr := redistest.ProtectedMode(t)
	_, err := openURL(t, "redis://"+addr, nil)
	if !errors.Is(err, kvstore.ErrRefused) || !strings.Contains(err.Error(), "DENIED Redis is running in protected mode") {
		t.Fatalf("Check: %v, want ErrRefused with the server's reason", err)
	}
	if why := kvstore.TurnedAway(t.Context(), addr); why == nil || !strings.HasPrefix(why.Error(), "DENIED") {
		t.Errorf("TurnedAway: %v, want the DENIED reply", why)
	}
}

// TestRedisMaxClients: a Redis at its maxclients turns the client away
// for a while: Check says so, without ErrRefused, which would stop a
// worker at start for what passes.
func TestRedisMaxClients(t *testing.T) {
	_, err := openURL(t, "redis://"+redistest.TurningAway(t, redistest.MaxClientsReply), nil)
	if err == nil || errors.Is(err, kvstore.ErrRefused) || !strings.Contains(err.Error(), "max number of clients reached") {
		t.Fatalf("Check: %v, want an error with the server's reason, not ErrRefused", err)
	}
}

// TestTurnedAwayAnswered: a server that answers, one that asks for a
// password, and none at all turn nothing away.
func TestTurnedAwayAnswered(t *testing.T) {
	plain := redistest.Start(t)
	locked := redistest.StartWith(t, redistest.Options{Password: "s3cret-pass"})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	for _, addr := range []string{plain.Addr(), locked.Addr(), closed} {
		if why := kvstore.TurnedAway(t.Context(), addr); why != nil {
			t.Errorf("TurnedAway(%s): %v, want nil", addr, why)
		}
	}
}
