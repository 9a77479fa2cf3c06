//go:build tools

// Package tools pins the KubeRay operator (github.com/ray-project/kuberay/ray-operator,
// whose main package is the module root) built by hack/cluster/build-gotool.sh kuberay
// for the full loopback cluster (hack/cluster/localcluster.py up --full). Its CRDs
// are applied from the same module version (config/crd/bases in the module cache).
// The build tag keeps this file out of every build; it exists so that
// `go mod tidy` records the operator's dependencies.
package tools

import (
	_ "github.com/ray-project/kuberay/ray-operator"
)
