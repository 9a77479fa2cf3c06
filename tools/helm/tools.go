//go:build tools

// Package tools pins helm, built by hack/cluster/build-gotool.sh helm.
// The build tag keeps it out of every normal build; it exists so that
// `go mod tidy` records helm's dependencies in go.mod/go.sum. This module is
// separate from tools/ so helm's Kubernetes libraries never have to agree with
// the loopback cluster's.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
