package openai

import (
	"errors"
	"testing"
)

// FuzzInvocations: a native (/invocations) body is either a request of the
// kind it speaks or a 400 *Error, never a panic or another error.
func FuzzInvocations(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"x"}]}`))
	f.Add([]byte(`{"model":"m","prompt":"x","max_tokens":3}`))
	f.Add([]byte(`{"messages":null,"prompt":null}`))
	f.Add([]byte(`[1,2]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		is400 := func(err error) {
			t.Helper()
			var e *Error
			if !errors.As(err, &e) || e.Status != 400 {
				t.Fatalf("error %v is not a 400 *Error", err)
			}
		}
		k, err := DetectKind(body)
		if err != nil {
			is400(err)
			return
		}
		if k != Chat && k != Completion {
			t.Fatalf("DetectKind = %v", k)
		}
		r, err := Parse(k, body)
		if err != nil {
			is400(err)
			return
		}
		if r.Model == "" || r.MaxTokens < 0 || len(r.Stop) > MaxStop {
			t.Fatalf("accepted invalid request %+v", r)
		}
	})
}
