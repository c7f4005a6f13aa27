package h1serve

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// bufferBeforeChunking is how much of a body is held before its header is
// sent: a body the handler finishes within it gets a Content-Length.
const bufferBeforeChunking = 2048

// response is the handler's http.ResponseWriter.
type response struct {
	c      *conn
	req    *http.Request
	header http.Header
	cancel func()
	body   *body

	status        int  // 0 until WriteHeader
	sent          bool // the header is in c.bw
	chunked       bool
	closeAfter    bool  // the connection closes after this response
	broken        bool  // a write failed: the connection is done
	ended         bool  // EndBody sent the body's end
	err           error // the failed write's
	contentLength int64 // declared or set; -1 none
	written       int64
	buf           []byte // the body before the header is sent

	wroteDeadline, readDeadline bool // set by the handler, cleared after it
}

func (w *response) Header() http.Header { return w.header }

func (w *response) WriteHeader(code int) {
	if w.status != 0 {
		return
	}
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if code < 200 && code != http.StatusSwitchingProtocols {
		// Informational: sent at once, with the headers set so far.
		w.c.bw.WriteString("HTTP/1.1 " + statusLine(code) + "\r\n")
		w.writeHeaderLines()
		w.c.bw.WriteString("\r\n")
		w.fail(w.c.bw.Flush())
		return
	}
	w.status = code
	if cl, ok := w.header["Content-Length"]; ok {
		if v, err := strconv.ParseInt(strings.TrimSpace(first(cl)), 10, 64); err == nil && v >= 0 {
			w.contentLength = v
		} else {
			delete(w.header, "Content-Length")
		}
	}
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

// bodyAllowed reports whether the response has a body on the wire.
func (w *response) bodyAllowed() bool {
	return w.req.Method != http.MethodHead && w.status != http.StatusNoContent && w.status != http.StatusNotModified
}

func (w *response) fail(err error) {
	if err != nil && !w.broken {
		w.broken, w.err = true, err
	}
}

func (w *response) Write(p []byte) (int, error) {
	if w.broken {
		return 0, w.err
	}
	if w.ended {
		return 0, ErrBodyEnded
	}
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !w.bodyAllowed() {
		if w.req.Method == http.MethodHead {
			return len(p), nil
		}
		return 0, http.ErrBodyNotAllowed
	}
	if w.contentLength >= 0 && w.written+int64(len(p)) > w.contentLength {
		return 0, http.ErrContentLength
	}
	w.written += int64(len(p))
	if !w.sent {
		if len(w.buf)+len(p) <= bufferBeforeChunking {
			w.buf = append(w.buf, p...)
			return len(p), nil
		}
		w.sendHeader(false, p)
	}
	w.writeBody(p)
	if w.broken {
		return 0, w.err
	}
	return len(p), nil
}

// FlushError sends what the handler wrote, the header first.
func (w *response) FlushError() error {
	if w.broken || w.ended {
		return w.err
	}
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !w.sent {
		w.sendHeader(false, nil)
	}
	w.fail(w.c.bw.Flush())
	return w.err
}

// Flush is http.Flusher's.
func (w *response) Flush() { w.FlushError() }

// SetReadDeadline and SetWriteDeadline are http.ResponseController's.
func (w *response) SetReadDeadline(t time.Time) error {
	w.readDeadline = true
	return w.c.nc.SetReadDeadline(t)
}

func (w *response) SetWriteDeadline(t time.Time) error {
	w.wroteDeadline = true
	return w.c.nc.SetWriteDeadline(t)
}

// ErrBodyEnded is what Write answers after EndBody.
var ErrBodyEnded = errors.New("h1serve: write after the body's end")

// EndBody sends what the handler wrote and the end of the body now,
// rather than once the handler returns: the last events of a stream and
// its end leave in one write, and the client has its whole answer while
// the handler still records it. Nothing can be written after it.
func (w *response) EndBody() error {
	if !w.broken && !w.ended {
		w.end()
	}
	return w.err
}

// finish ends the response once the handler has returned.
func (w *response) finish() {
	if w.broken || w.ended {
		return
	}
	w.end()
}

func (w *response) end() {
	w.ended = true
	if w.status == 0 {
		w.WriteHeader(http.StatusOK)
	}
	if !w.sent {
		w.sendHeader(true, nil)
	} else if w.chunked {
		w.c.bw.WriteString("0\r\n\r\n")
	}
	w.fail(w.c.bw.Flush())
	if w.bodyAllowed() && w.contentLength >= 0 && w.written != w.contentLength {
		w.closeAfter = true // the client cannot tell where the next response starts
	}
}

// sendHeader writes the status line and header, then what body was held.
// final: the handler has returned, so a held body's length is known. more
// is the body about to be written, for sniffing a missing Content-Type.
func (w *response) sendHeader(final bool, more []byte) {
	w.sent = true
	h := w.header
	delete(h, "Transfer-Encoding")
	if !w.body.eof && (w.req.ContentLength > maxPostHandlerRead || w.req.ContentLength < 0) && !(w.body.cont && !w.body.continued) {
		// More of the body is coming than is worth reading once the
		// handler returns: say that the connection ends here.
		w.closeAfter = true
	}
	if w.c.srv.shutdown.Load() || w.body.cont && !w.body.continued {
		// Shutting down; or a client told to wait for 100 Continue, whose
		// body is not coming: the connection ends with this response.
		w.closeAfter = true
	}
	if v, ok := h["Connection"]; ok && len(v) > 0 && asciiEqualFold(v[0], "close") {
		w.closeAfter = true
	}
	bw := w.c.bw
	bw.WriteString("HTTP/1.1 ")
	bw.WriteString(statusLine(w.status))
	bw.WriteString("\r\n")
	if w.bodyAllowed() {
		if _, ok := h["Content-Type"]; !ok && w.written > 0 {
			if _, enc := h["Content-Encoding"]; !enc {
				data := w.buf
				if len(data) == 0 {
					data = more
				}
				bw.WriteString("Content-Type: " + http.DetectContentType(data) + "\r\n")
			}
		}
		switch {
		case w.contentLength >= 0:
		case final:
			w.contentLength = int64(len(w.buf))
			bw.WriteString("Content-Length: ")
			bw.WriteString(strconv.FormatInt(w.contentLength, 10))
			bw.WriteString("\r\n")
		case w.req.ProtoAtLeast(1, 1):
			w.chunked = true
			bw.WriteString("Transfer-Encoding: chunked\r\n")
		default:
			w.closeAfter = true // an HTTP/1.0 body of unknown length ends with the connection
		}
	}
	if _, ok := h["Date"]; !ok {
		bw.WriteString("Date: ")
		bw.WriteString(date())
		bw.WriteString("\r\n")
	}
	if _, ok := h["Connection"]; !ok {
		if w.closeAfter {
			bw.WriteString("Connection: close\r\n")
		} else if !w.req.ProtoAtLeast(1, 1) {
			bw.WriteString("Connection: keep-alive\r\n")
		}
	}
	w.writeHeaderLines()
	bw.WriteString("\r\n")
	if len(w.buf) > 0 {
		w.writeBody(w.buf)
		w.buf = w.buf[:0]
	}
}

// writeHeaderLines writes the handler's header, each value's line breaks
// made spaces so that no value starts a header of its own.
func (w *response) writeHeaderLines() {
	bw := w.c.bw
	for k, vv := range w.header {
		for _, v := range vv {
			if strings.ContainsAny(v, "\r\n") {
				v = strings.NewReplacer("\r", " ", "\n", " ").Replace(v)
			}
			bw.WriteString(k)
			bw.WriteString(": ")
			bw.WriteString(strings.TrimSpace(v))
			bw.WriteString("\r\n")
		}
	}
}

func (w *response) writeBody(p []byte) {
	if len(p) == 0 || w.broken {
		return
	}
	bw := w.c.bw
	if w.chunked {
		bw.WriteString(strconv.FormatInt(int64(len(p)), 16))
		bw.WriteString("\r\n")
		bw.Write(p)
		_, err := bw.WriteString("\r\n")
		w.fail(err)
		return
	}
	_, err := bw.Write(p)
	w.fail(err)
}

// statusLine is "200 OK" for 200.
func statusLine(code int) string {
	switch code {
	case http.StatusOK:
		return "200 OK"
	case http.StatusBadRequest:
		return "400 Bad Request"
	}
	text := http.StatusText(code)
	if text == "" {
		text = "status code " + strconv.Itoa(code)
	}
	return strconv.Itoa(code) + " " + text
}

type dateLine struct {
	sec int64
	s   string
}

var lastDate atomic.Pointer[dateLine]

// date is the Date header's value, formatted once a second.
func date() string {
	now := time.Now()
	if d := lastDate.Load(); d != nil && d.sec == now.Unix() {
		return d.s
	}
	d := &dateLine{now.Unix(), now.UTC().Format(http.TimeFormat)}
	lastDate.Store(d)
	return d.s
}
