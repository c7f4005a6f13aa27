//go:build !race

package rawio

const raceBuild = false
