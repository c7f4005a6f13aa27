package grpcworker

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/proto/workerpb"
	"github.com/batonllm/baton/workers/engine"
)

func TestPrefillRoundTrip(t *testing.T) {
	var got *workerpb.PrefillRequest
	w := &fakeWorker{prefill: func(_ context.Context, req *workerpb.PrefillRequest) (*workerpb.PrefillResult, error) {
		got = req
		return &workerpb.PrefillResult{
			PromptTokens: 100, CachedTokens: 32, DecodeHeldTokens: 16,
			BlocksSent: 4, BlocksHeld: 1, BytesSent: 4096, BlocksRejected: 1,
			QueueSeconds: 0.001, PrefillSeconds: 0.25, TransferSeconds: 0.5,
		}, nil
	}}
	c := dial(t, startServer(t, w).addr)
	res, err := c.Prefill(testContext(t), &engine.PrefillRequest{
		Request:         &engine.Request{ID: "r", Model: "m", Tenant: "t", Prompt: "p", MaxTokens: 3, Stop: []string{"x"}},
		TransferID:      "tid",
		DecodeAddr:      "d:1",
		MinRemoteTokens: 64,
		TransferTimeout: 1500*time.Millisecond + time.Microsecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	want := &engine.PrefillResult{
		PromptTokens: 100, CachedTokens: 32, DecodeHeldTokens: 16,
		BlocksSent: 4, BlocksHeld: 1, BytesSent: 4096, BlocksRejected: 1,
		Queue: time.Millisecond, Prefill: 250 * time.Millisecond, Transfer: 500 * time.Millisecond,
	}
	if diff := cmp.Diff(want, res); diff != "" {
		t.Errorf("result (-want +got):\n%s", diff)
	}
	r := got.GetRequest()
	if got.GetTransferId() != "tid" || got.GetDecodeAddr() != "d:1" || got.GetMinRemotePrefillTokens() != 64 ||
		got.GetTransferTimeoutMs() != 1501 || r.GetRequestId() != "r" || r.GetModel() != "m" || r.GetTenant() != "t" ||
		r.GetPrompt() != "p" || r.GetMaxTokens() != 3 || !cmp.Equal(r.GetStop(), []string{"x"}) {
		t.Errorf("worker got %v", got)
	}

	w.prefill = func(context.Context, *workerpb.PrefillRequest) (*workerpb.PrefillResult, error) {
		return &workerpb.PrefillResult{Skipped: true, SkipReason: "short", PromptTokens: 5}, nil
	}
	res, err = c.Prefill(testContext(t), &engine.PrefillRequest{Request: &engine.Request{Model: "m", Prompt: "p"}})
	if err != nil || !res.Skipped || res.SkipReason != "short" || res.PromptTokens != 5 {
		t.Errorf("skipped Prefill = %+v, %v", res, err)
	}
	if _, err := c.Prefill(testContext(t), nil); !errors.Is(err, ErrInvalid) {
		t.Errorf("Prefill(nil) = %v", err)
	}
}

func TestPrefillErrors(t *testing.T) {
	for _, tt := range []struct {
		code codes.Code
		want error
	}{
		{codes.Unavailable, engine.ErrUnavailable},
		{codes.Unimplemented, engine.ErrUnavailable},
		{codes.NotFound, ErrUnknownModel},
		{codes.InvalidArgument, ErrInvalid},
		{codes.DeadlineExceeded, context.DeadlineExceeded},
	} {
		w := &fakeWorker{prefill: func(context.Context, *workerpb.PrefillRequest) (*workerpb.PrefillResult, error) {
			return nil, status.Error(tt.code, "no")
		}}
		c := dial(t, startServer(t, w).addr)
		_, err := c.Prefill(testContext(t), &engine.PrefillRequest{Request: &engine.Request{Model: "m", Prompt: "p"}})
		if !errors.Is(err, tt.want) || status.Code(err) != tt.code {
			t.Errorf("%v: Prefill error %v, want %v", tt.code, err, tt.want)
		}
	}
}

func TestDecodeWaitsForFirstEvent(t *testing.T) {
	var got *workerpb.DecodeRequest
	w := &fakeWorker{decode: func(req *workerpb.DecodeRequest, st workerpb.Worker_DecodeServer) error {
		got = req
		if req.GetTransferId() == "fail" {
			return status.Error(codes.NotFound, "no model")
		}
		if req.GetTransferId() == "empty" {
			return nil
		}
		if err := st.Send(tokens("ab", 2)); err != nil {
			return err
		}
		return st.Send(&workerpb.GenerateEvent{Event: &workerpb.GenerateEvent_Final{Final: &workerpb.Final{
			FinishReason: "length", PromptTokens: 9, CachedTokens: 8, CompletionTokens: 2,
		}}})
	}}
	c := dial(t, startServer(t, w).addr)
	req := &engine.Request{ID: "r", Model: "m", Prompt: "p"}

	s, err := c.Decode(testContext(t), req, "tid", 250*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	var evs []engine.Event
	for {
		ev, err := s.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		evs = append(evs, ev)
	}
	s.Close()
	want := []engine.Event{{Text: "ab", Tokens: 2}, {Final: &engine.Final{FinishReason: "length", PromptTokens: 9, CachedTokens: 8, CompletionTokens: 2}}}
	if diff := cmp.Diff(want, evs); diff != "" {
		t.Errorf("events (-want +got):\n%s", diff)
	}
	if got.GetTransferId() != "tid" || got.GetTransferTimeoutMs() != 250 || got.GetRequest().GetRequestId() != "r" {
		t.Errorf("worker got %v", got)
	}

	if _, err := c.Decode(testContext(t), req, "fail", 0); !errors.Is(err, ErrUnknownModel) {
		t.Errorf("Decode error = %v, want ErrUnknownModel", err)
	}
	if _, err := c.Decode(testContext(t), req, "empty", 0); !errors.Is(err, engine.ErrUnavailable) {
		t.Errorf("Decode of an empty stream = %v, want ErrUnavailable", err)
	}
	if _, err := c.Decode(testContext(t), nil, "", 0); !errors.Is(err, ErrInvalid) {
		t.Errorf("Decode(nil) = %v", err)
	}
}
