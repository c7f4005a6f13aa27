package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
)

// decodeKillTransfer: the link in front of decode worker d0 holds a push
// to it once two of its blocks have passed (fresh clients send documents nobody
// sent before, so that pushes are whole and frequent), and d0 is
// SIGKILLed while the push is held: its prefill worker's transfer breaks
// off, the request falls back to another decode worker, and the prefill
// worker, which did nothing wrong, must not be counted against.
func decodeKillTransfer(fresh int, hold time.Duration) fault {
	const victim = "d0"
	return fault{name: "decode-kill-transfer",
		what: fmt.Sprintf("the link to decode worker %s holds a KV push to it once 64 KiB (two blocks) of it have passed (at most %s; %d more clients send prompts over new documents, pushed whole), and %s is SIGKILLed while it is held; restarted at the window's end", victim, hold, fresh, victim),
		inject: func(ctx context.Context, h *harness) (string, error) {
			h.setMark(ctx)
			hd := h.f.links[victim].holdPush(64<<10, hold)
			h.background(ctx, freshClients(fresh, false))
			wait := time.NewTimer(10 * time.Second)
			defer wait.Stop()
			select {
			case <-hd.held:
			case <-wait.C:
			case <-ctx.Done():
			}
			select {
			case <-hd.held:
			default:
				h.f.links[victim].disarm(hd)
				h.stopBackground()
				return "", fmt.Errorf("no push to %s reached its link within 10s", victim)
			}
			h.f.workers[victim].kill()
			hd.release()
			return fmt.Sprintf("a push to %s held after %d KiB of it had passed, with %d pushes open on its connection; %s killed %s into the hold",
				victim, hd.before>>10, hd.pending, victim, time.Since(hd.at).Round(time.Millisecond)), nil
		},
		recover: func(ctx context.Context, h *harness) error {
			h.stopBackground()
			if err := h.f.restartWorker(victim, h.f.timeScale); err != nil {
				return err
			}
			h.restarted = h.scrapeReplicas(context.WithoutCancel(ctx))
			return nil
		},
		check: func(ctx context.Context, h *harness, w *window) (string, error) {
			note, cut, opened := h.transferKillNote(ctx, w, victim)
			again, _ := reopened(victim)(ctx, h, w)
			note += "; " + again
			switch {
			case cut == 0:
				return note, errors.New("no transfer was broken off")
			case len(opened) > 0:
				return note, fmt.Errorf("the breaker of prefill worker %s opened", strings.Join(opened, ", "))
			}
			return note, nil
		},
	}
}

// background runs side until stopBackground.
func (h *harness) background(ctx context.Context, side func(context.Context, *harness)) {
	bctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { side(bctx, h) })
	h.stopBg = func() { cancel(); wg.Wait() }
}

// stopBackground stops what background started, and waits for it.
func (h *harness) stopBackground() {
	if h.stopBg != nil {
		h.stopBg()
		h.stopBg = nil
	}
}

// transferKillNote says, since the mark, how many transfers the prefill
// workers saw fail, what the replicas did with the requests (counted over
// both), and which prefill workers' breakers opened on either replica.
func (h *harness) transferKillNote(ctx context.Context, w *window, victim string) (note string, cut float64, opened []string) {
	var prefill []string
	for _, n := range h.f.names {
		if strings.HasPrefix(n, "p") {
			prefill = append(prefill, n)
		}
	}
	now := h.scrapeReplicas(ctx)
	pushFailed := workerDelta(w, prefill, "baton_worker_transfer_failures_total", map[string]string{"direction": "sent"})
	cut = h.replicaDelta(now, "baton_transfer_failures_total", map[string]string{"reason": "transfer"})
	local := h.replicaDelta(now, "baton_disagg_decisions_total", map[string]string{"decision": "local", "reason": "transfer_failed"})
	retried := h.replicaDelta(now, "baton_fallbacks_total", map[string]string{"reason": "decode_retry"})
	var breakers []string
	for _, p := range prefill {
		to := map[string]float64{}
		for _, s := range []string{"open", "half-open", "closed"} {
			to[s] = h.replicaDelta(now, "baton_breaker_transitions_total", map[string]string{"worker": p, "to": s})
		}
		breakers = append(breakers, fmt.Sprintf("%s →open %.0f", p, to["open"]))
		if to["open"] > 0 {
			opened = append(opened, p)
		}
	}
	// Transfers that failed once the decode worker was back: the prefill
	// workers' connections to it reconnecting.
	var late float64
	for i, m := range now {
		if m != nil && i < len(h.restarted) && h.restarted[i] != nil {
			late += m.sum("baton_transfer_failures_total", map[string]string{"reason": "transfer"}) -
				h.restarted[i].sum("baton_transfer_failures_total", map[string]string{"reason": "transfer"})
		}
	}
	note = fmt.Sprintf("prefill workers: %.0f pushes broken off; replicas: %.0f transfers failed (the push, or asking the decode worker what it holds), %.0f of them after %s's restart; %.0f requests then prefilled on the decode worker, %.0f sent to another decode worker; prefill workers' breakers on both replicas: %s",
		pushFailed, cut, late, victim, local, retried, strings.Join(breakers, ", "))
	return note, cut, opened
}
