package kvstore

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/tlsconf"
)

// Redis is the shared tier in a Redis server, through go-redis. Every call
// is one pipelined round trip (plus, rarely, one that deletes bad values).
// It does not retry: an error means the tier is unavailable for now.
type Redis struct {
	client *redis.Client
	ttl    time.Duration // 0: no expiry

	touches atomic.Uint64 // Touch calls, for trimming (hot.go)

	closeOnce sync.Once
	closeErr  error
}

// NewRedis returns a store on the server cfg names. It does not connect:
// connections are made by the first calls, so a Redis that is down at
// start is no reason not to start.
func NewRedis(cfg RedisConfig) (*Redis, error) {
	client, err := NewClient(cfg)
	if err != nil {
		return nil, err
	}
	r := &Redis{client: client}
	if cfg = cfg.withDefaults(); cfg.TTL > 0 {
		r.ttl = cfg.TTL
	}
	return r, nil
}

// NewClient returns a go-redis client of the server cfg names, with the
// store's fail-fast settings: no retries, short timeouts. It does not
// connect.
func NewClient(cfg RedisConfig) (*redis.Client, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	opts := &redis.Options{
		Addr:         cfg.Addr,
		Username:     cfg.Username,
		Password:     cfg.Password,
		DB:           cfg.DB,
		DialTimeout:  cfg.DialTimeout,
		ReadTimeout:  cfg.ReadTimeout,
		WriteTimeout: cfg.WriteTimeout,
		PoolSize:     cfg.PoolSize,
		// Waiting for a free connection is as bounded as reading.
		PoolTimeout:           cfg.ReadTimeout,
		ContextTimeoutEnabled: true,
		// Fail fast: a refused dial or a broken connection is reported
		// at once (go-redis would otherwise retry a dial 5 times, 100ms
		// apart, and a command 3 times); the caller recomputes and the
		// breaker decides when to try again.
		MaxRetries:    -1,
		DialerRetries: 1,
		// No CLIENT SETINFO nor CLIENT MAINT_NOTIFICATIONS on connect: one
		// round trip per new connection, whatever the server version.
		DisableIdentity:          true,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	}
	if cfg.TLS {
		host, _, _ := net.SplitHostPort(cfg.Addr)
		files := cfg.tlsFiles()
		files.ServerName = host
		tc, _, err := tlsconf.Client(files, nil)
		if err != nil {
			return nil, fmt.Errorf("redis.tls_%w", err)
		}
		tc.InsecureSkipVerify = cfg.TLSInsecureSkipVerify // tests only (Validate says so)
		opts.TLSConfig = tc
	}
	return redis.NewClient(opts), nil
}

// ErrRefused is returned (wrapped) by Check when the server refused the
// client: its password (WRONGPASS, NOAUTH), its TLS certificates, or the
// connection itself (a Redis in protected mode reached from another host).
// Unlike an unreachable server, that will not mend itself.
var ErrRefused = errors.New("redis refused the client")

// Check sends one PING. An error wrapping ErrRefused means the password,
// the TLS settings or the server's protected mode turn the client away;
// any other error means the server did not answer, or turned the client
// away for a while (its clients at maxclients), which the error says. A
// worker checks once at start.
func (r *Redis) Check(ctx context.Context) error {
	err := r.client.Ping(ctx).Err()
	if err == nil {
		return nil
	}
	var (
		unknownCA *x509.UnknownAuthorityError
		hostname  x509.HostnameError
		verify    *tls.CertificateVerificationError
		alert     tls.AlertError
		remote    *net.OpError
	)
	msg := err.Error()
	switch {
	case strings.HasPrefix(msg, "WRONGPASS"), strings.HasPrefix(msg, "NOAUTH"),
		strings.Contains(msg, "AUTH") && strings.Contains(msg, "without any password configured"):
		return fmt.Errorf("%w: password: %v", ErrRefused, err)
	case errors.As(err, &unknownCA), errors.As(err, &hostname), errors.As(err, &verify), errors.As(err, &alert),
		errors.As(err, &remote) && strings.Contains(remote.Err.Error(), "remote error: tls"):
		return fmt.Errorf("%w: tls: %v", ErrRefused, err)
	}
	o := r.client.Options()
	if o.TLSConfig == nil && Closed(err) {
		switch why := TurnedAway(ctx, o.Addr); {
		case why != nil && strings.HasPrefix(why.Error(), "DENIED"):
			// Protected mode: the server's settings, not its load.
			return fmt.Errorf("%w: connection: %v", ErrRefused, why)
		case why != nil:
			// Its clients at maxclients, say: that passes.
			return fmt.Errorf("redis at %s: %w; the server said: %v", o.Addr, err, why)
		}
	}
	return fmt.Errorf("redis at %s: %w", o.Addr, err)
}

// Closed reports whether err is a connection the server closed (EOF, a
// reset, a broken pipe): what go-redis reports of a server that said why
// it turned the connection away and closed it, since its handshake goes
// on past the reason.
func Closed(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// TurnedAway connects to the Redis at addr over plain TCP, sends a PING
// and returns the error reply the server sends before closing the
// connection, as the reason it turns clients away: DENIED from a Redis in
// protected mode (no password set, the default) to a client on another
// host, "ERR max number of clients reached". Nil when the server answers
// the PING, asks for a password (which Check reports itself), cannot be
// reached, or says nothing before ctx's deadline or a second.
func TurnedAway(ctx context.Context, addr string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	c.SetDeadline(deadline)
	// The server may have closed already: its reason is read after a
	// failed write too.
	c.Write([]byte("*1\r\n$4\r\nPING\r\n"))
	line, _ := bufio.NewReaderSize(c, 1024).ReadString('\n')
	line = strings.TrimRight(line, "\r\n")
	if !strings.HasPrefix(line, "-") || strings.HasPrefix(line, "-NOAUTH") {
		return nil
	}
	return errors.New(line[1:])
}

// Put writes blocks with one pipelined SET … EX per block, in one round
// trip. The values are encoded into one buffer for the whole call.
func (r *Redis) Put(ctx context.Context, ns transfer.Namespace, blocks []transfer.Block) error {
	if len(blocks) == 0 {
		return nil
	}
	n := 0
	for _, b := range blocks {
		n += valueSize(len(b.Data))
	}
	buf := make([]byte, n)
	pipe := r.client.Pipeline()
	for _, b := range blocks {
		v := encode(buf, b.Data)
		buf = buf[len(v):]
		pipe.Set(ctx, transfer.StoreKey(ns, b.Key), v, r.ttl)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("redis put of %d blocks: %w", len(blocks), err)
	}
	return nil
}

// Get fetches keys with pipelined GETs in one round trip. The payloads it
// returns alias go-redis's read buffers: no copy after the socket read. A
// value that fails verification is deleted (best effort, one more round
// trip) and reported as missing.
func (r *Redis) Get(ctx context.Context, ns transfer.Namespace, keys []uint64, size int) ([][]byte, error) {
	data := make([][]byte, len(keys))
	if len(keys) == 0 {
		return data, nil
	}
	pipe := r.client.Pipeline()
	cmds := make([]*redis.StringCmd, len(keys))
	for i, k := range keys {
		cmds[i] = pipe.Get(ctx, transfer.StoreKey(ns, k))
	}
	// Exec reports the first failed command, and a missing key is one
	// (redis.Nil); the loop below tells them apart.
	_, _ = pipe.Exec(ctx)
	var bad []string
	for i, cmd := range cmds {
		v, err := cmd.Bytes()
		switch {
		case errors.Is(err, redis.Nil):
			continue
		case err != nil:
			return nil, fmt.Errorf("redis get of %d blocks: %w", len(keys), err)
		}
		p, err := decode(keys[i], v, size)
		if err != nil {
			bad = append(bad, transfer.StoreKey(ns, keys[i]))
			continue
		}
		data[i] = p
	}
	if len(bad) > 0 {
		// Best effort: a value that failed to delete fails again next time.
		_ = r.client.Del(ctx, bad...).Err()
	}
	return data, nil
}

// Exists reports which keys are present, with pipelined EXISTS in one
// round trip.
func (r *Redis) Exists(ctx context.Context, ns transfer.Namespace, keys []uint64) ([]bool, error) {
	ok := make([]bool, len(keys))
	if len(keys) == 0 {
		return ok, nil
	}
	pipe := r.client.Pipeline()
	cmds := make([]*redis.IntCmd, len(keys))
	for i, k := range keys {
		cmds[i] = pipe.Exists(ctx, transfer.StoreKey(ns, k))
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("redis exists of %d keys: %w", len(keys), err)
	}
	for i, cmd := range cmds {
		ok[i] = cmd.Val() > 0
	}
	return ok, nil
}

// Ping checks that the server answers, for readiness reports.
func (r *Redis) Ping(ctx context.Context) error {
	if err := r.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("redis ping: %w", err)
	}
	return nil
}

// Close closes the connections. It is idempotent; calls after it fail.
func (r *Redis) Close() error {
	r.closeOnce.Do(func() { r.closeErr = r.client.Close() })
	return r.closeErr
}

var _ transfer.Store = (*Redis)(nil)
