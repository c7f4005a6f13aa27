package main

import "syscall"

// childAttr kills children with the harness, however it ends.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
