package transfer

import (
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
)

// discard is a Receiver that keeps nothing.
type discard struct{}

func (discard) Has(keys []uint64) []bool       { return make([]bool, len(keys)) }
func (discard) Accept(string, uint64, []byte)  {}
func (discard) Finish(string, int, int, error) {}

// benchPushBytes is the payload of one op of BenchmarkPush: enough blocks
// of the size under test to make it up.
const benchPushBytes = 64 << 20

var benchBlockSizes = []struct {
	name string
	size int
}{
	{"64KiB", 64 << 10},
	{"1MiB", 1 << 20},
	{"4MiB", 4 << 20},
}

// BenchmarkPush compares pushing blocks over the gRPC transport (chunked,
// checksummed by the sender, reassembled and verified by the receiver)
// with writing the same bytes to a raw loopback TCP socket that the
// server reads and drops: the cost of the transport over the wire itself.
// Each op moves benchPushBytes and waits for the receiver to have read
// them all.
func BenchmarkPush(b *testing.B) {
	for _, bs := range benchBlockSizes {
		blocks := makeBlocks(1, repeat(bs.size, benchPushBytes/bs.size)...)
		b.Run("grpc/block="+bs.name, func(b *testing.B) {
			benchGRPC(b, blocks)
		})
		b.Run("tcp/block="+bs.name, func(b *testing.B) {
			benchTCP(b, blocks)
		})
	}
}

func benchGRPC(b *testing.B, blocks []Block, opts ...Option) {
	benchGRPCServer(b, blocks, ServerOptions(), opts...)
}

func benchGRPCServer(b *testing.B, blocks []Block, gopts []grpc.ServerOption, opts ...Option) {
	addr := serveGRPC(b, discard{}, gopts)
	tr := NewGRPC(opts...)
	b.Cleanup(func() { tr.Close() })
	push := func() {
		st, err := tr.Push(b.Context(), addr, "bench", blocks)
		if err != nil {
			b.Fatal(err)
		}
		if st.Accepted != len(blocks) {
			b.Fatalf("accepted %d of %d blocks", st.Accepted, len(blocks))
		}
	}
	push() // connect and warm up
	b.SetBytes(totalBytes(blocks))
	b.ReportAllocs()
	b.ResetTimer()
	cpu := cpuTime()
	for b.Loop() {
		push()
	}
	reportCPU(b, cpu, totalBytes(blocks))
}

// cpuTime is the CPU time (user and system) the process has used.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// reportCPU reports the CPU time, sender's and receiver's together, spent
// per byte moved since start: unlike MB/s, it barely depends on what else
// the machine runs, so it compares transports on a busy machine.
func reportCPU(b *testing.B, start time.Duration, bytesPerOp int64) {
	if n := b.N; n > 0 && bytesPerOp > 0 {
		b.ReportMetric(float64(cpuTime()-start)/float64(int64(n)*bytesPerOp), "cpu-ns/B")
	}
}

// benchTCP writes the blocks to one loopback connection; the server reads
// an op's bytes with a 256 KiB buffer (the gRPC server's read buffer,
// ServerReadBufferBytes) and answers with one byte.
func benchTCP(b *testing.B, blocks []Block) {
	total := totalBytes(blocks)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, ServerReadBufferBytes)
		for {
			for n := int64(0); n < total; {
				k, err := c.Read(buf[:min(int64(len(buf)), total-n)])
				if err != nil {
					return
				}
				n += int64(k)
			}
			if _, err := c.Write([]byte{1}); err != nil {
				return
			}
		}
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		c.Close()
		l.Close()
		<-done
	})
	var ack [1]byte
	push := func() {
		for _, blk := range blocks {
			if _, err := c.Write(blk.Data); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := io.ReadFull(c, ack[:]); err != nil {
			b.Fatal(err)
		}
	}
	push()
	b.SetBytes(total)
	b.ReportAllocs()
	b.ResetTimer()
	cpu := cpuTime()
	for b.Loop() {
		push()
	}
	reportCPU(b, cpu, total)
}

func repeat(v, n int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = v
	}
	return s
}

// BenchmarkPushTuning pushes 1 MiB blocks over gRPC with settings other
// than the defaults, to justify the defaults.
func BenchmarkPushTuning(b *testing.B) {
	blocks := makeBlocks(1, repeat(1<<20, benchPushBytes/(1<<20))...)
	server := func(extra ...grpc.ServerOption) []grpc.ServerOption {
		return append(ServerOptions(), extra...)
	}
	for _, tc := range []struct {
		name   string
		server []grpc.ServerOption
		opts   []Option
	}{
		{"defaults", server(), nil},
		{"proto codec", server(), []Option{WithProtoCodec()}},
		{"chunk=256KiB", server(), []Option{WithChunkBytes(256 << 10)}},
		{"chunk=2MiB", server(), []Option{WithChunkBytes(2 << 20)}},
		{"chunk=3MiB", server(), []Option{WithChunkBytes(3 << 20)}},
		{"grpc default server windows", nil, nil},
		{"server window=16MiB", server(grpc.InitialWindowSize(16<<20), grpc.InitialConnWindowSize(64<<20)), nil},
		{"server read buffer=32KiB", server(grpc.ReadBufferSize(32 << 10)), nil},
		{"server read buffer=1MiB", server(grpc.ReadBufferSize(1 << 20)), nil},
		{"client write buffer=32KiB", server(), []Option{WithDialOptions(grpc.WithWriteBufferSize(32 << 10))}},
		{"client write buffer=256KiB", server(), []Option{WithDialOptions(grpc.WithWriteBufferSize(256 << 10))}},
		{"client write buffer=1MiB", server(), []Option{WithDialOptions(grpc.WithWriteBufferSize(1 << 20))}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			benchGRPCServer(b, blocks, tc.server, tc.opts...)
		})
	}
}
