package scheduler_test

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/batonllm/baton/scheduler"
)

// prefixFleet serves prefix_aware over three fast simulated workers.
func prefixFleet(t *testing.T) openai.Client {
	_, workers := startWorkers(t, 3, fastScale)
	_, addr := startScheduler(t, scheduler.Config{Strategy: "prefix_aware", Workers: workers, Pool: fastPool()})
	return oaClient(t, addr)
}

// TestPrefixAwareSharedPrefix: requests whose routing text agrees on its
// first PrefixLength (4,096) characters meet on one worker, whatever
// follows.
func TestPrefixAwareSharedPrefix(t *testing.T) {
	c := prefixFleet(t)
	prefix := text("shared", 5000)
	used := map[string]int{}
	var cachedAfterFirst int64
	for i := range 20 {
		got := chat(t, c, chatParams(prefix+fmt.Sprintf(" question %d: why?", i), 4))
		used[got.worker]++
		if i > 0 {
			cachedAfterFirst += got.cached
		}
	}
	if len(used) != 1 {
		t.Errorf("20 requests sharing a 5,000-character prefix went to %v, want one worker", used)
	}
	if cachedAfterFirst == 0 {
		t.Error("requests 2–20 reported no cached tokens, want their shared prefix cached")
	}
}

// TestPrefixAwareTenants: the tenant (prompt_cache_key or
// X-Prefix-Aware-Id) seeds the routing key, so tenants sending the same
// prompt spread over the workers, and a tenant never hits another tenant's
// cache.
func TestPrefixAwareTenants(t *testing.T) {
	c := prefixFleet(t)
	prompt := text("tenants", 3000)

	t.Run("spread", func(t *testing.T) {
		used := map[string]int{}
		for i := range 30 {
			p := chatParams(prompt, 4)
			var opts []option.RequestOption
			if i%2 == 0 {
				p.PromptCacheKey = openai.String(fmt.Sprintf("spread-tenant-%d", i))
			} else {
				opts = append(opts, option.WithHeader("X-Prefix-Aware-Id", fmt.Sprintf("spread-tenant-%d", i)))
			}
			used[chat(t, c, p, opts...).worker]++
		}
		if len(used) < 2 {
			t.Errorf("30 tenants with one prompt went to %v, want at least 2 workers", used)
		}
	})

	t.Run("cache isolation", func(t *testing.T) {
		withTenant := func(tenant string) openai.ChatCompletionNewParams {
			p := chatParams(prompt, 4)
			p.PromptCacheKey = openai.String(tenant)
			return p
		}
		a1 := chat(t, c, withTenant("tenant-a"))
		if a1.cached != 0 {
			t.Errorf("tenant A's first request: cached_tokens = %d, want 0", a1.cached)
		}
		a2 := chat(t, c, withTenant("tenant-a"))
		if a2.worker != a1.worker || a2.cached == 0 {
			t.Errorf("tenant A's second request: worker %q cached_tokens %d, want worker %q and cached_tokens > 0", a2.worker, a2.cached, a1.worker)
		}
		// Routing is deterministic in the tenant, so some of these land on
		// A's worker, where A's blocks are cached.
		sameWorker := map[string]bool{}
		for i := range 12 {
			tenant := fmt.Sprintf("tenant-b%d", i)
			b := chat(t, c, withTenant(tenant))
			if b.cached != 0 {
				t.Errorf("%s's first request (worker %s): cached_tokens = %d, want 0", tenant, b.worker, b.cached)
			}
			sameWorker[tenant] = b.worker == a1.worker
		}
		if !slices.Contains(slices.Collect(maps.Values(sameWorker)), true) {
			t.Errorf("no B tenant shared tenant A's worker %s: the isolation check proved nothing", a1.worker)
		}
	})
}
