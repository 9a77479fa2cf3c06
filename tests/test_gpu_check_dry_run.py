"""`make gpu-check` must be runnable when a GPU machine is lent: its script is
dry-run here on the CPU with the tiny model, same code path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from helpers import REPO  # noqa: E402


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "dry.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run", "--steps", "2",
         "--modes", "none,model,sequential", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(out.read_text())
    # Every result file says which commit, which machine, which command (benchmarks/machine.py).
    assert len(document["commit"]) == 40 and isinstance(document["dirty"], bool)
    assert document["machine"]["cores"] > 0 and document["command"].startswith("python benchmarks/gpu_check.py")
    rows = document["rows"]
    assert [(r["offload"], r["vaeTiling"]) for r in rows] == [
        (m, t) for m in ("none", "model", "sequential") for t in (False, True)]
    assert all(r["error"] is None and r["secondsPerStep"] > 0 and r["estimatedPeakGiB"] > 0 for r in rows)
