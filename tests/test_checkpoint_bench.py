"""`benchmarks/checkpoint_bench.py` (`make bench`) as a dry run: the medium-size
models, 3 steps, a checkpoint after every step, one repeat; the same code path.

What the preemption simulation reads from it (``families`` -> model id ->
checkpointSeconds, checkpointBytes, stepSeconds, shareOfStep) must be there and
make sense, and every family's resume must be bit-identical."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import require_module

require_module("torch")
require_module("diffusers")

from helpers import REPO  # noqa: E402
from videojob_runtime.configs import MEDIUM_SIZES  # noqa: E402

# torch.save's framing of a small state: the zip entries, the pickle and the header.
FRAMING_BYTES = 16 * 1024


# About a minute of medium-size models: in `make test-slow` (and `make bench`); `make test` has the
# medium-size resume (tests/test_checkpoint_medium.py).
@pytest.mark.slow
def test_checkpoint_bench_dry_run(tmp_path):
    out = tmp_path / "checkpoint.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "checkpoint_bench.py"), "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=420, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "checkpoint" and doc["dryRun"] is True and len(doc["commit"]) == 40
    assert doc["command"].startswith("python benchmarks/checkpoint_bench.py") and doc["ompNumThreads"] == "1"
    assert doc["machine"]["cores"] > 0 and doc["allResumesBitIdentical"] is True
    assert set(doc["families"]) == set(MEDIUM_SIZES) == {"cogvideox-2b", "wan2.1-t2v-1.3b", "consisid"}
    assert doc["families"]["wan2.1-t2v-1.3b"]["scheduler"] == "UniPCMultistepScheduler"
    steps, every = doc["job"]["steps"], doc["job"]["everySteps"]
    for model_id, fam in doc["families"].items():
        assert fam["model"] == model_id and fam["size"] == "medium", fam
        # A save after every `every` steps but never after the last one.
        assert fam["checkpointsPerJob"] == (steps - 1) // every
        assert len(fam["checkpointSecondsSamples"]) == fam["checkpointsPerJob"] * doc["job"]["repeats"]
        assert 0 < fam["checkpointSeconds"] <= fam["checkpointSecondsMax"]
        assert fam["hookSecondsPerCheckpoint"] >= fam["checkpointSeconds"] * 0.5
        # A file is the latents, the scheduler's state and the RNG states, plus framing
        # (the newest one's state is measured; an earlier step's multistep history is shorter).
        assert fam["latentBytes"] > 0 and fam["schedulerStateBytes"] > 0
        assert fam["latentBytes"] + fam["schedulerStateBytes"] <= fam["stateBytes"]
        assert fam["stateBytes"] <= fam["stateFileBytes"] <= fam["stateBytes"] + FRAMING_BYTES, fam
        assert fam["latentBytes"] < fam["checkpointBytes"] <= fam["checkpointBytesMax"]
        assert fam["stateFileBytes"] <= fam["checkpointBytesMax"]
        assert fam["stepSeconds"] > 0 and 0 <= fam["shareOfStep"] < 1, fam
        assert abs(fam["shareOfStep"] - fam["checkpointSeconds"] / fam["stepSeconds"]) < 1e-3
        assert fam["jobSecondsOff"] > 0 and fam["jobSecondsOn"] > 0
        assert fam["overhead"] == round(fam["jobSecondsOn"] / fam["jobSecondsOff"] - 1, 4)
        assert fam["checkpointsChangeNothing"] is True
        assert fam["resumedFromStep"] == fam["expectedResumedFromStep"] > 0
        assert fam["interruptedAfterStep"] < steps and fam["resumeBitIdentical"] is True
        assert fam["resumeMaxDifference"] == 0.0
