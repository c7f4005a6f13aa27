// Command llamafleet runs fake llama-servers (workers/llamacpp/llamatest:
// a per-slot prompt cache as llama-server keeps it, modelled prefill and
// token times) and writes a baton configuration naming them as llamacpp
// workers, for `baton serve --config` and `baton bench --target` to
// measure routing over engines that publish no KV events. It runs until
// interrupted.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/batonllm/baton/workers/llamacpp/llamatest"
)

func main() {
	n := flag.Int("n", 4, "servers")
	slots := flag.Int("slots", 4, "slots (--parallel) of each server, one cached prompt each")
	ctxTokens := flag.Int("ctx", 32768, "tokens a slot holds")
	prefill := flag.Duration("prefill-per-token", 100*time.Microsecond, "time each prompt token not reused takes")
	token := flag.Duration("token-time", 2*time.Millisecond, "time each generated token takes")
	model := flag.String("model", "llama-3.1-8b", "model served")
	out := flag.String("config", "llamafleet.yaml", "`file` the baton configuration is written to")
	kind := flag.String("kind", "llamacpp", "kind of the workers in the configuration: llamacpp, or http (a baton that predates llamacpp)")
	flag.Parse()
	f, err := os.Create(*out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "llamafleet:", err)
		os.Exit(1)
	}
	fmt.Fprintln(f, "workers:")
	for i := range *n {
		// Servers since late 2024 reuse their cached prompt unless told
		// not to.
		s := llamatest.New(llamatest.Config{Slots: *slots, CtxPerSlot: *ctxTokens, Model: *model,
			PrefillPerToken: *prefill, TokenTime: *token, CachePromptDefault: true})
		defer s.Close()
		fmt.Fprintf(f, "  - name: l%d\n    kind: %s\n    address: %s\n    models: [%s]\n", i, *kind, s.URL, *model)
	}
	if err := f.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "llamafleet:", err)
		os.Exit(1)
	}
	fmt.Printf("ready: %d servers of %d slots; configuration in %s\n", *n, *slots, *out)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, os.Interrupt, syscall.SIGTERM)
	<-stop
}
