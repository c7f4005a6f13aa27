//go:build !linux

package h1serve

import "errors"

// hangups is Linux's (hangup_linux.go); elsewhere the watcher's ticks
// start the watches.
type hangups struct{}

func newHangups() (*hangups, error) { return nil, errors.New("no epoll") }

func (h *hangups) add(c *conn) bool { return false }
func (h *hangups) remove(id uint64) {}
func (h *hangups) close()           {}
