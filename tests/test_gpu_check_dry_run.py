"""`make gpu-check` must be runnable the moment a GPU machine is lent: its script
is dry-run here on the CPU with the tiny model, through the same worker path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("torch")

from helpers import REPO  # noqa: E402

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _run(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "dry.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args],
                            capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result, json.loads(out.read_text())


def test_gpu_check_dry_run_goes_through_the_worker(tmp_path):
    _, document = _run(tmp_path)
    # Every result file says which commit, which machine, which command (benchmarks/machine.py).
    assert len(document["commit"]) == 40 and isinstance(document["dirty"], bool)
    assert document["machine"]["cores"] > 0 and document["command"].startswith("python benchmarks/gpu_check.py")
    assert "RankWorker.run" in document["path"]
    rows = document["rows"]
    assert [(r["offload"], r["vaeTiling"], r["cache"] != "off") for r in rows] == [
        ("none", True, False), ("none", False, False), ("none", True, False), ("none", True, True),
        ("model", True, False), ("group", True, False), ("sequential", True, False)]
    for row in rows:
        assert row["ok"], row
        assert row["peakGiB"] > 0 and row["secondsPerStep"] > 0 and row["estimatedPeakGiB"] > 0, row
        assert row["estimatedSecondsPerStep"] > 0 and row["stageSeconds"]["denoise"] > 0, row
    # Rows that differ only by a per-job strategy (VAE tiling, steps) reuse the loaded
    # pipeline, as a warm group does; a new offload mode or cache loads again.
    assert [r["reusedPipeline"] for r in rows] == [False, True, True, False, False, False, False]
    cache = document["stepCache"]
    assert cache["policy"] in ("dbcache", "fbcache", "teacache") and cache["denoiseSpeedup"] > 0
    assert cache["stats"], "the cached row reports its cache's statistics"


def test_gpu_check_stops_at_its_budget_and_keeps_what_it_measured(tmp_path):
    """A run cut short by its time budget records the rows it skipped and why,
    next to the ones it measured."""
    _, document = _run(tmp_path, "--only", "1,2,5", "--budget-s", "0.001")
    rows = document["rows"]
    assert [r["row"] for r in rows] == [1, 2, 5]
    assert rows[0]["ok"] and "skipped" not in rows[0]
    assert all(r["skipped"].startswith("budget") and not r["ok"] for r in rows[1:])


def test_random_full_size_weights_match_the_catalog():
    """The GPU check's full-size random pipeline has the published structure: each
    component's parameter count within 1% of the catalog's (built on the meta
    device: shapes, no memory)."""
    from videojob.catalog import get_model
    from videojob_runtime.pipelines import build_random_pipeline, inner_pipeline

    model = get_model("cogvideox-5b")
    pipe = inner_pipeline(build_random_pipeline("cogvideox-5b", "t2v", "bfloat16", init_device="meta"))
    for component in model.components:
        module = getattr(pipe, component.name)
        params = sum(p.numel() for p in module.parameters())
        assert abs(params - component.params) / component.params < 0.01, (component.name, params, component.params)
        assert all(p.device.type == "meta" for p in module.parameters())
    assert pipe.transformer.config.num_attention_heads == model.attention_heads


def test_no_videojob_can_ask_for_random_weights():
    """RANDOM_WEIGHTS is for benchmarks that build a JobRequest themselves: the API
    refuses it as a model source, naming the field."""
    import copy

    import yaml

    from videojob.api.resource import InvalidVideoJob, parse_videojob
    from videojob_runtime.pipelines import RANDOM_WEIGHTS

    doc = yaml.safe_load((REPO / "examples" / "cogvideox-5b-t2v.yaml").read_text())
    doc = copy.deepcopy(doc)
    doc["spec"]["model"]["source"] = RANDOM_WEIGHTS
    with pytest.raises(InvalidVideoJob) as refused:
        parse_videojob(doc)
    assert "spec.model.source" in str(refused.value)
