package scheduler_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/sony/gobreaker/v2"

	"github.com/batonllm/baton/scheduler"
	"github.com/batonllm/baton/scheduler/internal/auth"
	"github.com/batonllm/baton/scheduler/routing"
)

// API keys of the tests, each at least auth.MinKeyLength characters.
const (
	keyA      = "sk-test-tenant-a-0000000000"
	keyB      = "sk-test-tenant-b-0000000000"
	keyHashed = "sk-test-hashed-000000000000"
	keyEnv    = "sk-test-from-env-0000000000"
	keyNew    = "sk-test-added-later-0000000"
	keyRPS    = "sk-test-one-per-second-0000"
	keyStream = "sk-test-one-stream-00000000"
	keyTokens = "sk-test-few-tokens-00000000"
)

func sha256Hex(s string) string {
	h := sha256.Sum256([]byte(s))
	return hex.EncodeToString(h[:])
}

// writeKeys writes a keys file of lines into dir and returns its path.
func writeKeys(t *testing.T, path string, lines ...string) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// keyClient is oaClient sending key.
func keyClient(t testing.TB, addr, key string) openai.Client {
	return openai.NewClient(
		option.WithBaseURL("http://"+addr+"/v1"),
		option.WithAPIKey(key),
		option.WithMaxRetries(0),
		option.WithHTTPClient(httpClient(t)),
	)
}

// typedError returns err as the OpenAI client's typed error, failing the
// test when it is not one of status.
func typedError(t *testing.T, err error, status int) *openai.Error {
	t.Helper()
	var e *openai.Error
	if !errors.As(err, &e) {
		t.Fatalf("err = %v, want an *openai.Error with status %d", err, status)
	}
	if e.StatusCode != status {
		t.Fatalf("status = %d (%s), want %d", e.StatusCode, e.Message, status)
	}
	return e
}

// get sends a GET to addr+path with key (none if "") and returns the
// status and body.
func get(t *testing.T, hc *http.Client, addr, path, key string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestAuth serves a scheduler behind API keys from a file and an
// environment variable and drives it with the OpenAI client: keys are
// checked, bound keys keep to their tenant's cache, reloads add and remove
// keys, and each key's limits refuse with a 429 before any worker is used.
func TestAuth(t *testing.T) {
	t.Setenv("BATON_TEST_KEYS", keyEnv)
	// One worker: every request meets the same cache, so only the tenant
	// salt can keep two keys' prompts apart. Slow enough that a long
	// stream lasts while the test looks at it.
	_, workers := startWorkers(t, 1, 20)
	keysFile := writeKeys(t, filepath.Join(t.TempDir(), "keys"),
		"# tenants a and b",
		keyA+" tenant=tenant-a",
		keyB+" tenant=tenant-b",
		"sha256:"+sha256Hex(keyHashed),
		keyRPS+" rps=1",
		keyStream+" concurrent=1",
		keyTokens+" tpm=200",
	)
	cfg := scheduler.Config{
		Strategy: "prefix_aware",
		Workers:  workers,
		Pool:     fastPool(),
		Auth:     auth.Config{KeysFile: keysFile, KeysEnv: "BATON_TEST_KEYS"},
	}
	s, addr := startScheduler(t, cfg)
	hc := httpClient(t)

	t.Run("no key", func(t *testing.T) {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+"/v1/models", nil)
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var body struct {
			Error map[string]any `json:"error"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusUnauthorized || !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Bearer") {
			t.Errorf("status %d, WWW-Authenticate %q; want 401 and Bearer", resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
		}
		e := body.Error
		if e["type"] != "invalid_request_error" || e["code"] != "invalid_api_key" || e["message"] == "" {
			t.Errorf("error = %v, want type invalid_request_error, code invalid_api_key and a message", e)
		}
		if p, ok := e["param"]; !ok || p != nil {
			t.Errorf("error.param = %v (present %v), want null", p, ok)
		}
	})

	t.Run("wrong key", func(t *testing.T) {
		c := keyClient(t, addr, "sk-test-not-a-key-0000000000")
		_, err := c.Chat.Completions.New(ctxT(t, 10*time.Second), chatParams("Hello.", 4))
		e := typedError(t, err, http.StatusUnauthorized)
		if e.Code != "invalid_api_key" || e.Type != "invalid_request_error" {
			t.Errorf("code %q type %q, want invalid_api_key and invalid_request_error", e.Code, e.Type)
		}
	})

	t.Run("good keys", func(t *testing.T) {
		for name, key := range map[string]string{"file": keyA, "hashed": keyHashed, "env": keyEnv} {
			if got := chat(t, keyClient(t, addr, key), chatParams("Hello.", 4)); got.content == "" {
				t.Errorf("%s key: empty answer", name)
			}
		}
	})

	t.Run("probes and metrics open", func(t *testing.T) {
		for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
			if code, _ := get(t, hc, addr, path, ""); code != http.StatusOK {
				t.Errorf("GET %s without a key: %d, want 200", path, code)
			}
		}
		_, metrics := get(t, hc, addr, "/metrics", "")
		for _, want := range []string{
			`baton_auth_requests_total{key="",outcome="unauthorized"}`,
			`baton_auth_requests_total{key="` + sha256Hex(keyA)[:8] + `",outcome="accepted"}`,
		} {
			if !strings.Contains(metrics, want) {
				t.Errorf("metrics lack %s", want)
			}
		}
		for _, key := range []string{keyA, keyHashed, keyEnv} {
			if strings.Contains(metrics, key) {
				t.Errorf("metrics show a key")
			}
		}
	})

	t.Run("bound tenant", func(t *testing.T) {
		prompt := text("bound tenant", 3000)
		// Both keys claim the same tenant: each key's own wins.
		p := chatParams(prompt, 4)
		p.PromptCacheKey = openai.String("shared")
		a := keyClient(t, addr, keyA)
		b := keyClient(t, addr, keyB)
		if got := chat(t, a, p); got.cached != 0 {
			t.Fatalf("key A's first request: cached_tokens = %d, want 0", got.cached)
		}
		if got := chat(t, a, p); got.cached == 0 {
			t.Errorf("key A's second request: cached_tokens = 0, want a hit")
		}
		if got := chat(t, b, p, option.WithHeader("X-Prefix-Aware-Id", "shared")); got.cached != 0 {
			t.Errorf("key B, claiming A's tenant: cached_tokens = %d, want 0", got.cached)
		}
	})

	t.Run("requests per second", func(t *testing.T) {
		c := keyClient(t, addr, keyRPS)
		chat(t, c, chatParams("Hello.", 4))
		var resp *http.Response
		_, err := c.Chat.Completions.New(ctxT(t, 10*time.Second), chatParams("Hello.", 4), option.WithResponseInto(&resp))
		e := typedError(t, err, http.StatusTooManyRequests)
		if e.Code != "rate_limit_exceeded" || e.Type != "requests" {
			t.Errorf("code %q type %q, want rate_limit_exceeded and requests", e.Code, e.Type)
		}
		if ra := resp.Header.Get("Retry-After"); ra != "1" {
			t.Errorf("Retry-After = %q, want 1", ra)
		}
	})

	t.Run("concurrent streams", func(t *testing.T) {
		c := keyClient(t, addr, keyStream)
		stream := c.Chat.Completions.NewStreaming(ctxT(t, 10*time.Second), chatParams("Tell a long story.", 20000))
		defer stream.Close()
		if !stream.Next() {
			t.Fatalf("first stream: %v", stream.Err())
		}
		second := c.Chat.Completions.NewStreaming(ctxT(t, 10*time.Second), chatParams("Another story.", 4))
		second.Next()
		e := typedError(t, second.Err(), http.StatusTooManyRequests)
		if e.Type != "concurrent" {
			t.Errorf("type %q, want concurrent", e.Type)
		}
		second.Close()
		stream.Close()
		// The slot is free once the first stream's request ends.
		eventually(t, 5*time.Second, func() error {
			_, err := c.Chat.Completions.New(ctxT(t, 10*time.Second), chatParams("Hello.", 4))
			return err
		})
	})

	t.Run("tokens per minute", func(t *testing.T) {
		c := keyClient(t, addr, keyTokens)
		// Of 200 tokens a minute, these use about 35 each, then about
		// 100 (the estimate counts max_tokens in full), leaving too few
		// for an estimate of 150.
		chat(t, c, chatParams(text("tokens", 100), 4))
		chat(t, c, chatParams(text("tokens", 100), 4))
		chat(t, c, chatParams("Hello.", 100))
		_, err := c.Chat.Completions.New(ctxT(t, 10*time.Second), chatParams("Hello.", 150))
		if e := typedError(t, err, http.StatusTooManyRequests); e.Type != "tokens" {
			t.Errorf("type %q, want tokens", e.Type)
		}
	})

	t.Run("refusals spare the workers", func(t *testing.T) {
		for _, w := range s.Pool.Snapshot().Workers {
			if st := w.BreakerState(); st != gobreaker.StateClosed {
				t.Errorf("worker %s: breaker %v, want closed", w.Name, st)
			}
		}
		_, metrics := get(t, hc, addr, "/metrics", "")
		for _, limit := range []string{"requests", "concurrent", "tokens"} {
			if !strings.Contains(metrics, `limit="`+limit+`"}`) {
				t.Errorf("metrics lack requests refused for %s", limit)
			}
		}
	})

	t.Run("reload", func(t *testing.T) {
		c := keyClient(t, addr, keyNew)
		if _, err := c.Models.List(ctxT(t, 10*time.Second)); err == nil {
			t.Fatal("a key not yet in the file was accepted")
		}
		writeKeys(t, keysFile, keyNew, keyB+" tenant=tenant-b")
		if err := s.ReloadKeys(); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Models.List(ctxT(t, 10*time.Second)); err != nil {
			t.Errorf("added key: %v", err)
		}
		old := keyClient(t, addr, keyA)
		_, err := old.Models.List(ctxT(t, 10*time.Second))
		typedError(t, err, http.StatusUnauthorized)

		// A bad file is refused and the keys in use stay.
		writeKeys(t, keysFile, "sha256:abc")
		if err := s.ReloadKeys(); err == nil || !strings.Contains(err.Error(), "line 1") {
			t.Errorf("reload of a bad file: %v, want an error naming line 1", err)
		}
		if _, err := c.Models.List(ctxT(t, 10*time.Second)); err != nil {
			t.Errorf("after a failed reload: %v", err)
		}
	})
}

// TestAuthProtectMetrics: with protect_metrics, /metrics needs a key and
// the probes still do not.
func TestAuthProtectMetrics(t *testing.T) {
	_, workers := startWorkers(t, 1, fastScale)
	keys := writeKeys(t, filepath.Join(t.TempDir(), "keys"), keyA)
	_, addr := startScheduler(t, scheduler.Config{Workers: workers, Auth: auth.Config{KeysFile: keys, ProtectMetrics: true}})
	hc := httpClient(t)
	for _, tc := range []struct {
		path, key string
		want      int
	}{
		{"/metrics", "", http.StatusUnauthorized},
		{"/metrics", keyA, http.StatusOK},
		{"/healthz", "", http.StatusOK},
		{"/readyz", "", http.StatusOK},
	} {
		if code, _ := get(t, hc, addr, tc.path, tc.key); code != tc.want {
			t.Errorf("GET %s with key %v: %d, want %d", tc.path, tc.key != "", code, tc.want)
		}
	}
}

// TestAuthConfigErrors: invalid auth settings stop the start with an error
// naming the field.
func TestAuthConfigErrors(t *testing.T) {
	dir := t.TempDir()
	badHash := writeKeys(t, filepath.Join(dir, "bad-hash"), keyA, "sha256:0123")
	short := writeKeys(t, filepath.Join(dir, "short"), "sk-short")
	twice := writeKeys(t, filepath.Join(dir, "twice"), keyA, "sha256:"+sha256Hex(keyA))
	badOpt := writeKeys(t, filepath.Join(dir, "bad-option"), keyA+" rps=-1")
	good := writeKeys(t, filepath.Join(dir, "good"), keyA)
	reg := &routing.Registry{}
	routing.RegisterBuiltins(reg)
	for _, tc := range []struct {
		name string
		auth auth.Config
		want string
	}{
		{"missing file", auth.Config{KeysFile: filepath.Join(dir, "nope")}, "auth.keys_file: open "},
		{"bad hash", auth.Config{KeysFile: badHash}, "auth.keys_file: " + badHash + ": line 2: sha256: needs 64 hex digits"},
		{"short key", auth.Config{KeysFile: short}, "line 1: key shorter than 16 characters"},
		{"key twice", auth.Config{KeysFile: twice}, "auth.keys_file: key " + sha256Hex(keyA)[:8] + " is listed twice"},
		{"bad option", auth.Config{KeysFile: badOpt}, "line 1: rps: must be a positive number"},
		{"unset env", auth.Config{KeysEnv: "BATON_TEST_UNSET_KEYS"}, "auth.keys_env: $BATON_TEST_UNSET_KEYS is not set"},
		{"negative rate", auth.Config{KeysFile: good, Limits: auth.Limits{RequestsPerSecond: -1}}, "auth.limits.requests_per_second: must be positive"},
		{"burst without rate", auth.Config{KeysFile: good, Limits: auth.Limits{Burst: 3}}, "auth.limits.burst: needs requests_per_second"},
		{"limits without keys", auth.Config{Limits: auth.Limits{MaxConcurrent: 3}}, "auth.keys_file: required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := scheduler.Config{Workers: []scheduler.WorkerConfig{{Address: "127.0.0.1:1"}}, Auth: tc.auth}
			err := cfg.Validate(reg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestAuthLoadConfig: the auth section reads from YAML, and a misspelt
// field is named with its likely meaning.
func TestAuthLoadConfig(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "baton.yaml")
	write := func(s string) {
		if err := os.WriteFile(path, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("auth:\n  keys_file: /etc/baton/keys\n  protect_metrics: true\n  limits:\n    requests_per_second: 2.5\n    max_concurrent: 4\n")
	cfg, err := scheduler.LoadConfig(path)
	if err != nil {
		t.Fatal(err)
	}
	want := auth.Config{KeysFile: "/etc/baton/keys", ProtectMetrics: true, Limits: auth.Limits{RequestsPerSecond: 2.5, MaxConcurrent: 4}}
	if cfg.Auth != want {
		t.Errorf("auth = %+v, want %+v", cfg.Auth, want)
	}
	write("auth:\n  keys_fiel: /etc/baton/keys\n")
	if _, err := scheduler.LoadConfig(path); err == nil || !strings.Contains(err.Error(), "auth.keys_fiel") || !strings.Contains(err.Error(), "keys_file") {
		t.Errorf("misspelt field: %v, want an error naming auth.keys_fiel and suggesting keys_file", err)
	}
}
