"""The short chaos soak (benchmarks/chaos, issue 19): about 8 tiny jobs for about two
minutes under seeded faults (operator killed and stalled, a driver and a rank killed,
a running job deleted, the API server restarted, the dashboard frozen), then 0 lost,
0 duplicated, 0 left over. Its own loopback cluster (.cluster-chaos), since it
restarts the API server. ``make chaos`` is the long soak (100 jobs, 20 minutes).

VIDEOJOB_CHAOS_SEED picks the seed (default 1); a failure names it and the workdir
with the operator's and Ray's logs.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from helpers import require_module, wait_for

require_module("ray")
require_module("xfuser")

from conftest import REPO, KubeCluster, _cluster_release, _cluster_up  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from chaos.world import DEFAULT_CLUSTER_DIR  # noqa: E402

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def chaos_cluster():
    state = _cluster_up(["--cluster-dir", str(DEFAULT_CLUSTER_DIR), "up"],
                        "the chaos soak's loopback cluster (its own --cluster-dir)")
    try:
        yield KubeCluster(state)
    finally:
        _cluster_release(state)


def test_restart_apiserver_keeps_port_and_data(chaos_cluster):
    """`localcluster.py restart-apiserver`: a new kube-apiserver process on the same
    address, and what etcd held is still there."""
    from chaos.world import localcluster

    chaos_cluster.kubectl("create", "configmap", "restart-probe", "-n", "default", "--from-literal=k=v")
    try:
        before = json.loads((chaos_cluster.cluster_dir / "state.json").read_text())["pids"]["kube-apiserver"]
        res = localcluster(chaos_cluster.cluster_dir, "restart-apiserver")
        assert res.returncode == 0, res.stderr[-2000:]
        reply = json.loads(res.stdout)
        assert reply["server"] == chaos_cluster.server and reply["pid"] != before
        assert not os.path.exists(f"/proc/{before}") or "kube-apiserver" not in open(f"/proc/{before}/cmdline").read()
        data = wait_for("the ConfigMap through the restarted API server", lambda: chaos_cluster.kubectl(
            "get", "configmap", "restart-probe", "-n", "default", "-o", "jsonpath={.data.k}", check=False).stdout,
            timeout=60)
        assert data == "v"
    finally:
        chaos_cluster.kubectl("delete", "configmap", "restart-probe", "-n", "default", check=False)


# Slow (CI time): `make test` covers the faults one by one: the API server restart above, operator
# restarts (test_operator_races), deletes (test_operator), lost ranks (test_operator_checkpoints);
# `make chaos` is the long soak.
@pytest.mark.slow
def test_short_soak_loses_doubles_and_leaves_nothing(chaos_cluster, tmp_path):
    from chaos.soak import run

    seed = int(os.environ.get("VIDEOJOB_CHAOS_SEED", "1"))
    result = run(seed, jobs=8, minutes=2, workdir=tmp_path, cluster_dir=chaos_cluster.cluster_dir,
                 cluster_state=chaos_cluster.state)
    (tmp_path / "chaos.json").write_text(json.dumps(result, indent=2, default=str))
    summary = (f"seed {seed}; faults {result['faultsByKind']}; logs in {tmp_path}; problems:\n  "
               + "\n  ".join(result["problems"]))
    assert sum(result["faultsByKind"].values()) >= 5, f"too few faults landed to prove anything: {summary}"
    assert result["lost"] == 0, summary
    assert result["duplicated"] == 0, summary
    assert result["leftOver"] == 0, summary
    assert result["passed"], summary
