package httpengine

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// answer is an engine's response to post: its status, its Content-Type and
// its body, which the caller must close.
type answer struct {
	StatusCode  int
	ContentType string
	Body        io.ReadCloser
}

// fromResponse is resp as an answer.
func fromResponse(resp *http.Response) *answer {
	return &answer{StatusCode: resp.StatusCode, ContentType: resp.Header.Get("Content-Type"), Body: resp.Body}
}

// h1Target is a plain-http engine that Client.post reaches through
// h1Transport.post: a request's head written straight to a pooled
// connection, its response's head read without building an http.Request,
// an http.Response or their header maps (the parts of a relayed request
// that allocated most).
type h1Target struct {
	addr   string // host:port, the pool's key
	prefix string // the base URL's path, escaped, no trailing slash
	fixed  []byte // the header lines every POST carries
}

// newH1Target returns u's target, or nil when u is not one post can reach
// (not http, or a host with an IPv6 zone).
func newH1Target(u *url.URL, apiKey, dpRank string) *h1Target {
	if u.Scheme != "http" || u.Host == "" || strings.Contains(u.Host, "%") {
		return nil
	}
	var b bytes.Buffer
	b.WriteString("Host: " + u.Host + "\r\n")
	b.WriteString("User-Agent: Go-http-client/1.1\r\n")
	b.WriteString("Content-Type: application/json\r\n")
	if apiKey != "" {
		b.WriteString("Authorization: Bearer " + headerValue(apiKey) + "\r\n")
	}
	if dpRank != "" {
		b.WriteString(HeaderDPRank + ": " + headerValue(dpRank) + "\r\n")
	}
	return &h1Target{
		addr:   canonicalAddr(u),
		prefix: strings.TrimRight(u.EscapedPath(), "/"),
		fixed:  b.Bytes(),
	}
}

// headerValue is v with the bytes a header value cannot hold (CR, LF, NUL)
// replaced by spaces, as net/http writes header values.
func headerValue(v string) string {
	if !strings.ContainsAny(v, "\r\n\x00") {
		return v
	}
	return strings.Map(func(r rune) rune {
		if r == '\r' || r == '\n' || r == 0 {
			return ' '
		}
		return r
	}, v)
}

// validTarget reports whether path can stand as a request line's target:
// no controls, spaces or bytes past ASCII.
func validTarget(path string) bool {
	for i := 0; i < len(path); i++ {
		if c := path[i]; c <= ' ' || c >= 0x7f {
			return false
		}
	}
	return true
}

// post sends body to tg's prefix+path as a JSON POST and reads the
// response's head. A request that failed on a pooled connection before any
// of its answer came is sent once more on a new one.
func (t *h1Transport) post(ctx context.Context, tg *h1Target, path, id string, body []byte) (*answer, error) {
	for attempt := 0; ; attempt++ {
		pc, reused, err := t.conn(ctx, tg.addr, attempt == 0)
		if err != nil {
			return nil, err
		}
		a, err := t.exchangePost(ctx, pc, tg, path, id, body)
		if err == nil {
			return a, nil
		}
		if reused && errors.Is(err, errH1Stale) && ctx.Err() == nil && attempt == 0 {
			continue
		}
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, fmt.Errorf("%w: %w", ctxErr, err)
		}
		return nil, err
	}
}

// exchangePost is exchange for post. On error pc is closed.
func (t *h1Transport) exchangePost(ctx context.Context, pc *h1Conn, tg *h1Target, path, id string, body []byte) (*answer, error) {
	stop := t.begin(ctx, pc)
	fail := func(err error) (*answer, error) {
		stop()
		_ = pc.nc.Close()
		return nil, err
	}
	bw := pc.bw
	bw.WriteString("POST ")
	bw.WriteString(tg.prefix)
	bw.WriteString(path)
	bw.WriteString(" HTTP/1.1\r\n")
	bw.Write(tg.fixed)
	if id != "" {
		bw.WriteString("X-Request-Id: ")
		bw.WriteString(headerValue(id))
		bw.WriteString("\r\n")
	}
	bw.WriteString("Content-Length: ")
	bw.Write(strconv.AppendInt(bw.AvailableBuffer(), int64(len(body)), 10))
	bw.WriteString("\r\n\r\n")
	bw.Write(body)
	if err := pc.send(); err != nil {
		return fail(err)
	}
	var h responseHead
	for interim := 0; ; interim++ {
		if interim > maxInterim {
			return fail(errors.New("reading the response: too many interim (1xx) answers"))
		}
		if err := h.read(pc.br); err != nil {
			return fail(fmt.Errorf("reading the response: %w", err))
		}
		if h.status >= 200 || h.status == http.StatusSwitchingProtocols {
			break
		}
		// Interim answers (100 Continue, 103 Early Hints) carry no body.
	}
	if t.headerTimeout > 0 {
		pc.setReadDeadline(time.Time{})
	}
	if h.status == http.StatusSwitchingProtocols {
		return fail(errors.New("the engine switched protocols"))
	}
	b := &h1Body{t: t, pc: pc, stop: stop, reuse: !h.close, left: h.length}
	b.answer = answer{StatusCode: h.status, ContentType: h.contentType, Body: b}
	switch {
	case h.status == http.StatusNoContent || h.status == http.StatusNotModified:
		b.left = 0
	case h.chunked:
		b.chunks = httputil.NewChunkedReader(pc.br)
	case h.length < 0:
		b.reuse = false // the body ends with the connection
	}
	if !b.chunked() && b.left == 0 {
		b.finish(b.reuse)
	}
	return &b.answer, nil
}

// maxInterim bounds the interim answers read before a response, as
// net/http's client does.
const maxInterim = 5

// maxResponseHead bounds a response's status line and header together.
const maxResponseHead = 256 << 10

// responseHead is what post reads of a response's head.
type responseHead struct {
	status      int
	contentType string
	length      int64 // Content-Length, -1 when absent
	chunked     bool  // Transfer-Encoding: chunked
	close       bool  // the connection ends with this response
}

var (
	errMalformedHead = errors.New("malformed HTTP response head")
	errHeadTooLarge  = errors.New("HTTP response head too large")
)

// read reads one response head from br: the status line, the header lines
// and the empty line after them.
func (h *responseHead) read(br *bufio.Reader) error {
	*h = responseHead{length: -1}
	total := 0
	line, err := readHeadLine(br, &total)
	if err != nil {
		return err
	}
	// HTTP/1.x SP 3DIGIT [SP reason]
	if len(line) < 12 || string(line[:7]) != "HTTP/1." || line[8] != ' ' ||
		(len(line) > 12 && line[12] != ' ') {
		return fmt.Errorf("%w: status line %q", errMalformedHead, truncate(line))
	}
	minor := line[7]
	if minor != '0' && minor != '1' {
		return fmt.Errorf("%w: status line %q", errMalformedHead, truncate(line))
	}
	for _, c := range line[9:12] {
		if c < '0' || c > '9' {
			return fmt.Errorf("%w: status line %q", errMalformedHead, truncate(line))
		}
		h.status = h.status*10 + int(c-'0')
	}
	if h.status < 100 {
		return fmt.Errorf("%w: status %d", errMalformedHead, h.status)
	}
	keepAlive := minor == '1'
	var te bool
	for {
		line, err := readHeadLine(br, &total)
		if err != nil {
			return err
		}
		if len(line) == 0 {
			break
		}
		colon := bytes.IndexByte(line, ':')
		if colon <= 0 || line[0] == ' ' || line[0] == '\t' || bytes.ContainsAny(line[:colon], " \t") {
			return fmt.Errorf("%w: header line %q", errMalformedHead, truncate(line))
		}
		var lower [24]byte
		name, value := lowerASCII(&lower, line[:colon]), bytes.Trim(line[colon+1:], " \t")
		switch string(name) {
		case "content-type":
			h.contentType = internContentType(value)
		case "content-length":
			n, err := strconv.ParseInt(string(value), 10, 64)
			if err != nil || n < 0 || (h.length >= 0 && n != h.length) {
				return fmt.Errorf("%w: Content-Length %q", errMalformedHead, truncate(value))
			}
			h.length = n
		case "transfer-encoding":
			var v [24]byte
			if te || string(lowerASCII(&v, value)) != "chunked" {
				return fmt.Errorf("%w: Transfer-Encoding %q", errMalformedHead, truncate(value))
			}
			te, h.chunked = true, true
		case "connection":
			for len(value) > 0 {
				var tok []byte
				tok, value, _ = bytes.Cut(value, []byte(","))
				var v [24]byte
				switch string(lowerASCII(&v, bytes.Trim(tok, " \t"))) {
				case "close":
					h.close = true
				case "keep-alive":
					keepAlive = true
				}
			}
		}
	}
	if h.chunked {
		h.length = -1 // RFC 9112 6.3: Transfer-Encoding overrides Content-Length
	}
	if !keepAlive {
		h.close = true
	}
	return nil
}

// readHeadLine reads one line of a head, without its CRLF (or LF), adding
// its length to total and failing past maxResponseHead.
func readHeadLine(br *bufio.Reader, total *int) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if err == bufio.ErrBufferFull {
		return nil, errHeadTooLarge
	}
	if err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	if *total += len(line); *total > maxResponseHead {
		return nil, errHeadTooLarge
	}
	line = line[:len(line)-1]
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	return line, nil
}

// readTrailer reads a chunked body's trailer section, to its empty line.
func readTrailer(br *bufio.Reader) error {
	total := 0
	for {
		line, err := readHeadLine(br, &total)
		if err != nil {
			return err
		}
		if len(line) == 0 {
			return nil
		}
	}
}

// lowerASCII returns b with ASCII letters lowered, in buf; a b longer than
// buf is returned as it is (no name or value compared is that long).
func lowerASCII(buf *[24]byte, b []byte) []byte {
	if len(b) > len(buf) {
		return b
	}
	for i, c := range b {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		buf[i] = c
	}
	return buf[:len(b)]
}

// internContentType is v as a string, the engines' usual values without
// an allocation.
func internContentType(v []byte) string {
	for _, s := range [...]string{"text/event-stream", "application/json", "text/event-stream; charset=utf-8", "application/json; charset=utf-8"} {
		if string(v) == s {
			return s
		}
	}
	return string(v)
}

func truncate(b []byte) []byte {
	if len(b) > 64 {
		return b[:64]
	}
	return b
}
