package auth

import (
	"fmt"
	"os"
)

// Config turns on API keys and sets their limits. The zero value means no
// authentication: every request is served.
type Config struct {
	// KeysFile is a file of API keys, one entry a line (see ParseKeys).
	// It is read at start and again by Reload (SIGHUP for baton serve).
	KeysFile string `yaml:"keys_file"`
	// KeysEnv names an environment variable holding entries in the same
	// format, separated by newlines or commas. Read with KeysFile.
	KeysEnv string `yaml:"keys_env"`
	// ProtectMetrics makes /metrics require a key too. Default false:
	// Prometheus scrapes without one. /healthz, /readyz and /ping are
	// always open, for load balancers and probes.
	ProtectMetrics bool `yaml:"protect_metrics"`
	// Limits apply to each key on its own; an entry's rps=, tpm= and
	// concurrent= override them for that key.
	Limits Limits `yaml:"limits"`
}

// Limits bound one API key's traffic. Zero fields mean no limit.
type Limits struct {
	// RequestsPerSecond is the sustained rate of requests a key may send.
	RequestsPerSecond float64 `yaml:"requests_per_second"`
	// Burst is how many requests a key may send at once above that rate.
	// Default: RequestsPerSecond rounded up, at least 1.
	Burst int `yaml:"burst"`
	// TokensPerMinute bounds the tokens a key's generations use: each is
	// charged its prompt (estimated at 4 characters a token) plus its
	// max_tokens when admitted, and corrected to its reported usage when
	// it ends. A request may go past what is left if the bucket is full
	// (it is then in debt), so one large request is never refused forever.
	TokensPerMinute int `yaml:"tokens_per_minute"`
	// MaxConcurrent bounds a key's requests in flight, streamed or not.
	MaxConcurrent int `yaml:"max_concurrent"`
}

// Enabled reports whether c configures any keys.
func (c Config) Enabled() bool { return c.KeysFile != "" || c.KeysEnv != "" }

// validate reports the first invalid limit, by its configuration name
// under prefix.
func (l Limits) validate(prefix string) error {
	switch {
	case !(l.RequestsPerSecond >= 0):
		return fmt.Errorf("%srequests_per_second: must be positive, got %g", prefix, l.RequestsPerSecond)
	case l.Burst < 0:
		return fmt.Errorf("%sburst: must be positive, got %d", prefix, l.Burst)
	case l.Burst > 0 && l.RequestsPerSecond == 0:
		return fmt.Errorf("%sburst: needs requests_per_second", prefix)
	case l.TokensPerMinute < 0:
		return fmt.Errorf("%stokens_per_minute: must be positive, got %d", prefix, l.TokensPerMinute)
	case l.MaxConcurrent < 0:
		return fmt.Errorf("%smax_concurrent: must be positive, got %d", prefix, l.MaxConcurrent)
	}
	return nil
}

// Validate reports the first invalid field, by its configuration name
// (keys_file, limits.burst). It reads the keys, so that a bad entry stops
// the start rather than locking every client out.
func (c Config) Validate() error {
	if err := c.Limits.validate("limits."); err != nil {
		return err
	}
	if !c.Enabled() {
		if c.ProtectMetrics || c.Limits != (Limits{}) {
			return fmt.Errorf("keys_file: required (or keys_env) with protect_metrics or limits")
		}
		return nil
	}
	_, err := c.load()
	return err
}

// load reads and parses the configured keys. Its errors name the field.
func (c Config) load() ([]Entry, error) {
	var entries []Entry
	fromFile := 0
	if c.KeysFile != "" {
		b, err := os.ReadFile(c.KeysFile)
		if err != nil {
			return nil, fmt.Errorf("keys_file: %w", err)
		}
		if entries, err = ParseKeys(string(b)); err != nil {
			return nil, fmt.Errorf("keys_file: %s: %w", c.KeysFile, err)
		}
	}
	if c.KeysEnv != "" {
		v, ok := os.LookupEnv(c.KeysEnv)
		if !ok {
			return nil, fmt.Errorf("keys_env: $%s is not set", c.KeysEnv)
		}
		env, err := ParseKeys(envEntries(v))
		if err != nil {
			return nil, fmt.Errorf("keys_env: $%s: %w", c.KeysEnv, err)
		}
		fromFile = len(entries)
		entries = append(entries, env...)
	}
	seen := map[[32]byte]bool{}
	for i, e := range entries {
		if seen[e.Hash] {
			field := "keys_file"
			if i >= fromFile && c.KeysEnv != "" {
				field = "keys_env"
			}
			return nil, fmt.Errorf("%s: key %s is listed twice", field, e.ID())
		}
		seen[e.Hash] = true
	}
	return entries, nil
}
