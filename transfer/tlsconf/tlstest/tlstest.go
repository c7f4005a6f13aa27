// Package tlstest makes throwaway certificate authorities and certificates
// for tests, written as PEM files in the test's temporary directory. Keys
// are ECDSA P-256, made afresh for each test: none is ever committed.
package tlstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"
)

// CA is a certificate authority of one test.
type CA struct {
	// File is the CA certificate's PEM file.
	File string
	Cert *x509.Certificate

	t   testing.TB
	key *ecdsa.PrivateKey
	dir string
}

var serial atomic.Int64

// NewCA makes a CA named name whose files live in t's temporary directory.
func NewCA(t testing.TB, name string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(serial.Add(1)),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{Cert: cert, t: t, key: key, dir: t.TempDir()}
	ca.File = ca.write(name+"-ca.pem", "CERTIFICATE", der)
	return ca
}

// Pair is an issued certificate's files.
type Pair struct {
	CertFile, KeyFile string
	Cert              *x509.Certificate
}

// Issue makes a certificate for names (DNS names or IP addresses; the
// first is also the common name), good for both server and client
// authentication, and writes it and its key to new files.
func (ca *CA) Issue(names ...string) Pair {
	ca.t.Helper()
	key := newKey(ca.t)
	n := serial.Add(1)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(n),
		Subject:      pkix.Name{CommonName: names[0]},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	for _, name := range names {
		if ip := net.ParseIP(name); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, name)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		ca.t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		ca.t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		ca.t.Fatal(err)
	}
	base := ca.Cert.Subject.CommonName + "-" + big.NewInt(n).String()
	return Pair{
		CertFile: ca.write(base+".pem", "CERTIFICATE", der),
		KeyFile:  ca.write(base+"-key.pem", "PRIVATE KEY", keyDER),
		Cert:     cert,
	}
}

// Replace writes p's certificate and key over dst's files, each by a
// rename, as a certificate manager rotates them.
func Replace(t testing.TB, dst, p Pair) {
	t.Helper()
	for _, f := range [][2]string{{p.CertFile, dst.CertFile}, {p.KeyFile, dst.KeyFile}} {
		b, err := os.ReadFile(f[0])
		if err != nil {
			t.Fatal(err)
		}
		tmp := f[1] + ".new"
		if err := os.WriteFile(tmp, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, f[1]); err != nil {
			t.Fatal(err)
		}
	}
}

func (ca *CA) write(name, typ string, der []byte) string {
	path := filepath.Join(ca.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		ca.t.Fatal(err)
	}
	return path
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return key
}
