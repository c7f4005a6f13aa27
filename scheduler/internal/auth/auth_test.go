package auth

import (
	"crypto/sha256"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func TestParseKeys(t *testing.T) {
	key := "sk-0123456789abcdef"
	h := sha256.Sum256([]byte(key))
	got, err := ParseKeys("# comment\n\n" + key + " tenant=t1 rps=2.5 burst=5 tpm=1000 concurrent=3\n  sha256:" + strings.Repeat("ab", 32) + "\n")
	if err != nil {
		t.Fatal(err)
	}
	var hashed [32]byte
	for i := range hashed {
		hashed[i] = 0xab
	}
	want := []Entry{
		{Hash: h, Tenant: "t1", Limits: Limits{RequestsPerSecond: 2.5, Burst: 5, TokensPerMinute: 1000, MaxConcurrent: 3}},
		{Hash: hashed},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("ParseKeys (-want +got):\n%s", d)
	}
	if id := got[0].ID(); len(id) != 8 || strings.Contains(key, id) {
		t.Errorf("ID() = %q, want 8 hex digits of the hash", id)
	}

	for _, tc := range []struct{ text, want string }{
		{"short", "line 1: key shorter than 16"},
		{key + "\nsha256:xyz", "line 2: sha256: needs 64 hex digits"},
		{key + " tenant=", "line 1: tenant:"},
		{key + " rps=NaN", "line 1: rps: must be a positive number"},
		{key + " tpm=0", "line 1: tpm: must be a positive number"},
		{key + " color=red", `line 1: unknown option "color"`},
		{key + " sk-another-key-123456", "line 1: field 2: want name=value"},
	} {
		_, err := ParseKeys(tc.text)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseKeys(%q) = %v, want %q", tc.text, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), "sk-another") {
			t.Errorf("ParseKeys(%q) error shows a key: %v", tc.text, err)
		}
	}
}

func TestBucket(t *testing.T) {
	t0 := time.Unix(1000, 0)
	b := newBucket(600, t0) // 10 tokens a second
	if _, ok := b.take(500, t0); !ok {
		t.Fatal("take(500) of a full bucket of 600 refused")
	}
	if d, ok := b.take(200, t0); ok || d != 10*time.Second {
		t.Errorf("take(200) with 100 left = %v, %v; want refused, 10s", d, ok)
	}
	// The request used 100 of its 500: 400 come back.
	b.give(400)
	if _, ok := b.take(450, t0); !ok {
		t.Error("take(450) after giving back 400 refused")
	}
	// A request larger than the bucket passes once it is full, in debt.
	if _, ok := b.take(1000, t0.Add(time.Minute)); !ok {
		t.Error("take(1000) of a full bucket of 600 refused")
	}
	if d, ok := b.take(1, t0.Add(time.Minute)); ok || d < 40*time.Second {
		t.Errorf("take(1) in debt = %v, %v; want refused for 40s", d, ok)
	}
}
