# Loopback Kubernetes control plane for tests (etcd + kube-apiserver +
# kube-controller-manager as local processes; no Docker). Included by the main
# Makefile; also usable alone: `make -f hack/cluster.mk cluster-up`. The code:
# hack/cluster/localcluster.py (entry point) and hack/cluster/lc/ (one module per
# component; lc/cluster.py lists them in start order).
#
#   cluster-tools   build the binaries from tools/, tools/kwok, tools/kuberay and tools/kueue
#                   into ~/.cache/videojob (cached); cluster-tools-base: tools/ only
#   cluster-up      start the cluster (or reuse a healthy one); .cluster/kubeconfig
#   cluster-down    stop it and delete its etcd data
#   cluster-status  show pids, ports and health
#   cluster-full-up / cluster-full-down
#                   the full cluster (kube-scheduler, KWOK fake GPU nodes, KubeRay)
#                   in .cluster-full/ (tests/test_cluster_full.py starts its own)
#   cluster-e2e-up / cluster-e2e-down
#                   the full cluster whose pods really run: the pod runner instead of
#                   KWOK (needs root), in .cluster-e2e/ (tests/test_cluster_e2e.py)
#
# export KUBECONFIG=$(CURDIR)/.cluster/kubeconfig to use it by hand; kubectl is in
# the bin dir printed by `make cluster-tools`.

# Set PYTHON (e.g. to the venv's python) before `include hack/cluster.mk`, or with
# `=`/`:=` anywhere: this `?=` only supplies the default.
PYTHON ?= python3
CLUSTER_HACK := $(patsubst %/,%,$(dir $(lastword $(MAKEFILE_LIST))))/cluster
CLUSTER_PY := $(CLUSTER_HACK)/localcluster.py

.PHONY: cluster-tools cluster-tools-base cluster-up cluster-down cluster-status cluster-full-up cluster-full-down \
	cluster-e2e-up cluster-e2e-down

cluster-tools: cluster-tools-base
	bash $(CLUSTER_HACK)/build-gotool.sh kwok
	bash $(CLUSTER_HACK)/build-gotool.sh kuberay
	bash $(CLUSTER_HACK)/build-gotool.sh kueue

# The default cluster needs only tools/ (etcd, apiserver, controller-manager, kubectl).
cluster-tools-base:
	bash $(CLUSTER_HACK)/build-tools.sh

cluster-up: cluster-tools-base
	$(PYTHON) $(CLUSTER_PY) up

cluster-down:
	$(PYTHON) $(CLUSTER_PY) down

cluster-status:
	$(PYTHON) $(CLUSTER_PY) status

CLUSTER_FULL_DIR ?= $(CURDIR)/.cluster-full

cluster-full-up: cluster-tools
	$(PYTHON) $(CLUSTER_PY) --cluster-dir $(CLUSTER_FULL_DIR) up --full

cluster-full-down:
	$(PYTHON) $(CLUSTER_PY) --cluster-dir $(CLUSTER_FULL_DIR) down

CLUSTER_E2E_DIR ?= $(CURDIR)/.cluster-e2e

cluster-e2e-up: cluster-tools
	$(PYTHON) $(CLUSTER_PY) --cluster-dir $(CLUSTER_E2E_DIR) up --full --pod-runner

cluster-e2e-down:
	$(PYTHON) $(CLUSTER_PY) --cluster-dir $(CLUSTER_E2E_DIR) down
