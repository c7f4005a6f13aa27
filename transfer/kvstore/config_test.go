package kvstore_test

import (
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/batonllm/baton/transfer/kvstore"
)

func TestRedisConfigValidate(t *testing.T) {
	valid := kvstore.RedisConfig{Addr: "127.0.0.1:6379"}
	tests := []struct {
		name    string
		edit    func(c *kvstore.RedisConfig)
		wantErr string // "" for valid; else a prefix of the error
	}{
		{name: "minimal", edit: func(*kvstore.RedisConfig) {}},
		{name: "everything", edit: func(c *kvstore.RedisConfig) {
			*c = kvstore.RedisConfig{Addr: "redis.internal:6380", Username: "baton", Password: "p", DB: 3,
				TLS: true, TLSInsecureSkipVerify: true, TTL: time.Minute, DialTimeout: time.Second,
				ReadTimeout: time.Second, WriteTimeout: time.Second, PoolSize: 64}
		}},
		{name: "no expiry", edit: func(c *kvstore.RedisConfig) { c.TTL = -1 }},
		{name: "ipv6", edit: func(c *kvstore.RedisConfig) { c.Addr = "[::1]:6379" }},
		{name: "no addr", edit: func(c *kvstore.RedisConfig) { c.Addr = "" }, wantErr: "redis.addr: required"},
		{name: "no port", edit: func(c *kvstore.RedisConfig) { c.Addr = "localhost" }, wantErr: "redis.addr: want host:port"},
		{name: "no host", edit: func(c *kvstore.RedisConfig) { c.Addr = ":6379" }, wantErr: "redis.addr: no host"},
		{name: "port 0", edit: func(c *kvstore.RedisConfig) { c.Addr = "h:0" }, wantErr: "redis.addr: port must be"},
		{name: "port too big", edit: func(c *kvstore.RedisConfig) { c.Addr = "h:65536" }, wantErr: "redis.addr: port must be"},
		{name: "port name", edit: func(c *kvstore.RedisConfig) { c.Addr = "h:redis" }, wantErr: "redis.addr: port must be"},
		{name: "negative db", edit: func(c *kvstore.RedisConfig) { c.DB = -1 }, wantErr: "redis.db:"},
		{name: "skip verify without tls", edit: func(c *kvstore.RedisConfig) { c.TLSInsecureSkipVerify = true }, wantErr: "redis.tls_insecure_skip_verify:"},
		{name: "negative dial timeout", edit: func(c *kvstore.RedisConfig) { c.DialTimeout = -time.Second }, wantErr: "redis.dial_timeout:"},
		{name: "negative read timeout", edit: func(c *kvstore.RedisConfig) { c.ReadTimeout = -time.Second }, wantErr: "redis.read_timeout:"},
		{name: "negative write timeout", edit: func(c *kvstore.RedisConfig) { c.WriteTimeout = -time.Second }, wantErr: "redis.write_timeout:"},
		{name: "negative pool size", edit: func(c *kvstore.RedisConfig) { c.PoolSize = -1 }, wantErr: "redis.pool_size:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := valid
			tt.edit(&c)
			err := c.Validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("Validate() = %v, want nil", err)
			case tt.wantErr != "" && (err == nil || !strings.HasPrefix(err.Error(), tt.wantErr)):
				t.Errorf("Validate() = %v, want an error starting %q", err, tt.wantErr)
			}
		})
	}
}

func TestBreakerConfigValidate(t *testing.T) {
	if err := (kvstore.BreakerConfig{}).Validate(); err != nil {
		t.Errorf("zero config: %v", err)
	}
	err := kvstore.BreakerConfig{OpenTimeout: -time.Second}.Validate()
	if err == nil || !strings.HasPrefix(err.Error(), "breaker.open_timeout:") {
		t.Errorf("negative open timeout: error %v, want one naming breaker.open_timeout", err)
	}
}

func TestParseRedisURL(t *testing.T) {
	tests := []struct {
		in      string
		want    kvstore.RedisConfig
		wantErr string // a substring of the error
	}{
		{in: "127.0.0.1:6379", want: kvstore.RedisConfig{Addr: "127.0.0.1:6379"}},
		{in: "redis.internal:6380", want: kvstore.RedisConfig{Addr: "redis.internal:6380"}},
		{in: "[::1]:6379", want: kvstore.RedisConfig{Addr: "[::1]:6379"}},
		{in: "redis://localhost", want: kvstore.RedisConfig{Addr: "localhost:6379"}},
		{in: "redis://localhost/", want: kvstore.RedisConfig{Addr: "localhost:6379"}},
		{in: "redis://localhost:7000/2", want: kvstore.RedisConfig{Addr: "localhost:7000", DB: 2}},
		{in: "redis://:secret@localhost:7000", want: kvstore.RedisConfig{Addr: "localhost:7000", Password: "secret"}},
		{in: "redis://baton:s%40cret@localhost:7000/1", want: kvstore.RedisConfig{Addr: "localhost:7000", Username: "baton", Password: "s@cret", DB: 1}},
		{in: "redis://baton@localhost", want: kvstore.RedisConfig{Addr: "localhost:6379", Username: "baton"}},
		{in: "rediss://cache.example.com:6380/0", want: kvstore.RedisConfig{Addr: "cache.example.com:6380", TLS: true}},
		{in: "rediss://[::1]", want: kvstore.RedisConfig{Addr: "[::1]:6379", TLS: true}},

		{in: "", wantErr: "redis.addr: required"},
		{in: "localhost", wantErr: "redis.addr: want host:port"},
		{in: "localhost:0", wantErr: "redis.addr: port must be"},
		{in: "http://localhost:6379", wantErr: "scheme must be redis or rediss"},
		{in: "redis://", wantErr: "no host"},
		{in: "redis://:6379", wantErr: "no host"},
		{in: "redis://localhost:/", wantErr: "empty port"},
		{in: "redis://localhost:99999", wantErr: "port must be"},
		{in: "redis://localhost/db", wantErr: "database must be a number"},
		{in: "redis://localhost/-1", wantErr: "database must be a number"},
		{in: "redis://localhost/1/2", wantErr: "database must be a number"},
		{in: "redis://localhost?dial_timeout=1s", wantErr: "query and fragment are not supported"},
		{in: "redis://localhost#x", wantErr: "query and fragment are not supported"},
		{in: "redis://u:secret@localhost/x", wantErr: "redis url redis://u:xxxxx@localhost/x: database"},
		{in: "redis://u:sec ret@local host", wantErr: "redis url"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := kvstore.ParseRedisURL(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ParseRedisURL(%q) = %+v, %v; want an error containing %q", tt.in, got, err, tt.wantErr)
				}
				if strings.Contains(err.Error(), "secret") || strings.Contains(err.Error(), "sec ret") {
					t.Errorf("error %q repeats the password", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseRedisURL(%q): %v", tt.in, err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("ParseRedisURL(%q) (-want +got):\n%s", tt.in, diff)
			}
		})
	}
}
