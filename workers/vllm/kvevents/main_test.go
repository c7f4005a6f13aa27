package kvevents_test

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// zmq4's PUB socket never stops its writer goroutine on Close (its
	// pubMWriter.Close is never called). Only the fake publisher has PUB
	// sockets; the subscriber's own sockets must leak nothing.
	goleak.VerifyTestMain(m, goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"))
}
