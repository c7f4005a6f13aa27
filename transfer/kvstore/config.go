package kvstore

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/batonllm/baton/transfer/tlsconf"
)

// RedisConfig configures the Redis tier. The zero value of every field but
// Addr means its default.
type RedisConfig struct {
	// Addr is the server's host:port. Required.
	Addr string `yaml:"addr"`
	// Username and Password authenticate (AUTH; Username for Redis 6 ACLs).
	Username string `yaml:"username"`
	Password string `yaml:"password"`
	// DB is the database number, default 0.
	DB int `yaml:"db"`
	// TLS connects with TLS, verifying the server against the system roots.
	TLS bool `yaml:"tls"`
	// TLSCAFile is a PEM file of the CA certificates that sign the
	// server's certificate, in place of the system roots.
	TLSCAFile string `yaml:"tls_ca_file"`
	// TLSCertFile and TLSKeyFile are a client certificate and key, for a
	// server that requires one (redis-server's tls-auth-clients yes, its
	// default); re-read when they change.
	TLSCertFile string `yaml:"tls_cert_file"`
	TLSKeyFile  string `yaml:"tls_key_file"`
	// TLSInsecureSkipVerify skips that verification. For tests only.
	TLSInsecureSkipVerify bool `yaml:"tls_insecure_skip_verify"`
	// TTL is how long a block stays in Redis after its last write; default
	// 1h, negative means no expiry (then only maxmemory bounds the tier).
	TTL time.Duration `yaml:"ttl"`
	// DialTimeout bounds a connect, default 200ms; ReadTimeout and
	// WriteTimeout bound one call's reads and writes, default 500ms. They
	// are short on purpose: a slow Redis must cost a recompute, not hold a
	// request. A read covers a whole pipelined batch (32 blocks of 1 MiB
	// take about 30ms on loopback).
	DialTimeout  time.Duration `yaml:"dial_timeout"`
	ReadTimeout  time.Duration `yaml:"read_timeout"`
	WriteTimeout time.Duration `yaml:"write_timeout"`
	// PoolSize is the most connections open at once, default go-redis's
	// 10 per GOMAXPROCS.
	PoolSize int `yaml:"pool_size"`
}

// Defaults of RedisConfig.
const (
	DefaultTTL          = time.Hour
	DefaultDialTimeout  = 200 * time.Millisecond
	DefaultReadTimeout  = 500 * time.Millisecond
	DefaultWriteTimeout = 500 * time.Millisecond
	defaultRedisPort    = "6379"
)

// withDefaults returns c with zero fields set to their defaults.
func (c RedisConfig) withDefaults() RedisConfig {
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = DefaultReadTimeout
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = DefaultWriteTimeout
	}
	return c
}

// Validate reports the first invalid field, by its configuration name.
func (c RedisConfig) Validate() error {
	if err := validAddr(c.Addr); err != nil {
		return fmt.Errorf("redis.addr: %w", err)
	}
	switch {
	case c.DB < 0:
		return fmt.Errorf("redis.db: must not be negative, got %d", c.DB)
	case c.TLSInsecureSkipVerify && !c.TLS:
		return errors.New("redis.tls_insecure_skip_verify: set without redis.tls")
	case c.TLSCAFile != "" && !c.TLS:
		return errors.New("redis.tls_ca_file: set without redis.tls (a rediss:// URL)")
	case c.TLSCertFile != "" && !c.TLS:
		return errors.New("redis.tls_cert_file: set without redis.tls (a rediss:// URL)")
	case c.DialTimeout < 0:
		return fmt.Errorf("redis.dial_timeout: must not be negative, got %v", c.DialTimeout)
	case c.ReadTimeout < 0:
		return fmt.Errorf("redis.read_timeout: must not be negative, got %v", c.ReadTimeout)
	case c.WriteTimeout < 0:
		return fmt.Errorf("redis.write_timeout: must not be negative, got %v", c.WriteTimeout)
	case c.PoolSize < 0:
		return fmt.Errorf("redis.pool_size: must not be negative, got %d", c.PoolSize)
	}
	if err := c.tlsFiles().Validate("redis", false); err != nil {
		// tlsconf names the fields redis.ca_file…: these are tls_ca_file….
		return errors.New("redis.tls_" + strings.TrimPrefix(err.Error(), "redis."))
	}
	return nil
}

// tlsFiles returns c's TLS files as a tlsconf.Config.
func (c RedisConfig) tlsFiles() tlsconf.Config {
	return tlsconf.Config{CAFile: c.TLSCAFile, CertFile: c.TLSCertFile, KeyFile: c.TLSKeyFile}
}

func validAddr(addr string) error {
	if addr == "" {
		return errors.New("required")
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("want host:port, got %q", addr)
	}
	if host == "" {
		return fmt.Errorf("no host in %q", addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("port must be 1–65535, got %q", port)
	}
	return nil
}

// ParseRedisURL parses what --redis takes: host:port, or
// redis://[user[:password]@]host[:port][/db], or rediss://… for TLS. The
// port defaults to 6379 and the database to 0. Other fields of the result
// are zero (defaults). Errors never repeat the password.
func ParseRedisURL(s string) (RedisConfig, error) {
	if !strings.Contains(s, "://") {
		c := RedisConfig{Addr: s}
		return c, c.Validate()
	}
	u, err := url.Parse(s)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) { // its message quotes the URL, password and all
			err = ue.Err
		}
		return RedisConfig{}, fmt.Errorf("redis url: %w", err)
	}
	var c RedisConfig
	switch u.Scheme {
	case "redis":
	case "rediss":
		c.TLS = true
	default:
		return RedisConfig{}, fmt.Errorf("redis url %s: scheme must be redis or rediss, got %q", u.Redacted(), u.Scheme)
	}
	if u.Opaque != "" || u.Host == "" || u.Hostname() == "" {
		return RedisConfig{}, fmt.Errorf("redis url %s: no host", u.Redacted())
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return RedisConfig{}, fmt.Errorf("redis url %s: query and fragment are not supported", u.Redacted())
	}
	c.Addr = u.Host
	if u.Port() == "" {
		if strings.HasSuffix(u.Host, ":") {
			return RedisConfig{}, fmt.Errorf("redis url %s: empty port", u.Redacted())
		}
		c.Addr = net.JoinHostPort(u.Hostname(), defaultRedisPort)
	}
	if u.User != nil {
		c.Username = u.User.Username()
		c.Password, _ = u.User.Password()
	}
	if db := strings.TrimPrefix(u.Path, "/"); db != "" {
		n, err := strconv.Atoi(db)
		if err != nil || n < 0 {
			return RedisConfig{}, fmt.Errorf("redis url %s: database must be a number ≥ 0, got %q", u.Redacted(), db)
		}
		c.DB = n
	}
	if err := c.Validate(); err != nil {
		return RedisConfig{}, fmt.Errorf("redis url %s: %w", u.Redacted(), err)
	}
	return c, nil
}

// MemoryConfig configures the in-process tier. The zero value means the
// defaults.
type MemoryConfig struct {
	// Capacity bounds the bytes held (values plus a small per-entry
	// overhead); the least recently used blocks go first. Default 1 GiB;
	// ≤ 0 means the default.
	Capacity int64 `yaml:"capacity"`
	// TTL is how long a block stays after its last write, default 1h;
	// negative means no expiry.
	TTL time.Duration `yaml:"ttl"`
}

// DefaultMemoryCapacity is MemoryConfig's default Capacity.
const DefaultMemoryCapacity = 1 << 30

// BreakerConfig configures a Breaker. The zero value means the defaults.
type BreakerConfig struct {
	// Name names the breaker in state-change hooks and errors, default
	// "kvstore".
	Name string `yaml:"name"`
	// Failures is the consecutive failed calls that open the breaker,
	// default 3.
	Failures uint32 `yaml:"failures"`
	// OpenTimeout is how long the breaker stays open before it lets probes
	// through (half-open), default 5s.
	OpenTimeout time.Duration `yaml:"open_timeout"`
	// HalfOpenRequests is the probes let through while half-open, default
	// 1; that many successes close the breaker, one failure opens it again.
	HalfOpenRequests uint32 `yaml:"half_open_requests"`
}

// Defaults of BreakerConfig.
const (
	DefaultBreakerFailures    = 3
	DefaultBreakerOpenTimeout = 5 * time.Second
)

func (c BreakerConfig) withDefaults() BreakerConfig {
	if c.Name == "" {
		c.Name = "kvstore"
	}
	if c.Failures == 0 {
		c.Failures = DefaultBreakerFailures
	}
	if c.OpenTimeout <= 0 {
		c.OpenTimeout = DefaultBreakerOpenTimeout
	}
	if c.HalfOpenRequests == 0 {
		c.HalfOpenRequests = 1
	}
	return c
}

// Validate reports the first invalid field, by its configuration name.
func (c BreakerConfig) Validate() error {
	if c.OpenTimeout < 0 {
		return fmt.Errorf("breaker.open_timeout: must not be negative, got %v", c.OpenTimeout)
	}
	return nil
}
