package kvevents_test

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/batonllm/baton/workers/vllm/kvevents"
)

// TestLibzmqPublisher follows a publisher on libzmq, the library vLLM's
// and SGLang's publishers (pyzmq) are built on, over tcp and ipc: Debian's
// python3-zmq (libzmq 4.3) sending vLLM's array-like batches, the frames
// of its own making (an empty topic frame, long frames, messages larger
// than a subscriber's first buffer) and ZMTP heartbeats it drops the
// subscriber for when they go unanswered; and, the subscriber binding,
// connecting to it without heartbeats (vLLM's way) and with them. Every
// batch arrives, in order, decoded as sent.
func TestLibzmqPublisher(t *testing.T) {
	python := libzmqPython(t)
	for _, tc := range []struct {
		name string
		mode kvevents.Mode
	}{{"tcp", kvevents.Connect}, {"ipc", kvevents.Connect}, {"tcp-bind", kvevents.Bind}, {"tcp-bind-heartbeats", kvevents.Bind}} {
		t.Run(tc.name, func(t *testing.T) {
			endpoint := "tcp://127.0.0.1:0"
			var args []string
			switch {
			case tc.name == "ipc":
				endpoint = "ipc://" + filepath.Join(t.TempDir(), "kv.sock")
			case tc.mode == kvevents.Bind:
				l, err := net.Listen("tcp", "127.0.0.1:0")
				if err != nil {
					t.Fatal(err)
				}
				endpoint = "tcp://" + l.Addr().String()
				l.Close()
				args = []string{"connect"}
				if tc.name == "tcp-bind-heartbeats" {
					args = append(args, "heartbeats")
				}
			}
			bound := startLibzmqPublisher(t, python, endpoint, args...)
			// vLLM's default topic is empty (newSubscriber would set one).
			s, err := kvevents.New(kvevents.SubscriberConfig{Endpoint: bound, Mode: tc.mode, RedialMin: 10 * time.Millisecond, RedialMax: 50 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			// The publisher drops a subscriber that does not answer its
			// heartbeats within 300 ms; 40 batches take 800 ms.
			const n = 40
			got := recv(t, s, n)
			large, cleared := false, false
			for i, m := range got {
				if m.Reset || m.Err != nil {
					t.Fatalf("message %d: reset %v, err %v; stats %+v", i, m.Reset, m.Err, s.Stats())
				}
				if i > 0 && m.Seq != got[i-1].Seq+1 {
					t.Fatalf("message %d: seq %d after %d: a batch was lost or the subscription broke; stats %+v", i, m.Seq, got[i-1].Seq, s.Stats())
				}
				if err := checkLibzmqBatch(m.Seq, m.Batch); err != nil {
					t.Errorf("seq %d: %v", m.Seq, err)
				}
				large = large || m.Seq%7 == 3
				cleared = cleared || m.Seq%10 == 9
				m.Release()
			}
			if !large || !cleared {
				t.Errorf("the batches seen held no large batch (%v) or no AllBlocksCleared (%v)", large, cleared)
			}
		})
	}
}

// checkLibzmqBatch checks b against what testdata/libzmq_pub.py sends as
// batch s.
func checkLibzmqBatch(s uint64, b kvevents.Batch) error {
	if b.HasDPRank != (s%2 == 1) || (b.HasDPRank && b.DPRank != 1) {
		return fmt.Errorf("data-parallel rank %d (said %v)", b.DPRank, b.HasDPRank)
	}
	if s%10 == 9 {
		if len(b.Events) != 1 {
			return fmt.Errorf("%d events, want AllBlocksCleared", len(b.Events))
		}
		if _, ok := b.Events[0].(*kvevents.AllBlocksCleared); !ok {
			return fmt.Errorf("event %T, want AllBlocksCleared", b.Events[0])
		}
		return nil
	}
	if len(b.Events) != 2 {
		return fmt.Errorf("%d events, want BlockStored and BlockRemoved", len(b.Events))
	}
	st, ok := b.Events[0].(*kvevents.BlockStored)
	if !ok {
		return fmt.Errorf("first event %T, want BlockStored", b.Events[0])
	}
	k := 1 + s%40
	if s%7 == 3 {
		k = 600
	}
	if uint64(len(st.BlockHashes)) != k {
		return fmt.Errorf("%d stored blocks, want %d", len(st.BlockHashes), k)
	}
	for i, h := range st.BlockHashes {
		if v, ok := h.Uint64(); !ok || v != s*1000+uint64(i)+1 {
			return fmt.Errorf("stored hash %d: %v, want %d", i, h, s*1000+uint64(i)+1)
		}
	}
	wantParent := kvevents.Hash{} // None and 0: no parent
	if s%3 == 2 {
		wantParent = kvevents.IntHash(s * 1000)
	}
	if st.Parent != wantParent {
		return fmt.Errorf("parent %v, want %v", st.Parent, wantParent)
	}
	if uint64(len(st.TokenIDs)) != 16*k || st.TokenIDs[len(st.TokenIDs)-1] != uint32((s+16*k-1)%50000) {
		return fmt.Errorf("%d token ids, want %d ending in %d", len(st.TokenIDs), 16*k, (s+16*k-1)%50000)
	}
	wantMedium := "GPU"
	if s%4 == 0 {
		wantMedium = ""
	}
	if st.BlockSize != 16 || st.HasLoRAID || st.Medium != wantMedium {
		return fmt.Errorf("block size %d, lora id said %v, medium %q; want 16, no lora id, %q", st.BlockSize, st.HasLoRAID, st.Medium, wantMedium)
	}
	rm, ok := b.Events[1].(*kvevents.BlockRemoved)
	if !ok || len(rm.BlockHashes) != 1 || rm.Medium != "GPU" {
		return fmt.Errorf("second event %+v, want BlockRemoved of one block on the GPU", b.Events[1])
	}
	if v, _ := rm.BlockHashes[0].Uint64(); v != s*1000+1 {
		return fmt.Errorf("removed hash %d, want %d", v, s*1000+1)
	}
	return nil
}

// startLibzmqPublisher runs testdata/libzmq_pub.py at endpoint with args
// and returns the endpoint it bound or connected to; the test's cleanup
// stops it.
func startLibzmqPublisher(t *testing.T, python, endpoint string, args ...string) string {
	t.Helper()
	cmd := exec.Command(python, append([]string{"testdata/libzmq_pub.py", endpoint}, args...)...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close() // the publisher's signal to stop
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(waitFor):
			cmd.Process.Kill()
			<-done
		}
	})
	line := make(chan string, 1)
	go func() {
		l, _ := bufio.NewReader(stdout).ReadString('\n')
		line <- strings.TrimSpace(l)
	}()
	select {
	case l := <-line:
		if l == "" {
			t.Fatalf("libzmq publisher printed no endpoint; stderr: %s", stderr.String())
		}
		return l
	case <-time.After(waitFor):
		t.Fatalf("libzmq publisher did not start; stderr: %s", stderr.String())
	}
	return ""
}

var (
	libzmqOnce sync.Once
	libzmqErr  error
)

// libzmqPython returns Debian's python3 with its zmq (pyzmq on libzmq) and
// msgpack modules, installing python3-zmq and python3-msgpack with
// apt-get when they are missing and the test runs as root.
func libzmqPython(t *testing.T) string {
	t.Helper()
	const python = "/usr/bin/python3"
	check := func() error {
		out, err := exec.Command(python, "-c", "import zmq, msgpack").CombinedOutput()
		if err != nil {
			return fmt.Errorf("%s: %v: %s", python, err, bytes.TrimSpace(out))
		}
		return nil
	}
	libzmqOnce.Do(func() {
		if libzmqErr = check(); libzmqErr == nil {
			return
		}
		if _, err := exec.LookPath("apt-get"); err != nil || os.Geteuid() != 0 {
			return
		}
		for _, args := range [][]string{{"update", "-qq"}, {"install", "-y", "-qq", "python3-zmq", "python3-msgpack"}} {
			cmd := exec.Command("apt-get", args...)
			cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
			if out, err := cmd.CombinedOutput(); err != nil {
				libzmqErr = errors.Join(libzmqErr, fmt.Errorf("apt-get %s: %v: %s", strings.Join(args, " "), err, bytes.TrimSpace(out)))
				return
			}
		}
		libzmqErr = check()
	})
	if libzmqErr != nil {
		t.Fatalf("libzmq publisher needs Debian's python3 with zmq and msgpack: run  sudo apt-get install -y python3-zmq python3-msgpack\n%v", libzmqErr)
	}
	return python
}
