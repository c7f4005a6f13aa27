package replica

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"strconv"
)

// The replies a follower reads, in RESP2: XREAD's (an array of streams,
// each an array of its key and its messages, each an array of its id and
// its fields) or a null array when BLOCK timed out, and the simple
// replies of AUTH and SELECT.

// respValue is a parsed RESP2 value.
type respValue struct {
	kind  byte // '+', '-', ':', '$', '*'; 0 for a null bulk string or array
	str   []byte
	items []respValue
}

var errRESP = errors.New("malformed RESP reply")

// parseRESP parses one value from b and returns it and the bytes it took;
// n == 0 when b does not yet hold the whole value. The value's strings
// alias b.
func parseRESP(b []byte) (v respValue, n int, err error) {
	line, rest, ok := respLine(b)
	if !ok {
		return v, 0, nil
	}
	if len(line) == 0 {
		return v, 0, errRESP
	}
	head := len(b) - len(rest)
	switch kind := line[0]; kind {
	case '+', '-', ':':
		return respValue{kind: kind, str: line[1:]}, head, nil
	case '$':
		l, err := strconv.Atoi(string(line[1:]))
		if err != nil || l < -1 {
			return v, 0, errRESP
		}
		if l == -1 {
			return respValue{}, head, nil
		}
		if len(rest) < l+2 {
			return v, 0, nil
		}
		if rest[l] != '\r' || rest[l+1] != '\n' {
			return v, 0, errRESP
		}
		return respValue{kind: '$', str: rest[:l]}, head + l + 2, nil
	case '*':
		c, err := strconv.Atoi(string(line[1:]))
		if err != nil || c < -1 || c > 1<<20 {
			return v, 0, errRESP
		}
		if c == -1 {
			return respValue{}, head, nil
		}
		v = respValue{kind: '*', items: make([]respValue, 0, min(c, 64))}
		for range c {
			item, m, err := parseRESP(b[head:])
			if err != nil || m == 0 {
				return respValue{}, 0, err
			}
			v.items = append(v.items, item)
			head += m
		}
		return v, head, nil
	}
	return v, 0, errRESP
}

// replyError is the error v is, when it is Redis's error reply; nil
// otherwise.
func (v respValue) replyError() error {
	if v.kind != '-' {
		return nil
	}
	return fmt.Errorf("redis: %s", v.str)
}

// readReply reads from conn into *buf until it holds a whole reply, takes
// the reply out of *buf and returns the error it is, if it is Redis's
// error reply (replyError); err is a failure to read or parse.
func readReply(conn net.Conn, buf *[]byte) (reply, err error) {
	for {
		v, n, err := parseRESP(*buf)
		if err != nil {
			return nil, err
		}
		if n > 0 {
			reply = v.replyError()
			*buf = (*buf)[:copy(*buf, (*buf)[n:])]
			return reply, nil
		}
		var b [4096]byte
		k, err := conn.Read(b[:])
		*buf = append(*buf, b[:k]...)
		if err != nil && k == 0 {
			return nil, err
		}
	}
}

// respLine returns the line b starts with, without its CRLF, and what
// follows it; ok is false when b holds no whole line.
func respLine(b []byte) (line, rest []byte, ok bool) {
	i := bytes.Index(b, []byte("\r\n"))
	if i < 0 {
		return nil, nil, false
	}
	return b[:i], b[i+2:], true
}

// appendCommand appends args as a RESP2 command.
func appendCommand(b []byte, args ...string) []byte {
	b = append(b, '*')
	b = strconv.AppendInt(b, int64(len(args)), 10)
	b = append(b, '\r', '\n')
	for _, a := range args {
		b = append(b, '$')
		b = strconv.AppendInt(b, int64(len(a)), 10)
		b = append(b, '\r', '\n')
		b = append(b, a...)
		b = append(b, '\r', '\n')
	}
	return b
}
