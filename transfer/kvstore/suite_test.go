package kvstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/batonllm/baton/transfer"
	"github.com/batonllm/baton/transfer/kvblock"
	"github.com/batonllm/baton/transfer/kvstore"
	"github.com/batonllm/baton/transfer/kvstore/redistest"
)

// raw reads and writes a store's storage underneath it.
type raw interface {
	// Set stores value under key as is.
	Set(t *testing.T, key string, value []byte)
	// Value returns key's stored value, nil if absent.
	Value(t *testing.T, key string) []byte
	// TTL returns key's remaining time to live: -1 for none, -2 if absent.
	TTL(t *testing.T, key string) time.Duration
	// Expire lets the keys' time to live run out: Memory's clock moves a
	// TTL ahead, Redis expires them at once.
	Expire(t *testing.T, keys ...string)
}

// backend opens a store of one implementation with the given TTL (0: the
// default), and raw access to it.
type backend func(t *testing.T, ttl time.Duration) (transfer.Store, raw)

// TestStores runs one suite against every implementation.
func TestStores(t *testing.T) {
	backends := map[string]backend{
		"memory": memoryBackend,
		"redis":  redisBackend,
	}
	tests := map[string]func(t *testing.T, open backend){
		"RoundTrip":  testRoundTrip,
		"Missing":    testMissing,
		"Exists":     testExists,
		"Namespaces": testNamespaces,
		"Overwrite":  testOverwrite,
		"Empty":      testEmpty,
		"Ownership":  testOwnership,
		"TTL":        testTTL,
		"Corrupt":    testCorrupt,
		"Concurrent": testConcurrent,
		"Close":      testClose,
		"Cancelled":  testCancelled,
	}
	for name, open := range backends {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			for tname, test := range tests {
				t.Run(tname, func(t *testing.T) {
					t.Parallel()
					test(t, open)
				})
			}
		})
	}
}

func memoryBackend(t *testing.T, ttl time.Duration) (transfer.Store, raw) {
	m := kvstore.NewMemory(kvstore.MemoryConfig{TTL: ttl})
	t.Cleanup(func() { m.Close() })
	return m, memoryRaw{m, ttl}
}

func redisBackend(t *testing.T, ttl time.Duration) (transfer.Store, raw) {
	addr := redistest.Shared(t)
	r, err := kvstore.NewRedis(kvstore.RedisConfig{Addr: addr, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	return r, redisRaw{c}
}

// nsFor returns a namespace of its own for t, so tests sharing one Redis
// never see each other's keys.
func nsFor(t *testing.T) transfer.Namespace {
	return transfer.Namespace{Model: t.Name(), Salt: 0x5eed}
}

func block(key uint64, size int) transfer.Block {
	b := transfer.Block{Key: key, Data: make([]byte, size)}
	kvblock.Fill(b.Data, key)
	return b
}

func blocks(size int, keys ...uint64) []transfer.Block {
	bs := make([]transfer.Block, len(keys))
	for i, k := range keys {
		bs[i] = block(k, size)
	}
	return bs
}

func mustPut(t *testing.T, s transfer.Store, ns transfer.Namespace, bs []transfer.Block) {
	t.Helper()
	if err := s.Put(context.Background(), ns, bs); err != nil {
		t.Fatalf("Put: %v", err)
	}
}

func mustGet(t *testing.T, s transfer.Store, ns transfer.Namespace, keys []uint64, size int) [][]byte {
	t.Helper()
	data, err := s.Get(context.Background(), ns, keys, size)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if len(data) != len(keys) {
		t.Fatalf("Get of %d keys returned %d values", len(keys), len(data))
	}
	return data
}

func mustExist(t *testing.T, s transfer.Store, ns transfer.Namespace, keys []uint64) []bool {
	t.Helper()
	ok, err := s.Exists(context.Background(), ns, keys)
	if err != nil {
		t.Fatalf("Exists: %v", err)
	}
	if len(ok) != len(keys) {
		t.Fatalf("Exists of %d keys returned %d answers", len(keys), len(ok))
	}
	return ok
}

// checkBlock fails t unless got is block key of size bytes.
func checkBlock(t *testing.T, got []byte, key uint64, size int) {
	t.Helper()
	if got == nil {
		t.Errorf("block %x: missing", key)
		return
	}
	if want := block(key, size).Data; !bytes.Equal(got, want) {
		t.Errorf("block %x: %d bytes differ from the %d put", key, len(got), len(want))
	}
}

func testRoundTrip(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	for _, size := range []int{64, 1000, 4 << 10, 64 << 10, 1 << 20} {
		base := uint64(size) << 8
		keys := []uint64{base + 1, base + 2, base + 3}
		mustPut(t, s, ns, blocks(size, keys...))
		data := mustGet(t, s, ns, keys, size)
		for i, k := range keys {
			checkBlock(t, data[i], k, size)
		}
	}
}

func testMissing(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	mustPut(t, s, ns, blocks(256, 2))
	data := mustGet(t, s, ns, []uint64{1, 2, 3}, 256)
	if data[0] != nil || data[2] != nil {
		t.Errorf("missing keys: got %d and %d bytes, want nil", len(data[0]), len(data[2]))
	}
	checkBlock(t, data[1], 2, 256)
}

func testExists(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	mustPut(t, s, ns, blocks(128, 10, 30))
	got := mustExist(t, s, ns, []uint64{10, 20, 30, 40})
	if want := []bool{true, false, true, false}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Exists = %v, want %v", got, want)
	}
}

func testNamespaces(t *testing.T, open backend) {
	s, _ := open(t, 0)
	base := nsFor(t)
	otherModel := transfer.Namespace{Model: base.Model + "-70b", Salt: base.Salt}
	otherTenant := transfer.Namespace{Model: base.Model, Salt: base.Salt + 1}
	mustPut(t, s, base, blocks(128, 7))
	for name, ns := range map[string]transfer.Namespace{"model": otherModel, "tenant": otherTenant} {
		if data := mustGet(t, s, ns, []uint64{7}, 128); data[0] != nil {
			t.Errorf("another %s sees a block put in %+v", name, base)
		}
		if ok := mustExist(t, s, ns, []uint64{7}); ok[0] {
			t.Errorf("another %s: Exists reports a block put in %+v", name, base)
		}
	}
	checkBlock(t, mustGet(t, s, base, []uint64{7}, 128)[0], 7, 128)
}

func testOverwrite(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	mustPut(t, s, ns, blocks(128, 5))
	mustPut(t, s, ns, blocks(512, 5)) // same key, another size (another kv scale)
	checkBlock(t, mustGet(t, s, ns, []uint64{5}, 512)[0], 5, 512)
}

func testEmpty(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	mustPut(t, s, ns, nil)
	if data := mustGet(t, s, ns, nil, 64); len(data) != 0 {
		t.Errorf("Get of no keys returned %d values", len(data))
	}
	if ok := mustExist(t, s, ns, nil); len(ok) != 0 {
		t.Errorf("Exists of no keys returned %d answers", len(ok))
	}
}

// testOwnership checks that the store neither keeps the caller's Data nor
// shares what it returns between calls.
func testOwnership(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	bs := blocks(256, 1)
	mustPut(t, s, ns, bs)
	clear(bs[0].Data)
	got := mustGet(t, s, ns, []uint64{1}, 256)[0]
	checkBlock(t, got, 1, 256)
	clear(got)
	checkBlock(t, mustGet(t, s, ns, []uint64{1}, 256)[0], 1, 256)
}

func testTTL(t *testing.T, open backend) {
	ns := nsFor(t)
	key := transfer.StoreKey(ns, 1)
	t.Run("default", func(t *testing.T) {
		s, r := open(t, 0)
		mustPut(t, s, ns, blocks(64, 1))
		if got := r.TTL(t, key); got < kvstore.DefaultTTL-time.Minute || got > kvstore.DefaultTTL {
			t.Errorf("TTL = %v, want about %v", got, kvstore.DefaultTTL)
		}
	})
	t.Run("none", func(t *testing.T) {
		s, r := open(t, -1)
		mustPut(t, s, transfer.Namespace{Model: ns.Model + "/none"}, blocks(64, 1))
		if got := r.TTL(t, transfer.StoreKey(transfer.Namespace{Model: ns.Model + "/none"}, 1)); got != -1 {
			t.Errorf("TTL = %v, want -1 (none)", got)
		}
	})
	t.Run("expires", func(t *testing.T) {
		s, r := open(t, time.Second)
		ns := transfer.Namespace{Model: ns.Model + "/expires"}
		mustPut(t, s, ns, blocks(64, 1))
		if got := r.TTL(t, transfer.StoreKey(ns, 1)); got <= 0 || got > time.Second {
			t.Errorf("TTL = %v, want in (0, 1s]", got)
		}
		if ok := mustExist(t, s, ns, []uint64{1}); !ok[0] {
			t.Fatal("block missing before its TTL")
		}
		r.Expire(t, transfer.StoreKey(ns, 1))
		if ok := mustExist(t, s, ns, []uint64{1}); ok[0] {
			t.Error("Exists reports a block past its TTL")
		}
		if data := mustGet(t, s, ns, []uint64{1}, 64); data[0] != nil {
			t.Error("Get returned a block past its TTL")
		}
	})
}

// testCorrupt writes bad values straight into the storage: Get must report
// each as missing and delete it, and still return the good ones.
func testCorrupt(t *testing.T, open backend) {
	const size = 4096
	s, r := open(t, 0)
	ns := nsFor(t)
	mustPut(t, s, ns, blocks(size, 1000, 1001)) // 1000 is good; 1001 is a donor
	good := r.Value(t, transfer.StoreKey(ns, 1000))
	if len(good) != size+12 {
		t.Fatalf("stored value of a %d-byte block is %d bytes, want %d", size, len(good), size+12)
	}
	edit := func(f func(v []byte) []byte) []byte { return f(bytes.Clone(good)) }
	tests := []struct {
		name  string
		value []byte
		size  int // asked of Get; 0 means size
	}{
		{name: "garbage", value: []byte("not a kv block")},
		{name: "empty", value: []byte{}},
		{name: "header only", value: good[:12]},
		{name: "bad magic", value: edit(func(v []byte) []byte { v[0] ^= 0xff; return v })},
		{name: "unknown version", value: edit(func(v []byte) []byte { v[1] = 9; return v })},
		{name: "truncated", value: good[:len(good)-8]},
		{name: "length field", value: edit(func(v []byte) []byte { v[8]++; return v })},
		{name: "flipped bit", value: edit(func(v []byte) []byte { v[12+size/2] ^= 1; return v })},
		{name: "bad checksum", value: edit(func(v []byte) []byte { v[4] ^= 1; return v })},
		{name: "another key's block", value: r.Value(t, transfer.StoreKey(ns, 1001))},
		{name: "another size", value: good, size: 2 * size},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			key := uint64(2000 + i)
			if tt.size != 0 {
				// A valid block of key, asked for at another size.
				mustPut(t, s, ns, blocks(size, key))
			} else {
				r.Set(t, transfer.StoreKey(ns, key), tt.value)
			}
			want := tt.size
			if want == 0 {
				want = size
			}
			data := mustGet(t, s, ns, []uint64{1000, key}, want)
			if data[1] != nil {
				t.Errorf("Get returned a bad value (%d bytes)", len(data[1]))
			}
			if want == size {
				checkBlock(t, data[0], 1000, size)
			}
			if v := r.Value(t, transfer.StoreKey(ns, key)); v != nil {
				t.Errorf("bad value still stored (%d bytes), want it deleted", len(v))
			}
		})
	}
}

func testConcurrent(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	const workers, rounds, size = 8, 25, 1024
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			ctx := context.Background()
			for i := range rounds {
				keys := []uint64{uint64(w*1000 + i), uint64(w*1000 + i + 1)}
				if err := s.Put(ctx, ns, blocks(size, keys...)); err != nil {
					errs <- err
					return
				}
				data, err := s.Get(ctx, ns, keys, size)
				if err != nil {
					errs <- err
					return
				}
				for j, k := range keys {
					if !bytes.Equal(data[j], block(k, size).Data) {
						errs <- fmt.Errorf("block %d: wrong data", k)
						return
					}
				}
				if _, err := s.Exists(ctx, ns, keys); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

func testClose(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	mustPut(t, s, ns, blocks(64, 1))
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := s.Get(context.Background(), ns, []uint64{1}, 64); err == nil {
		t.Error("Get after Close: no error")
	}
	if err := s.Put(context.Background(), ns, blocks(64, 2)); err == nil {
		t.Error("Put after Close: no error")
	}
	if _, err := s.Exists(context.Background(), ns, []uint64{1}); err == nil {
		t.Error("Exists after Close: no error")
	}
}

func testCancelled(t *testing.T, open backend) {
	s, _ := open(t, 0)
	ns := nsFor(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Put(ctx, ns, blocks(64, 1)); !errors.Is(err, context.Canceled) {
		t.Errorf("Put with a cancelled context: error %v, want context.Canceled", err)
	}
	if _, err := s.Get(ctx, ns, []uint64{1}, 64); !errors.Is(err, context.Canceled) {
		t.Errorf("Get with a cancelled context: error %v, want context.Canceled", err)
	}
	if _, err := s.Exists(ctx, ns, []uint64{1}); !errors.Is(err, context.Canceled) {
		t.Errorf("Exists with a cancelled context: error %v, want context.Canceled", err)
	}
}

type memoryRaw struct {
	m   *kvstore.Memory
	ttl time.Duration
}

func (r memoryRaw) Set(_ *testing.T, key string, value []byte) { r.m.SetRaw(key, value) }
func (r memoryRaw) Value(_ *testing.T, key string) []byte      { return r.m.RawValue(key) }
func (r memoryRaw) TTL(_ *testing.T, key string) time.Duration { return r.m.RawTTL(key) }

func (r memoryRaw) Expire(t *testing.T, _ ...string) {
	if r.ttl <= 0 {
		t.Fatal("Expire on a store opened with the default TTL")
	}
	r.m.SetNow(func() time.Time { return time.Now().Add(r.ttl) })
}

type redisRaw struct{ c *redis.Client }

func (r redisRaw) Set(t *testing.T, key string, value []byte) {
	t.Helper()
	if err := r.c.Set(context.Background(), key, value, 0).Err(); err != nil {
		t.Fatalf("raw SET: %v", err)
	}
}

func (r redisRaw) Value(t *testing.T, key string) []byte {
	t.Helper()
	v, err := r.c.Get(context.Background(), key).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil
	}
	if err != nil {
		t.Fatalf("raw GET: %v", err)
	}
	return bytes.Clone(v)
}

func (r redisRaw) TTL(t *testing.T, key string) time.Duration {
	t.Helper()
	// PTTL replies -1 (no expiry) and -2 (absent) as raw numbers, which
	// go-redis hands back as nanoseconds.
	d, err := r.c.PTTL(context.Background(), key).Result()
	if err != nil {
		t.Fatalf("raw PTTL: %v", err)
	}
	return d
}

func (r redisRaw) Expire(t *testing.T, keys ...string) {
	t.Helper()
	for _, k := range keys {
		// A time to live that is not positive deletes the key, as its
		// expiry would.
		if err := r.c.PExpire(context.Background(), k, 0).Err(); err != nil {
			t.Fatalf("raw PEXPIRE: %v", err)
		}
	}
}
