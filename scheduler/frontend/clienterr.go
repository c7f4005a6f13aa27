package frontend

import (
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/batonllm/baton/workers/httpengine"
)

// The errors of a call to an engine name where it is (a refused
// connection's "dial tcp 10.0.0.7:8000", a request's URL): those stay in
// the scheduler's logs. What a client reads of them is what the engine
// itself said, if anything.

// engineSaid returns what the engine said of the request err is about:
// the start of the body it refused it with, or the message of a status a
// baton worker chose (invalid argument, too large, not found, ...). It is
// "" for errors of the path to the engine (transport, TLS, gRPC's
// Unavailable), which say nothing the client can use.
func engineSaid(err error) string {
	var se *httpengine.StatusError
	if errors.As(err, &se) {
		return se.Message
	}
	var gs interface{ GRPCStatus() *status.Status }
	if errors.As(err, &gs) {
		switch st := gs.GRPCStatus(); st.Code() {
		case codes.InvalidArgument, codes.ResourceExhausted, codes.NotFound, codes.FailedPrecondition, codes.OutOfRange:
			return st.Message()
		}
	}
	return ""
}

// withEngineSaid returns msg followed by what the engine said of err, if
// anything.
func withEngineSaid(msg string, err error) string {
	if said := engineSaid(err); said != "" {
		return msg + ": " + said
	}
	return msg
}

// clientSafe is an error whose message is fit for a client (what the
// engine said, else summary) and whose chain is err's, for the callers
// that branch on it and the logs that print err.
type clientSafe struct {
	summary string
	err     error
}

func (e *clientSafe) Error() string { return withEngineSaid(e.summary, e.err) }
func (e *clientSafe) Unwrap() error { return e.err }
