package frontend

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/workers/engine"
	"github.com/batonllm/baton/workers/httpengine"
)

// A client reads what the engine said, never where the engine is.
func TestWithEngineSaid(t *testing.T) {
	dial := &net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 7), Port: 8000}, Err: errors.New("connect: connection refused")}
	tests := []struct {
		err  error
		want string
	}{
		{fmt.Errorf("proxy: %w: Post \"http://10.0.0.7:8000/v1/chat/completions\": %w", engine.ErrUnavailable, dial), "failed"},
		{fmt.Errorf("proxy: %w", &httpengine.StatusError{Status: 503, Message: `{"error":"Loading model"}`}), `failed: {"error":"Loading model"}`},
		{fmt.Errorf("generate: %w", status.Error(codes.Unavailable, "connection error: desc = \"transport: dial tcp 10.0.0.7:8000: connect: connection refused\"")), "failed"},
		{fmt.Errorf("generate: %w: %w", engine.ErrInvalid, status.Error(codes.InvalidArgument, "max_tokens must be positive")), "failed: max_tokens must be positive"},
	}
	for _, tt := range tests {
		got := withEngineSaid("failed", tt.err)
		if got != tt.want {
			t.Errorf("withEngineSaid(%v) = %q, want %q", tt.err, got, tt.want)
		}
		if strings.Contains(got, "10.0.0.7") {
			t.Errorf("withEngineSaid(%v) names the engine's address", tt.err)
		}
	}
	safe := fmt.Errorf("no worker can load the adapter sql: %w", &clientSafe{"its load failed", fmt.Errorf("%w: %w", engine.ErrUnavailable, dial)})
	if got := safe.Error(); got != "no worker can load the adapter sql: its load failed" || !errors.Is(safe, engine.ErrUnavailable) {
		t.Errorf("clientSafe: %q (is ErrUnavailable: %v)", got, errors.Is(safe, engine.ErrUnavailable))
	}
}
