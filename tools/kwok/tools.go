//go:build tools

// Package tools pins the KWOK controller (sigs.k8s.io/kwok/cmd/kwok) built by
// hack/cluster/build-gotool.sh kwok for the full loopback cluster
// (hack/cluster/localcluster.py up --full): it fakes kubelets, so pods bound
// to fake nodes become Running. The build tag keeps this file out of every
// build; it exists so that `go mod tidy` records kwok's dependencies.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
)
