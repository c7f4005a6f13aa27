package transfer

import (
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/batonllm/baton/transfer/tlsconf"
	"github.com/batonllm/baton/transfer/tlsconf/tlstest"
)

// TestGRPCMutualTLS runs the suite over mutual TLS: a receiver that
// accepts only senders with a certificate the fleet's CA signed, a sender
// that checks the receiver's.
func TestGRPCMutualTLS(t *testing.T) {
	testTransport(t, func(t *testing.T, recv Receiver, opts ...Option) (Transport, string) {
		t.Helper()
		ca := tlstest.NewCA(t, "fleet")
		decode, prefill := ca.Issue("127.0.0.1"), ca.Issue("prefill-0")
		server, _, err := tlsconf.Server(tlsconf.Config{CertFile: decode.CertFile, KeyFile: decode.KeyFile, CAFile: ca.File}, nil)
		if err != nil {
			t.Fatal(err)
		}
		client, _, err := tlsconf.Client(tlsconf.Config{CertFile: prefill.CertFile, KeyFile: prefill.KeyFile, CAFile: ca.File}, nil)
		if err != nil {
			t.Fatal(err)
		}
		addr := serveGRPC(t, recv, append(ServerOptions(), grpc.Creds(credentials.NewTLS(server))))
		tr := NewGRPC(append([]Option{WithTransportCredentials(credentials.NewTLS(client))}, opts...)...)
		t.Cleanup(func() { tr.Close() })
		return tr, addr
	})
}
