// Package auth checks API keys (Authorization: Bearer) in front of the
// scheduler's HTTP API and holds each key to its limits: requests per
// second, tokens per minute and requests in flight. Keys are kept as
// SHA-256 hashes and compared in constant time; a key may be bound to a
// tenant, which then salts every request it makes.
package auth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"log/slog"
	"math"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/batonllm/baton/workers/openai"
)

// Outcomes of baton_auth_requests_total.
const (
	OutcomeAccepted     = "accepted"
	OutcomeUnauthorized = "unauthorized"
	OutcomeRateLimited  = "rate_limited"
)

// Limits named by baton_auth_rate_limited_total and by 429s' error type,
// as OpenAI names its own.
const (
	LimitRequests   = "requests"
	LimitTokens     = "tokens"
	LimitConcurrent = "concurrent"
)

// Auth is an http.Handler wrapper checking API keys, and the front end's
// admission of generation requests (frontend.Admission). Safe for
// concurrent use.
type Auth struct {
	cfg Config
	log *slog.Logger

	keys     atomic.Pointer[[]*key] // replaced whole by Reload
	reloadMu sync.Mutex

	requests *prometheus.CounterVec
	limited  *prometheus.CounterVec
	loaded   prometheus.Gauge
}

// key is one configured key with its limiters.
type key struct {
	Entry
	id    string
	state *state
}

// state is a key's limiters, kept across reloads while its limits stay.
type state struct {
	limits   Limits
	rps      *rate.Limiter // nil: no limit
	tokens   *bucket       // nil: no limit
	inFlight *atomic.Int64 // kept across reloads even when the limits change
}

// New reads cfg's keys and returns an Auth, its metrics registered on reg
// (nil: not registered). A nil log discards.
func New(cfg Config, reg prometheus.Registerer, log *slog.Logger) (*Auth, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Auth{
		cfg: cfg,
		log: log,
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_auth_requests_total",
			Help: "Requests checked for an API key, by key (the first 8 hex digits of its SHA-256; empty when no valid key was sent) and outcome (accepted, unauthorized, rate_limited).",
		}, []string{"key", "outcome"}),
		limited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "baton_auth_rate_limited_total",
			Help: "Requests refused with a 429 for a key's limit, by key and limit (requests, tokens, concurrent).",
		}, []string{"key", "limit"}),
		loaded: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "baton_auth_keys",
			Help: "API keys loaded.",
		}),
	}
	if reg != nil {
		reg.MustRegister(a.requests, a.limited, a.loaded)
	}
	if err := a.Reload(); err != nil {
		return nil, err
	}
	return a, nil
}

// Reload reads the keys again (baton serve does on SIGHUP). On error the
// keys in use stay. Limiters of keys that stay, with the same limits, keep
// their state, so a reload does not reset anyone's budget.
func (a *Auth) Reload() error {
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	entries, err := a.cfg.load()
	if err != nil {
		a.log.Warn("api keys not reloaded; the previous ones stay", "err", err)
		return err
	}
	old := map[[32]byte]*state{}
	if p := a.keys.Load(); p != nil {
		for _, k := range *p {
			old[k.Hash] = k.state
		}
	}
	now := time.Now()
	keys := make([]*key, 0, len(entries))
	for _, e := range entries {
		lim := a.cfg.Limits.merge(e.Limits)
		st := old[e.Hash]
		switch {
		case st == nil:
			st = newState(lim, new(atomic.Int64), now)
		case st.limits != lim:
			st = newState(lim, st.inFlight, now)
		}
		keys = append(keys, &key{Entry: e, id: e.ID(), state: st})
	}
	a.keys.Store(&keys)
	a.loaded.Set(float64(len(keys)))
	if len(keys) == 0 {
		a.log.Warn("no api keys configured: every request is refused")
	} else {
		a.log.Info("api keys loaded", "keys", len(keys))
	}
	return nil
}

func newState(l Limits, inFlight *atomic.Int64, now time.Time) *state {
	s := &state{limits: l, inFlight: inFlight}
	if l.RequestsPerSecond > 0 {
		burst := l.Burst
		if burst == 0 {
			burst = max(1, int(math.Ceil(l.RequestsPerSecond)))
		}
		s.rps = rate.NewLimiter(rate.Limit(l.RequestsPerSecond), burst)
	}
	if l.TokensPerMinute > 0 {
		s.tokens = newBucket(l.TokensPerMinute, now)
	}
	return s
}

// lookup returns the key whose hash matches the bearer token of an
// Authorization header, or nil. Every key is compared, in constant time,
// so that timing tells nothing of which one came close.
func (a *Auth) lookup(header string) *key {
	scheme, token, ok := strings.Cut(header, " ")
	token = strings.TrimSpace(token)
	if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" {
		return nil
	}
	h := sha256.Sum256([]byte(token))
	var found *key
	for _, k := range *a.keys.Load() {
		if subtle.ConstantTimeCompare(k.Hash[:], h[:]) == 1 {
			found = k
		}
	}
	return found
}

// open reports whether path is served without a key.
func (a *Auth) open(path string) bool {
	switch path {
	case "/healthz", "/readyz", "/ping":
		return true
	case "/metrics":
		return !a.cfg.ProtectMetrics
	}
	return false
}

// call is one authenticated request, in its context.
type call struct {
	key      *key
	admitted bool // counted by Admit
	charged  int  // tokens taken from the key's bucket
}

type callKey struct{}

// Wrap returns next behind the key check: a request without a valid key
// gets a 401, one over its key's request rate or concurrency a 429, in
// OpenAI's error shape. Probes, and /metrics unless protect_metrics, pass.
func (a *Auth) Wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.open(r.URL.Path) {
			next.ServeHTTP(w, r)
			return
		}
		header := r.Header.Get("Authorization")
		k := a.lookup(header)
		if k == nil {
			a.requests.WithLabelValues("", OutcomeUnauthorized).Inc()
			w.Header().Set("WWW-Authenticate", `Bearer realm="baton"`)
			msg := "Incorrect API key provided."
			if header == "" {
				msg = "You didn't provide an API key. Send it in an Authorization header: Bearer <key>."
			}
			openai.WriteError(w, &openai.Error{Status: http.StatusUnauthorized, Type: openai.TypeInvalidRequest, Code: "invalid_api_key", Message: msg})
			return
		}
		st := k.state
		if st.rps != nil {
			now := time.Now()
			res := st.rps.ReserveN(now, 1)
			if d := res.DelayFrom(now); d > 0 {
				res.CancelAt(now)
				a.refuse(w, k, LimitRequests, d)
				return
			}
		}
		n := st.inFlight.Add(1)
		defer st.inFlight.Add(-1)
		if m := st.limits.MaxConcurrent; m > 0 && n > int64(m) {
			// Requests in flight end at their own pace: a second is a
			// guess, which clients treat as a back-off hint.
			a.refuse(w, k, LimitConcurrent, time.Second)
			return
		}
		c := &call{key: k}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callKey{}, c)))
		if !c.admitted && c.charged == 0 {
			a.requests.WithLabelValues(k.id, OutcomeAccepted).Inc()
		}
	})
}

// refuse answers a 429 for k's limit, to retry after d.
func (a *Auth) refuse(w http.ResponseWriter, k *key, limit string, d time.Duration) {
	openai.WriteError(w, a.limitError(k, limit, d))
}

func (a *Auth) limitError(k *key, limit string, d time.Duration) *openai.Error {
	a.requests.WithLabelValues(k.id, OutcomeRateLimited).Inc()
	a.limited.WithLabelValues(k.id, limit).Inc()
	what := map[string]string{
		LimitRequests:   "requests per second",
		LimitTokens:     "tokens per minute",
		LimitConcurrent: "requests in flight",
	}[limit]
	return &openai.Error{
		Status: http.StatusTooManyRequests, Type: limit, Code: "rate_limit_exceeded",
		Message:    "Rate limit reached for " + what + " of API key " + k.id + ". Please try again in " + d.Round(time.Millisecond).String() + ".",
		RetryAfter: max(1, int(math.Ceil(d.Seconds()))),
	}
}

// Admit implements frontend.Admission: it charges a generation request's
// estimated tokens to its key and returns the key's tenant.
func (a *Auth) Admit(ctx context.Context, estimate int) (string, error) {
	c, _ := ctx.Value(callKey{}).(*call)
	if c == nil {
		return "", nil
	}
	if b := c.key.state.tokens; b != nil && estimate > 0 {
		if d, ok := b.take(estimate, time.Now()); !ok {
			c.charged = -1 // counted as rate limited
			return "", a.limitError(c.key, LimitTokens, d)
		}
		c.charged = estimate
	}
	c.admitted = true
	a.requests.WithLabelValues(c.key.id, OutcomeAccepted).Inc()
	return c.key.Tenant, nil
}

// Done implements frontend.Admission: it corrects the tokens charged to
// the request's key to those it used (negative: unknown, the estimate
// stays).
func (a *Auth) Done(ctx context.Context, used int) {
	c, _ := ctx.Value(callKey{}).(*call)
	if c == nil || c.charged <= 0 || used < 0 {
		return
	}
	c.key.state.tokens.give(c.charged - used)
}

// bucket is a token bucket of a key's tokens per minute. Unlike
// rate.Limiter it gives tokens back, which correcting an estimate needs.
type bucket struct {
	mu       sync.Mutex
	capacity float64
	perSec   float64
	tokens   float64 // negative: in debt
	last     time.Time
}

func newBucket(perMinute int, now time.Time) *bucket {
	return &bucket{capacity: float64(perMinute), perSec: float64(perMinute) / 60, tokens: float64(perMinute), last: now}
}

// take charges n tokens if the bucket holds them, or holds its capacity
// when n is larger; else it returns how long until it would.
func (b *bucket) take(n int, now time.Time) (time.Duration, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if now.After(b.last) {
		b.tokens = min(b.capacity, b.tokens+now.Sub(b.last).Seconds()*b.perSec)
		b.last = now
	}
	need := min(float64(n), b.capacity)
	if b.tokens >= need {
		b.tokens -= float64(n)
		return 0, true
	}
	return time.Duration((need - b.tokens) / b.perSec * float64(time.Second)), false
}

// give returns n tokens (negative: charges them), up to the capacity.
func (b *bucket) give(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.tokens = min(b.capacity, b.tokens+float64(n))
}
