"""`benchmarks/s3_bench.py` (`make bench`) as a dry run: a 12 MB video, one repeat, the
same code path against a real rclone serve s3. What docs/storage.md quotes from it must be
there and hang together: the multipart path used more than one part, the single-PUT path
one, and each s3 job's seconds are its staging write plus its upload."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import REPO, require_module

require_module("boto3")
require_module("PIL")


def test_s3_bench_dry_run(tmp_path):
    out = tmp_path / "s3.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "s3_bench.py"), "--dry-run", "--out", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "s3" and doc["dryRun"] is True and len(doc["commit"]) == 40
    assert doc["command"].startswith("python benchmarks/s3_bench.py") and doc["machine"]["cores"] > 0
    assert doc["videoBytes"] == 12_000_000 and doc["repeats"] == 1
    assert doc["pvc"]["jobSeconds"] > 0 and len(doc["pvc"]["samples"]) == 1
    assert doc["s3"]["partBytes"] == 8 * 2**20 and doc["s3"]["parts"] == 2
    assert doc["s3SinglePut"]["parts"] == 1 and doc["s3SinglePut"]["partBytes"] >= doc["videoBytes"]
    for key in ("s3", "s3SinglePut"):
        row = doc[key]
        assert row["uploadSeconds"] > 0 and row["uploadMBps"] > 0, row
        assert abs(row["jobSeconds"] - row["writeSeconds"] - row["uploadSeconds"]) < 0.01, row
        assert abs(row["extraSecondsPerJob"] - (row["jobSeconds"] - doc["pvc"]["jobSeconds"])) <= 0.002, row
        assert abs(row["uploadMBps"] - doc["videoMB"] / row["uploadSeconds"]) <= 0.1 + 0.01 * row["uploadMBps"], row
    assert doc["download"]["MBps"] > 0
    assert "pvc" in result.stdout and str(out) in result.stdout
