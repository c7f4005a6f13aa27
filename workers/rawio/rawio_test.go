package rawio

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"
)

// pair returns the two ends of a loopback TCP connection.
func pair(t *testing.T) (client, server net.Conn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		accepted <- c
	}()
	client, err = net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server = <-accepted
	if server == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { client.Close(); server.Close() })
	return client, server
}

func TestRoundTrip(t *testing.T) {
	client, server := pair(t)
	var rc Conn
	rc.Init(client)
	if !rc.raw.ok() && onLinux {
		t.Fatal("a TCP connection is not read raw on Linux")
	}
	if _, err := rc.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(server, buf); err != nil || string(buf) != "hello" {
		t.Fatalf("server read %q, %v", buf, err)
	}
	go server.Write([]byte("world"))
	if _, err := io.ReadFull(&rc, buf); err != nil || string(buf) != "world" {
		t.Fatalf("read %q, %v", buf, err)
	}
	if n, err := rc.Read(nil); n != 0 || err != nil {
		t.Fatalf("empty read: %d, %v", n, err)
	}
	server.Close()
	if n, err := rc.Read(buf); n != 0 || err != io.EOF {
		t.Fatalf("after the peer closed: %d, %v; want 0, EOF", n, err)
	}
}

// A write larger than the socket's buffers waits for the reader and
// writes every byte.
func TestLargeWriteWaits(t *testing.T) {
	client, server := pair(t)
	var rc Conn
	rc.Init(client)
	big := bytes.Repeat([]byte("0123456789abcdef"), 1<<20) // 16 MiB
	got := make(chan []byte)
	go func() {
		time.Sleep(50 * time.Millisecond) // let the writer fill the buffers
		b, _ := io.ReadAll(io.LimitReader(server, int64(len(big))))
		got <- b
	}()
	n, err := rc.Write(big)
	if err != nil || n != len(big) {
		t.Fatalf("wrote %d, %v; want %d", n, err, len(big))
	}
	if b := <-got; !bytes.Equal(b, big) {
		t.Fatalf("the reader got %d bytes, not what was written", len(b))
	}
}

func TestDeadlineAndClose(t *testing.T) {
	client, _ := pair(t)
	var rc Conn
	rc.Init(client)
	client.SetReadDeadline(time.Now().Add(20 * time.Millisecond))
	_, err := rc.Read(make([]byte, 8))
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past the deadline: %v; want a timeout", err)
	}
	var oe *net.OpError
	if !errors.As(err, &oe) || oe.Op != "read" {
		t.Fatalf("read past the deadline: %T %v; want a *net.OpError as net.Conn's", err, err)
	}
	client.SetReadDeadline(time.Time{})
	done := make(chan error, 1)
	go func() {
		_, err := rc.Read(make([]byte, 8))
		done <- err
	}()
	time.Sleep(10 * time.Millisecond)
	client.Close()
	if err := <-done; !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read while closed: %v; want net.ErrClosed", err)
	}
	if _, err := rc.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after close: %v; want net.ErrClosed", err)
	}
}

func TestWriteToResetPeer(t *testing.T) {
	client, server := pair(t)
	var rc Conn
	rc.Init(client)
	server.(*net.TCPConn).SetLinger(0)
	server.Close()
	var err error
	for i := 0; i < 100 && err == nil; i++ {
		_, err = rc.Write(make([]byte, 64<<10))
	}
	var se *os.SyscallError
	if err == nil || (onLinux && !errors.As(err, &se)) {
		t.Fatalf("writes to a reset peer: %v; want the system call's error", err)
	}
}

// A connection without a descriptor is read and written as it is.
func TestPipeFallsBack(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	var rc Conn
	rc.Init(a)
	if rc.raw.ok() {
		t.Fatal("a pipe has no descriptor")
	}
	go b.Write([]byte("hi"))
	buf := make([]byte, 2)
	if _, err := io.ReadFull(&rc, buf); err != nil || string(buf) != "hi" {
		t.Fatalf("read %q, %v", buf, err)
	}
	go io.ReadFull(b, buf)
	if _, err := rc.Write([]byte("yo")); err != nil {
		t.Fatal(err)
	}
}

// One goroutine reads while another writes, each its own stream of bytes.
func TestReadWhileWriting(t *testing.T) {
	client, server := pair(t)
	var rc Conn
	rc.Init(client)
	const size = 8 << 20
	out := bytes.Repeat([]byte("abcdefgh"), size/8)
	in := bytes.Repeat([]byte("01234567"), size/8)
	echoed := make(chan []byte, 1)
	go func() { // the peer reads what rc writes
		b, _ := io.ReadAll(io.LimitReader(server, size))
		echoed <- b
	}()
	go server.Write(in) // and writes what rc reads
	wrote := make(chan error, 1)
	go func() {
		_, err := rc.Write(out)
		wrote <- err
	}()
	got := make([]byte, size)
	if _, err := io.ReadFull(&rc, got); err != nil {
		t.Fatal(err)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, in) {
		t.Error("read bytes other than the peer wrote")
	}
	if !bytes.Equal(<-echoed, out) {
		t.Error("the peer read bytes other than were written")
	}
}
