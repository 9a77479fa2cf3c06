//go:build tools

// Package tools pins the Kubernetes commands built by hack/cluster/build-tools.sh.
// The build tag keeps it out of every normal build; it exists so that
// `go mod tidy` records the dependencies of these commands in go.mod/go.sum.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
