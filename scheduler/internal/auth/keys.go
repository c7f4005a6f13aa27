package auth

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/batonllm/baton/workers/openai"
)

// MinKeyLength is the shortest plaintext key accepted: a key is a secret,
// not a password to remember.
const MinKeyLength = 16

// hashPrefix marks an entry given by its key's SHA-256 rather than the
// key itself.
const hashPrefix = "sha256:"

// Entry is one API key, as configured.
type Entry struct {
	// Hash is the SHA-256 of the key; the key itself is never kept.
	Hash [32]byte
	// Tenant, when set, is the tenant of every request made with the key,
	// whatever the request says: it salts the KV cache, so the key reads
	// only its tenant's cached blocks.
	Tenant string
	// Limits override the configured ones where non-zero.
	Limits Limits
}

// ID names the key in metrics and logs: the first 8 hex digits of its
// SHA-256, which identify it without revealing it.
func (e Entry) ID() string { return keyID(e.Hash) }

func keyID(h [32]byte) string { return hex.EncodeToString(h[:4]) }

// ParseKeys parses API key entries, one a line:
//
//	<key> [tenant=<tenant>] [rps=<n>] [burst=<n>] [tpm=<n>] [concurrent=<n>]
//	sha256:<64 hex digits> [options as above]
//
// Blank lines and lines starting with # are skipped. A key is at least
// MinKeyLength characters without spaces; the sha256: form is the hex
// SHA-256 of the key (as printed by `printf %s KEY | sha256sum`), so that
// the file need not hold keys in the clear. Errors name the line, never
// the key.
func ParseKeys(text string) ([]Entry, error) {
	var out []Entry
	for i, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		e, err := parseEntry(line)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", i+1, err)
		}
		out = append(out, e)
	}
	return out, nil
}

func parseEntry(line string) (Entry, error) {
	fields := strings.Fields(line)
	var e Entry
	if h, ok := strings.CutPrefix(fields[0], hashPrefix); ok {
		b, err := hex.DecodeString(h)
		if err != nil || len(b) != sha256.Size {
			return e, errors.New("sha256: needs 64 hex digits")
		}
		copy(e.Hash[:], b)
	} else {
		if len(fields[0]) < MinKeyLength {
			return e, fmt.Errorf("key shorter than %d characters", MinKeyLength)
		}
		e.Hash = sha256.Sum256([]byte(fields[0]))
	}
	for i, f := range fields[1:] {
		name, v, ok := strings.Cut(f, "=")
		if !ok {
			// Not echoed: it may be a key pasted on the wrong line.
			return e, fmt.Errorf("field %d: want name=value", i+2)
		}
		var err error
		switch name {
		case "tenant":
			if err := openai.ValidTenant(v); err != nil {
				return e, fmt.Errorf("tenant: %w", err)
			}
			e.Tenant = v
		case "rps":
			e.Limits.RequestsPerSecond, err = strconv.ParseFloat(v, 64)
			if r := e.Limits.RequestsPerSecond; err == nil && (math.IsNaN(r) || math.IsInf(r, 0)) {
				err = errors.New("not finite")
			}
		case "burst":
			e.Limits.Burst, err = strconv.Atoi(v)
		case "tpm":
			e.Limits.TokensPerMinute, err = strconv.Atoi(v)
		case "concurrent":
			e.Limits.MaxConcurrent, err = strconv.Atoi(v)
		default:
			return e, fmt.Errorf("unknown option %q (known: tenant, rps, burst, tpm, concurrent)", name)
		}
		if err != nil || strings.HasPrefix(v, "-") || v == "0" {
			return e, fmt.Errorf("%s: must be a positive number, got %q", name, v)
		}
	}
	return e, nil
}

// envEntries turns a keys_env value, entries separated by newlines or
// commas, into ParseKeys' text.
func envEntries(v string) string { return strings.ReplaceAll(v, ",", "\n") }

// merge returns l with the non-zero fields of o.
func (l Limits) merge(o Limits) Limits {
	if o.RequestsPerSecond > 0 {
		l.RequestsPerSecond, l.Burst = o.RequestsPerSecond, o.Burst
	}
	if o.Burst > 0 {
		l.Burst = o.Burst
	}
	if o.TokensPerMinute > 0 {
		l.TokensPerMinute = o.TokensPerMinute
	}
	if o.MaxConcurrent > 0 {
		l.MaxConcurrent = o.MaxConcurrent
	}
	return l
}
