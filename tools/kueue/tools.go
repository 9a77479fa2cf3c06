//go:build tools

// Package tools pins Kueue's controller manager (sigs.k8s.io/kueue/cmd/kueue),
// built by hack/cluster/build-gotool.sh kueue for the loopback cluster
// (hack/cluster/lc/kueue.py, the tests' `kueue` fixture). Its CRDs are applied from the same
// module version (config/components/crd/bases in the module cache).
// The build tag keeps this file out of every build; it exists so that
// `go mod tidy` records the manager's dependencies.
package tools

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
