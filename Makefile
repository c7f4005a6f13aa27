# baton — make targets. `make demo` runs an all-in-one local cluster;
# `make test` runs every test.

GO       ?= go
BIN      := bin
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS  := -X main.version=$(VERSION)

# Pinned code generators for `make proto`.
BUF_VERSION                := v1.75.0
PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.0

.PHONY: all build test test-short demo proto lint bench bench-proxy bench-index faults soak gobench clean

all: lint build test

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/baton ./cmd/baton

# Every test, with the race detector (the scheduler, pool, adapters and
# simulated engine are all concurrent). Tests start the servers they need
# themselves, on loopback ports: redis-server too, for the shared KV tier
# (transfer/kvstore/redistest: BATON_REDIS_SERVER or PATH's, else Debian's
# package installed when run as root), and HAProxy, in front of scheduler
# replicas (bench/haproxy, the same way). BATON_TEST_REDIS_ADDR=host:port
# lends them a running Redis for the tests that do not stop it (.ci/run
# does); it must be a throwaway one. Allocation counts mean nothing under
# -race (sync.Pool drops items), so the tests that count them run again
# without it.
test:
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 9m ./...
	$(GO) test -count=1 -run 'Allocate|TestCustomProfile' ./scheduler/routing/
	# Under the race detector sockets are read and written through
	# syscall's calls (workers/rawio); their raw path is tested without it.
	$(GO) test -count=1 ./workers/rawio/ ./scheduler/internal/h1serve/ ./workers/httpengine/ ./workers/vllm/kvevents/
	$(GO) test -count=1 -run 'TestOpenAIClient|TestMassDisconnectOpensNoBreaker|TestClientDisconnectCancelsWorker|TestFakeVLLM|TestBodySizeLimits|TestHTTPBackend|TestLlama|TestPDEngines' ./scheduler/

# The same without the race detector, for a quick loop.
test-short:
	$(GO) test -count=1 ./...

# ARGS are passed to baton demo: make demo ARGS="--listen 127.0.0.1:9090".
demo: build
	./$(BIN)/baton demo $(ARGS)

# The routing benchmark: every strategy replays the same long-context
# workload on a fresh simulated fleet (see bench/RESULTS.md). Time runs
# 1.25 times faster than the wall clock so that the four strategies fit
# in five minutes; the request sequence is the same as at --speedup 1.
bench: build
	./$(BIN)/baton bench --speedup 1.25

# The latency baton serve adds in front of an engine, beside HAProxy's:
# both run as their own processes and proxy the same simulated engine's
# own HTTP endpoint (see bench/RESULTS.md). ARGS go to the program:
# make bench-proxy ARGS="-n 10000". HAProxy is Debian's package, installed
# when run as root.
bench-proxy: build
	@command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy; \
	  else echo "haproxy is missing: run  sudo apt-get install -y haproxy"; exit 1; fi; }
	$(GO) run ./bench/cmd/proxybench -baton $(BIN)/baton $(ARGS)

# The KV index benchmark (bench/cmd/indexbench, see bench/RESULTS.md):
# the Mooncake trace's block hashes as the cache events of 8 to 1,000
# engines holding 1 Mi and 16 Mi blocks, plus a match query per request,
# offered at doubling rates from 16 K ops/s on one core, for both index
# kinds; about twenty minutes on a busy 2-core machine, and a few GB of
# memory (over 8 GB with -blocks 64M). Results and plots go to bench/results/index.
# ARGS go to the program: make bench-index ARGS="-workers 1000 -blocks 64M -kind events".
bench-index:
	nice -n 10 $(GO) run ./bench/cmd/indexbench $(ARGS)

# The fault matrix (bench/FAULTS.md): a disaggregated fleet of baton
# processes on loopback (redis-server, 2 prefill + 2 decode workers, two
# serve replicas) under a steady load while faults are injected one at a
# time, then together; about four minutes (ARGS="-quick": two). The soak
# holds 2,000 streams open against baton demo for 10 minutes
# (ARGS="-streams 500 -duration 2m" for less). Both run under nice.
faults: build
	nice -n 19 $(GO) run ./bench/cmd/faults -baton $(BIN)/baton $(ARGS)

soak: build
	nice -n 19 $(GO) run ./bench/cmd/faults -soak -baton $(BIN)/baton $(ARGS)

# Every go test benchmark.
gobench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# Regenerate proto/workerpb from proto/*.proto with buf, which compiles
# them itself (no protoc), and the pinned generators (proto/buf.gen.yaml):
# all three built from the Go module proxy; generating needs no network.
proto:
	GOBIN=$(CURDIR)/$(BIN) $(GO) install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)
	GOBIN=$(CURDIR)/$(BIN) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	GOBIN=$(CURDIR)/$(BIN) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	PATH=$(CURDIR)/$(BIN):$$PATH buf generate --template proto/buf.gen.yaml proto

clean:
	rm -rf $(BIN)
