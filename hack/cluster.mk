# Loopback Kubernetes control plane for tests (etcd + kube-apiserver +
# kube-controller-manager as local processes; no Docker). Included by the main
# Makefile; also usable alone: `make -f hack/cluster.mk cluster-up`.
#
#   cluster-tools   build the binaries from tools/ into ~/.cache/videojob (cached)
#   cluster-up      start the cluster (or reuse a healthy one); .cluster/kubeconfig
#   cluster-down    stop it and delete its etcd data
#   cluster-status  show pids, ports and health
#
# export KUBECONFIG=$(CURDIR)/.cluster/kubeconfig to use it by hand; kubectl is in
# the bin dir printed by `make cluster-tools`.

# Set PYTHON (e.g. to the venv's python) before `include hack/cluster.mk`, or with
# `=`/`:=` anywhere: this `?=` only supplies the default.
PYTHON ?= python3
CLUSTER_HACK := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/cluster
CLUSTER_PY := $(CLUSTER_HACK)/localcluster.py

.PHONY: cluster-tools cluster-up cluster-down cluster-status

cluster-tools:
	bash $(CLUSTER_HACK)/build-tools.sh

cluster-up: cluster-tools
	$(PYTHON) $(CLUSTER_PY) up

cluster-down:
	$(PYTHON) $(CLUSTER_PY) down

cluster-status:
	$(PYTHON) $(CLUSTER_PY) status
