package watch_test

import (
	"log"

	"github.com/batonllm/baton/scheduler/kvindex"
	"github.com/batonllm/baton/scheduler/watch"
	"github.com/batonllm/baton/workers/vllm/kvevents"
)

// ExampleTranslator shows how a watcher feeds one engine's events to the
// index.
func ExampleTranslator() {
	ix := kvindex.New(kvindex.Config{})
	sub, err := kvevents.New(kvevents.SubscriberConfig{
		Endpoint:       "tcp://10.0.0.7:5557",
		ReplayEndpoint: "tcp://10.0.0.7:5558",
		Topic:          "kv@10.0.0.7@llama",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer sub.Close()
	tr := watch.NewTranslator(watch.TranslatorConfig{Model: "llama"})
	for m := range sub.Messages() {
		var evs []kvindex.Event
		if m.Reset {
			// A snapshot of no blocks; set its Load to the latest load report.
			evs = []kvindex.Event{tr.Reset()}
		} else {
			evs = tr.Translate(m.Batch)
		}
		for _, ev := range evs {
			if err := ix.Apply("vllm-0", ev); err != nil {
				log.Print(err)
			}
		}
	}
}
