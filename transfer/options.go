package transfer

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
)

// ErrClosed is returned (wrapped) by a transport's methods after Close.
var ErrClosed = errors.New("transfer transport closed")

// DefaultChunkBytes is the default payload bytes per message of a push
// (see WithChunkBytes). A quarter of gRPC's default 4 MiB maximum received
// message, so any KVTransfer server accepts it without configuration, and
// large enough that the fixed cost of a message (encoding, a SendMsg, the
// receiver's per-message work) is small beside the cost of moving its
// bytes: on loopback 256 KiB chunks were slower and 2 or 3 MiB no faster
// (BenchmarkPushTuning).
const DefaultChunkBytes = 1 << 20

// defaultKeepalive is workers/grpcworker.DefaultKeepalive, copied because
// transfer must not import workers (which import transfer): a ping every
// 30 s without traffic, a dead peer detected within 40 s. Workers already
// install the matching enforcement policy (grpcworker.KeepaliveEnforcement).
var defaultKeepalive = keepalive.ClientParameters{
	Time:                30 * time.Second,
	Timeout:             10 * time.Second,
	PermitWithoutStream: false,
}

// Option configures a sending transport (NewGRPC, InMem.Transport). The
// fault-injection options apply to both; the others only to gRPC.
type Option func(*options)

type options struct {
	chunk     int
	creds     credentials.TransportCredentials
	keepalive keepalive.ClientParameters
	codec     bool
	extra     []grpc.DialOption

	fault func(key uint64, data []byte) []byte
	delay func(key uint64) time.Duration
}

func defaultOptions() options {
	return options{
		chunk:     DefaultChunkBytes,
		creds:     insecure.NewCredentials(),
		keepalive: defaultKeepalive,
		codec:     true,
	}
}

func buildOptions(opts []Option) options {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if o.chunk <= 0 {
		o.chunk = DefaultChunkBytes
	}
	return o
}

// WithChunkBytes sets the payload bytes per message (default
// DefaultChunkBytes). It must stay below the receiver's maximum received
// message size (gRPC's default: 4 MiB) less a few bytes of header.
func WithChunkBytes(n int) Option { return func(o *options) { o.chunk = n } }

// WithTransportCredentials sets the transport credentials, for TLS
// (credentials.NewTLS). The default is insecure: workers sit on loopback or
// on the cluster's internal network.
func WithTransportCredentials(c credentials.TransportCredentials) Option {
	return func(o *options) { o.creds = c }
}

// WithKeepalive replaces the default client keepalive (that of
// workers/grpcworker.DefaultKeepalive).
func WithKeepalive(p keepalive.ClientParameters) Option {
	return func(o *options) { o.keepalive = p }
}

// WithProtoCodec makes pushes use the standard protobuf codec instead of
// the default "batonkv" codec, which spares the receiver a copy and an
// allocation per chunk. For comparison and for receivers that are not
// baton's GRPCServer (the wire format is the same protobuf either way).
func WithProtoCodec() Option { return func(o *options) { o.codec = false } }

// WithDialOptions appends raw gRPC dial options (interceptors, stats
// handlers, buffer sizes), applied after the ones this package sets.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.extra = append(o.extra, opts...) }
}

// WithFault installs a fault injector, for tests: fault gets a copy of each
// block's bytes after its checksum has been computed and returns the bytes
// to send instead (flip a byte to corrupt the block in flight, return fewer
// bytes to truncate it).
func WithFault(fault func(key uint64, data []byte) []byte) Option {
	return func(o *options) { o.fault = fault }
}

// WithDelay installs a stall, for tests: before sending each block, the
// push waits delay(key), or until its context is done.
func WithDelay(delay func(key uint64) time.Duration) Option {
	return func(o *options) { o.delay = delay }
}

// sleep waits d or until ctx is done.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// faulted returns the bytes to send for a block: its data, or what the
// fault injector makes of a copy of it.
func (o *options) faulted(b Block) []byte {
	if o.fault == nil {
		return b.Data
	}
	return o.fault(b.Key, append([]byte(nil), b.Data...))
}
