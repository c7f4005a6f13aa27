package h1serve

import (
	"io"
	"net"
	"net/http"
	"testing"
	"time"
)

// FuzzServe: whatever a client sends, the server answers or closes, and
// the connection's goroutine ends.
func FuzzServe(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
		"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}GET / HTTP/1.0\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
		"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\nhello",
		"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
		"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
		"POST /end HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhiGET /flush-end HTTP/1.1\r\nHost: x\r\n\r\n",
		"HEAD /end HTTP/1.1\r\nHost: x\r\n\r\nGET /end HTTP/1.0\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	s := &Server{MaxHeaderBytes: 1 << 10, ReadHeaderTimeout: time.Second, ErrorLog: discardLogger(),
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(io.LimitReader(r.Body, 1<<10))
			switch r.URL.Path {
			case "/flush":
				w.(http.Flusher).Flush()
			case "/end":
				w.Write(b)
				w.(interface{ EndBody() error }).EndBody()
			case "/flush-end":
				w.(http.Flusher).Flush()
				w.Write(b)
				w.(interface{ EndBody() error }).EndBody()
			}
			w.Write(b)
		})}
	f.Fuzz(func(t *testing.T, in []byte) {
		client, server := net.Pipe()
		c := &conn{srv: s, nc: server, base: t.Context()}
		done := make(chan struct{})
		go func() { c.serve(); close(done) }()
		go func() { io.Copy(io.Discard, client) }()
		client.SetWriteDeadline(time.Now().Add(time.Second))
		client.Write(in)
		client.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("the connection's goroutine did not end within 10s of its client closing")
		}
	})
}
