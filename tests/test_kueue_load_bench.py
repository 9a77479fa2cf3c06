"""`benchmarks/kueue_load.py` (`make bench`) at a small scale: 4 jobs per team through
real Kueue on a loopback cluster of its own; the same code path as the 1,000-job run.

Every job must succeed, Kueue must have admitted one Workload per job, the shares
must be computed for all four teams, and deleting the jobs must leave no Workload."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO


@pytest.mark.slow
@pytest.mark.cluster
def test_kueue_load_bench_small(tmp_path):
    out = tmp_path / "kueue_load.json"
    env = {**os.environ, "VIDEOJOB_CLUSTER_DIR": str(tmp_path / "cluster")}  # not the session's cluster (its Kueue)
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "kueue_load.py"), "--jobs-per-team", "4", "--delay-s", "1",
         "--timeout-s", "600", "--out", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "kueue_load" and doc["jobs"] == 16 and doc["succeeded"] == 16, doc
    assert doc["workloadsAdmitted"] == 16 and doc["workloadsLeftAfterDeletion"] == 0, doc
    assert set(doc["shares"]["teams"]) == {"team-a", "team-b", "team-c", "team-d"}
    assert abs(sum(t["nominalQuotaShare"] for t in doc["shares"]["teams"].values()) - 1.0) < 0.01
    assert doc["jobsPerSecondAdmitted"] > 0
