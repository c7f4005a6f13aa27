//go:build unix

package tlsconf

import (
	"io/fs"
	"syscall"
)

// inode returns fi's inode number, which a rename changes.
func inode(fi fs.FileInfo) uint64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return uint64(st.Ino)
	}
	return 0
}
