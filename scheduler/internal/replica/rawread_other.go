//go:build !unix

package replica

import "errors"

// ownConnections: elsewhere than on Unix the stream goes through the
// go-redis client.
const ownConnections = false

func readFD(uintptr, []byte) (int, error) { return 0, errors.New("not supported") }
