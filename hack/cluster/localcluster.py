#!/usr/bin/env python3
"""A real Kubernetes control plane on loopback, for tests. No Docker.

Runs etcd, kube-apiserver and kube-controller-manager as local processes (no
scheduler, no kubelet: pods are stored but never run).  The binaries come from
hack/cluster/build-tools.sh (built from the Go tools module in tools/).

`up --full` adds what a real cluster has, still without Docker or kubelets:
kube-scheduler (same module), the KWOK controller (tools/kwok) faking the
kubelets of the nodes in hack/cluster/fake-nodes.yaml (CPU nodes, 1-GPU and
8-GPU nodes with nvidia.com/gpu capacity; pods bound to them become Running),
and the KubeRay operator (tools/kuberay) with its CRDs, applied from the same
module version.  Both tools are built by hack/cluster/build-gotool.sh.  The
apiserver also gets the ExtendedResourceToleration admission plugin (pods that
request nvidia.com/gpu tolerate the GPU nodes' taint).  state.json records
`full`, so `down` stops everything.

`up --full --pod-runner` runs pods for real: instead of KWOK and its fake
nodes, the pod runner (hack/cluster/podrunner) registers the nodes of
hack/cluster/runner-nodes.yaml and does a kubelet's work for the pods bound to
them, with processes of this checkout's venv instead of containers (each pod
its own network namespace, address, hosts file, volumes, probes). It needs
root. tests/test_cluster_e2e.py installs the chart in kuberay mode on it.

Everything lives in the cluster dir (default: <repo>/.cluster, override with
VIDEOJOB_CLUSTER_DIR):

    kubeconfig        admin kubeconfig (client cert with O=system:masters)
    scheduler.kubeconfig   kube-scheduler's (CN=system:kube-scheduler; --full only)
    state.json        pids, ports, bin dir, server URL
    pki/              CAs, serving cert, client certs, service-account key pair
    etcd/             etcd data
    *.log             process logs

Commands:

    up       start the cluster, or reuse it when it is already running and healthy
             (--full: with scheduler, KWOK fake nodes and KubeRay, see above;
             --full --pod-runner: the pod runner instead of KWOK)
    down     stop the processes and delete etcd data (--keep-data keeps it;
             pki/ and logs are always kept)
    status   print the state and health; exit 0 only when healthy
    token    print a ServiceAccount bearer token (TokenRequest API); creates
             the namespace and ServiceAccount if missing
    kubeconfig-for   write a kubeconfig that authenticates with such a token
    release  drop a holder registered with `up --holder`; stops an ephemeral
             cluster when its last holder is gone (used by tests/conftest.py)

Stdlib only; certificates are made with the openssl command-line tool.  The
code is in hack/cluster/lc/, one module per component (lc/__init__.py lists
them; lc/cluster.py has the order in which the components start).
"""
from __future__ import annotations

import sys
from pathlib import Path

# The package lc/ sits next to this file; put its folder first on sys.path so
# `python3 hack/cluster/localcluster.py` works from anywhere, and so does an
# import of this file by path.
_HERE = str(Path(__file__).resolve().parent)
if sys.path[:1] != [_HERE]:
    sys.path.insert(0, _HERE)

from lc import cli  # noqa: E402
# What the single-file version defined, still importable from here.
from lc.binaries import etcd_binary, resolve_bin_dir, resolve_tool_bin_dir  # noqa: E402,F401
from lc.client import admin_ssl_context, api, http_ok, kubectl  # noqa: E402,F401
from lc.cluster import (  # noqa: E402,F401
    COMPONENTS, CONTROL_PLANE, FULL, FULL_COMPONENTS, components, health, healthy,
    start_cluster, stop_all,
)
from lc.common import (  # noqa: E402,F401
    REPO, ClusterError, Paths, cluster_dir, locked, log, read_state, write_state,
)
from lc.pki import cert_user, make_client_cert, make_pki, write_kubeconfig  # noqa: E402,F401
from lc.procs import free_ports, pid_alive, start_process, stop_pid, wait_until  # noqa: E402,F401
from lc.tokens import parse_duration, request_token, running_state  # noqa: E402,F401


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
