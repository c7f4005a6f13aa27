package vllm

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/batonllm/baton/workers/engine"
)

// A kept-alive connection the engine closes as a /tokenize call goes out
// on it does not fail the call: the transport sends it again on a fresh
// connection.
func TestTokenizeResentWhenAKeptAliveConnectionCloses(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 2 { // the second call, on the first call's connection
			c, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				c.Close() // read, never answered: the server closed it
			}
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"count":2,"max_model_len":8192,"tokens":[7,9]}`))
	}))
	t.Cleanup(srv.Close)
	tok, err := NewTokenizer(srv.URL, "")
	if err != nil {
		t.Fatal(err)
	}
	req := &engine.Request{Model: "m", Path: chatPath, Body: []byte(`{"messages":[{"role":"user","content":"hi"}]}`)}
	for i := range 2 {
		got, err := tok.Tokenize(context.Background(), req)
		if err != nil {
			t.Fatalf("call %d: %v", i+1, err)
		}
		if len(got) != 2 || got[0] != 7 || got[1] != 9 {
			t.Fatalf("call %d: tokens %v, want [7 9]", i+1, got)
		}
	}
	if n := calls.Load(); n != 3 {
		t.Errorf("the server saw %d calls, want 3 (the dropped one sent again)", n)
	}
}

// A call that fails on the engine's side or a proxy's (a 5xx, a connection
// cut before the answer) is made once more; a 4xx, the request's fault,
// is not.
func TestTokenizeRetriesAFailedCallOnce(t *testing.T) {
	for _, tc := range []struct {
		name    string
		fail    func(w http.ResponseWriter)
		failing int32 // calls that fail before one succeeds
		calls   int32 // calls the server sees
		ok      bool
	}{
		{"502 once", func(w http.ResponseWriter) { w.WriteHeader(http.StatusBadGateway) }, 1, 2, true},
		{"cut once", func(w http.ResponseWriter) {
			if c, _, err := w.(http.Hijacker).Hijack(); err == nil {
				c.Close()
			}
		}, 1, 2, true},
		{"503 twice", func(w http.ResponseWriter) { w.WriteHeader(http.StatusServiceUnavailable) }, 2, 2, false},
		{"400", func(w http.ResponseWriter) { w.WriteHeader(http.StatusBadRequest) }, 1, 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int32
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if calls.Add(1) <= tc.failing {
					tc.fail(w)
					return
				}
				w.Header().Set("Content-Type", "application/json")
				w.Write([]byte(`{"count":1,"max_model_len":8192,"tokens":[5]}`))
			}))
			t.Cleanup(srv.Close)
			tok, err := NewTokenizer(srv.URL, "")
			if err != nil {
				t.Fatal(err)
			}
			req := &engine.Request{Model: "m", Path: chatPath, Body: []byte(`{"messages":[{"role":"user","content":"hi"}]}`)}
			got, err := tok.Tokenize(context.Background(), req)
			if tc.ok != (err == nil) || tc.ok && len(got) != 1 {
				t.Errorf("tokens %v, error %v; want success %t", got, err, tc.ok)
			}
			if n := calls.Load(); n != tc.calls {
				t.Errorf("the server saw %d calls, want %d", n, tc.calls)
			}
		})
	}
}
