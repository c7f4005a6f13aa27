package transfer

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"go.uber.org/goleak"

	"github.com/batonllm/baton/transfer/kvblock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// mkTransport starts a receiver for recv and returns a transport (built
// with opts) and the receiver's address; both are cleaned up with t.
type mkTransport func(t *testing.T, recv Receiver, opts ...Option) (tr Transport, addr string)

// finish is one call of Receiver.Finish.
type finish struct {
	Accepted, Rejected int
	Err                error
}

// recorder is a Receiver that records what it is given and checks each
// accepted block's contents against its key.
type recorder struct {
	mu       sync.Mutex
	held     map[uint64]bool
	accepted map[string][]uint64 // by transfer, in order
	bad      []string            // blocks accepted with wrong contents
	finished map[string][]finish
	finish1  chan struct{}               // closed and replaced at each Finish
	onAccept func(id string, key uint64) // called unlocked, if set
}

func newRecorder() *recorder {
	return &recorder{
		held:     make(map[uint64]bool),
		accepted: make(map[string][]uint64),
		finished: make(map[string][]finish),
		finish1:  make(chan struct{}),
	}
}

func (r *recorder) Has(keys []uint64) []bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]bool, len(keys))
	for i, k := range keys {
		out[i] = r.held[k]
	}
	return out
}

func (r *recorder) Accept(id string, key uint64, data []byte) {
	want := make([]byte, len(data))
	kvblock.Fill(want, key)
	r.mu.Lock()
	if !bytes.Equal(data, want) {
		r.bad = append(r.bad, fmt.Sprintf("%s/%x (%d bytes)", id, key, len(data)))
	}
	r.accepted[id] = append(r.accepted[id], key)
	hook := r.onAccept
	r.mu.Unlock()
	if hook != nil {
		hook(id, key)
	}
}

func (r *recorder) Finish(id string, accepted, rejected int, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.finished[id] = append(r.finished[id], finish{accepted, rejected, err})
	close(r.finish1)
	r.finish1 = make(chan struct{})
}

// finishes returns the Finish calls of transfer id, waiting up to 5 s for
// the first.
func (r *recorder) finishes(t *testing.T, id string) []finish {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		r.mu.Lock()
		f := append([]finish(nil), r.finished[id]...)
		next := r.finish1
		r.mu.Unlock()
		if len(f) > 0 {
			return f
		}
		select {
		case <-next:
		case <-timeout:
			return nil
		}
	}
}

func (r *recorder) acceptedKeys(id string) []uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]uint64(nil), r.accepted[id]...)
}

func (r *recorder) check(t *testing.T) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.bad) > 0 {
		t.Errorf("blocks accepted with wrong contents: %v", r.bad)
	}
}

// makeBlocks returns one block per size, keys base, base+1, ...
func makeBlocks(base uint64, sizes ...int) []Block {
	blocks := make([]Block, len(sizes))
	for i, n := range sizes {
		b := Block{Key: base + uint64(i)*0x9e3779b97f4a7c15, Data: make([]byte, n)}
		kvblock.Fill(b.Data, b.Key)
		blocks[i] = b
	}
	return blocks
}

func keysOf(blocks []Block) []uint64 {
	keys := make([]uint64, len(blocks))
	for i, b := range blocks {
		keys[i] = b.Key
	}
	return keys
}

func totalBytes(blocks []Block) int64 {
	var n int64
	for _, b := range blocks {
		n += int64(len(b.Data))
	}
	return n
}

// deadAddr returns a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// Block sizes of the round trip: tiny, typical scaled, real-sized, and
// sizes that are not multiples of the default chunk.
var roundTripSizes = []int{64, 4 << 10, 32 << 10, 64 << 10, 1 << 20, 1<<20 + 8, 5<<19 + 24, 4 << 20}

// testTransport is the behaviour every Transport shares.
func testTransport(t *testing.T, mk mkTransport) {
	t.Run("RoundTrip", func(t *testing.T) {
		for _, tc := range []struct {
			name string
			opts []Option
		}{
			{"default chunks", nil},
			{"small chunks", []Option{WithChunkBytes(4 << 10)}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				recv := newRecorder()
				tr, addr := mk(t, recv, tc.opts...)
				blocks := makeBlocks(1, roundTripSizes...)
				got, err := tr.Push(t.Context(), addr, "t1", blocks)
				if err != nil {
					t.Fatalf("Push: %v", err)
				}
				want := PushStats{Accepted: len(blocks), Bytes: totalBytes(blocks)}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("Push stats (-want +got):\n%s", diff)
				}
				if diff := cmp.Diff(keysOf(blocks), recv.acceptedKeys("t1")); diff != "" {
					t.Errorf("accepted keys (-want +got):\n%s", diff)
				}
				if diff := cmp.Diff([]finish{{Accepted: len(blocks)}}, recv.finishes(t, "t1"), cmpFinish); diff != "" {
					t.Errorf("Finish calls (-want +got):\n%s", diff)
				}
				recv.check(t)
			})
		}
	})

	t.Run("PushFill", func(t *testing.T) {
		for _, size := range []int{64, 32 << 10, 1<<20 + 8} {
			t.Run(fmt.Sprint(size, " bytes"), func(t *testing.T) {
				recv := newRecorder()
				tr, addr := mk(t, recv, WithChunkBytes(16<<10))
				blocks := makeBlocks(7, size, size, size, size)
				fp, ok := tr.(FillPusher)
				if !ok {
					t.Fatalf("%T is no FillPusher", tr)
				}
				got, err := fp.PushFill(t.Context(), addr, "f1", keysOf(blocks), size, kvblock.Fill)
				if err != nil {
					t.Fatalf("PushFill: %v", err)
				}
				want := PushStats{Accepted: len(blocks), Bytes: totalBytes(blocks)}
				if diff := cmp.Diff(want, got); diff != "" {
					t.Errorf("PushFill stats (-want +got):\n%s", diff)
				}
				if diff := cmp.Diff(keysOf(blocks), recv.acceptedKeys("f1")); diff != "" {
					t.Errorf("accepted keys (-want +got):\n%s", diff)
				}
				if diff := cmp.Diff([]finish{{Accepted: len(blocks)}}, recv.finishes(t, "f1"), cmpFinish); diff != "" {
					t.Errorf("Finish calls (-want +got):\n%s", diff)
				}
				recv.check(t)
			})
		}
		t.Run("invalid", func(t *testing.T) {
			tr, addr := mk(t, newRecorder())
			for _, tc := range []struct {
				name string
				id   string
				size int
			}{{"empty transfer id", "", 64}, {"empty blocks", "f", 0}} {
				if _, err := PushFill(t.Context(), tr, addr, tc.id, []uint64{1}, tc.size, kvblock.Fill); err == nil {
					t.Errorf("%s: PushFill succeeded, want an error", tc.name)
				}
			}
		})
	})

	t.Run("NoBlocks", func(t *testing.T) {
		recv := newRecorder()
		tr, addr := mk(t, recv)
		got, err := tr.Push(t.Context(), addr, "empty", nil)
		if err != nil {
			t.Fatalf("Push: %v", err)
		}
		if diff := cmp.Diff(PushStats{}, got); diff != "" {
			t.Errorf("Push stats (-want +got):\n%s", diff)
		}
		if diff := cmp.Diff([]finish{{}}, recv.finishes(t, "empty"), cmpFinish); diff != "" {
			t.Errorf("Finish calls (-want +got):\n%s", diff)
		}
	})

	t.Run("InvalidPush", func(t *testing.T) {
		for _, tc := range []struct {
			name   string
			id     string
			blocks []Block
		}{
			{"empty transfer id", "", makeBlocks(1, 64)},
			{"empty block", "t", []Block{{Key: 1}}},
		} {
			t.Run(tc.name, func(t *testing.T) {
				recv := newRecorder()
				tr, addr := mk(t, recv)
				if _, err := tr.Push(t.Context(), addr, tc.id, tc.blocks); err == nil {
					t.Errorf("Push succeeded, want an error")
				}
			})
		}
	})

	t.Run("Has", func(t *testing.T) {
		recv := newRecorder()
		recv.held[10], recv.held[30] = true, true
		tr, addr := mk(t, recv)
		for _, tc := range []struct {
			keys []uint64
			want []bool
		}{
			{[]uint64{10, 20, 30}, []bool{true, false, true}},
			{[]uint64{20}, []bool{false}},
			{nil, nil},
		} {
			got, err := tr.Has(t.Context(), addr, tc.keys)
			if err != nil {
				t.Fatalf("Has(%v): %v", tc.keys, err)
			}
			if diff := cmp.Diff(tc.want, got, cmpEmpty); diff != "" {
				t.Errorf("Has(%v) (-want +got):\n%s", tc.keys, diff)
			}
		}
	})

	t.Run("Corrupt", func(t *testing.T) {
		blocks := makeBlocks(100, 64<<10, 1<<20+8, 64<<10, 3<<20, 64)
		bad := blocks[1].Key
		for _, tc := range []struct {
			name  string
			fault func([]byte) []byte
		}{
			{"flipped byte", func(d []byte) []byte { d[len(d)/2] ^= 0x40; return d }},
			{"flipped first byte", func(d []byte) []byte { d[0] ^= 1; return d }},
			{"truncated", func(d []byte) []byte { return d[:len(d)-8] }},
			{"truncated to a chunk", func(d []byte) []byte { return d[:1<<20] }},
			{"emptied", func(d []byte) []byte { return d[:0] }},
			{"extended", func(d []byte) []byte { return append(d, 1, 2, 3) }},
			{"replaced by the next block", func([]byte) []byte { return append([]byte(nil), blocks[2].Data...) }},
		} {
			t.Run(tc.name, func(t *testing.T) {
				recv := newRecorder()
				tr, addr := mk(t, recv, WithFault(func(key uint64, data []byte) []byte {
					if key == bad {
						return tc.fault(data)
					}
					return data
				}))
				got, err := tr.Push(t.Context(), addr, "c", blocks)
				if err != nil {
					t.Fatalf("Push: %v", err)
				}
				if got.Accepted != len(blocks)-1 || got.Rejected != 1 {
					t.Errorf("Push stats = %+v, want %d accepted, 1 rejected", got, len(blocks)-1)
				}
				want := append(keysOf(blocks[:1]), keysOf(blocks[2:])...)
				if diff := cmp.Diff(want, recv.acceptedKeys("c")); diff != "" {
					t.Errorf("accepted keys (-want +got):\n%s", diff)
				}
				if diff := cmp.Diff([]finish{{Accepted: len(blocks) - 1, Rejected: 1}}, recv.finishes(t, "c"), cmpFinish); diff != "" {
					t.Errorf("Finish calls (-want +got):\n%s", diff)
				}
				recv.check(t)
				// The caller's blocks are untouched by the fault.
				for _, b := range blocks {
					if err := kvblock.Verify(b.Key, b.Data, len(b.Data), kvblock.Checksum(b.Data)); err != nil {
						t.Errorf("caller's block %x changed: %v", b.Key, err)
					}
				}
			})
		}
	})

	t.Run("Stalled", func(t *testing.T) {
		for _, stalled := range []int{0, 1} {
			t.Run(fmt.Sprint("block ", stalled), func(t *testing.T) {
				recv := newRecorder()
				blocks := makeBlocks(200, 64<<10, 64<<10, 64<<10)
				tr, addr := mk(t, recv, WithDelay(func(key uint64) time.Duration {
					if key == blocks[stalled].Key {
						return time.Hour
					}
					return 0
				}))
				ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
				defer cancel()
				start := time.Now()
				_, err := tr.Push(ctx, addr, "s", blocks)
				if !errors.Is(err, context.DeadlineExceeded) {
					t.Errorf("Push error = %v, want context.DeadlineExceeded", err)
				}
				if d := time.Since(start); d > 3*time.Second {
					t.Errorf("Push returned after %v, want soon after the 200ms deadline", d)
				}
				f := recv.finishes(t, "s")
				if len(f) != 1 || f[0].Err == nil || f[0].Accepted > stalled {
					t.Errorf("Finish calls = %+v, want one with an error after at most %d blocks", f, stalled)
				}
			})
		}
	})

	t.Run("Cancelled", func(t *testing.T) {
		recv := newRecorder()
		blocks := makeBlocks(300, 256<<10, 256<<10, 256<<10, 256<<10)
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		// The first block's acceptance cancels the push; the third block
		// is held back so the push cannot end before the cancellation.
		recv.onAccept = func(_ string, key uint64) {
			if key == blocks[0].Key {
				cancel()
			}
		}
		tr, addr := mk(t, recv, WithDelay(func(key uint64) time.Duration {
			if key == blocks[2].Key {
				return time.Hour
			}
			return 0
		}))
		_, err := tr.Push(ctx, addr, "x", blocks)
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Push error = %v, want context.Canceled", err)
		}
		f := recv.finishes(t, "x")
		if len(f) != 1 || f[0].Err == nil || f[0].Accepted < 1 || f[0].Accepted > 2 {
			t.Errorf("Finish calls = %+v, want one with an error after 1 or 2 blocks", f)
		}
		recv.check(t)
	})

	t.Run("Unreachable", func(t *testing.T) {
		tr, _ := mk(t, newRecorder())
		addr := deadAddr(t)
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		if _, err := tr.Push(ctx, addr, "u", makeBlocks(1, 64)); !errors.Is(err, ErrUnreachable) {
			t.Errorf("Push to %s: error = %v, want ErrUnreachable", addr, err)
		}
		if _, err := tr.Has(ctx, addr, []uint64{1}); !errors.Is(err, ErrUnreachable) {
			t.Errorf("Has at %s: error = %v, want ErrUnreachable", addr, err)
		}
	})

	t.Run("Concurrent", func(t *testing.T) {
		recv := newRecorder()
		tr, addr := mk(t, recv)
		const pushes = 8
		var wg sync.WaitGroup
		errs := make([]error, pushes)
		all := make([][]Block, pushes)
		for i := range pushes {
			all[i] = makeBlocks(uint64(1000*i), 64<<10, 32<<10, 1<<20+64, 64<<10, 64)
			wg.Go(func() {
				_, errs[i] = tr.Push(t.Context(), addr, fmt.Sprint("p", i), all[i])
			})
		}
		wg.Wait()
		for i := range pushes {
			id := fmt.Sprint("p", i)
			if errs[i] != nil {
				t.Errorf("Push %s: %v", id, errs[i])
			}
			if diff := cmp.Diff(keysOf(all[i]), recv.acceptedKeys(id)); diff != "" {
				t.Errorf("accepted keys of %s (-want +got):\n%s", id, diff)
			}
			if diff := cmp.Diff([]finish{{Accepted: len(all[i])}}, recv.finishes(t, id), cmpFinish); diff != "" {
				t.Errorf("Finish calls of %s (-want +got):\n%s", id, diff)
			}
		}
		recv.check(t)
	})

	t.Run("Close", func(t *testing.T) {
		recv := newRecorder()
		tr, addr := mk(t, recv)
		if _, err := tr.Push(t.Context(), addr, "before", makeBlocks(1, 64)); err != nil {
			t.Fatalf("Push before Close: %v", err)
		}
		for i := range 2 {
			if err := tr.Close(); err != nil {
				t.Errorf("Close #%d: %v", i+1, err)
			}
		}
		if _, err := tr.Push(t.Context(), addr, "after", makeBlocks(1, 64)); !errors.Is(err, ErrClosed) {
			t.Errorf("Push after Close: error = %v, want ErrClosed", err)
		}
		if _, err := tr.Has(t.Context(), addr, []uint64{1}); !errors.Is(err, ErrClosed) {
			t.Errorf("Has after Close: error = %v, want ErrClosed", err)
		}
	})
}

// cmpFinish compares Finish calls by whether their error is nil.
var cmpFinish = cmp.Comparer(func(a, b error) bool { return (a == nil) == (b == nil) })

// cmpEmpty equates nil and empty slices.
var cmpEmpty = cmp.Comparer(func(a, b []bool) bool { return len(a) == 0 && len(b) == 0 || cmp.Equal(a, b) })
