"""The runtime benchmark's medium section (`benchmarks/runtime_bench.py`) and the
JobRequest ``size`` it runs at: a benchmark-only setting no VideoJob reaches.

The medium section compares the path `videojob run` takes (actor group,
progress polling, output writing) with the diffusers pipeline called directly;
it runs here as a dry run on the tiny CogVideoX, same code path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required
import yaml

require_module("torch")

from helpers import REPO  # noqa: E402
from videojob_runtime.request import SIZES, JobRequest  # noqa: E402


def _request(**overrides) -> JobRequest:
    fields = dict(job_id="j", model_id="cogvideox-2b", task="t2v", prompt="a fox", width=96, height=64, frames=9,
                  fps=8, steps=2, guidance=6.0, seed=3)
    return JobRequest(**{**fields, **overrides})


def test_job_request_size_is_full_unless_a_benchmark_asks_for_medium():
    assert SIZES == ("full", "medium")
    assert _request().size == "full"
    medium = _request(size="medium")
    assert JobRequest.from_dict(medium.to_dict()) == medium  # crosses the actor boundary intact
    with pytest.raises(ValueError, match="JobRequest.size must be one of"):
        _request(size="large")
    with pytest.raises(ValueError, match="size must be one of"):
        JobRequest.from_dict({**_request().to_dict(), "size": "tiny"})


def test_the_medium_size_is_its_own_warm_pipeline_and_prompt_length():
    """A warm worker does not reuse a full-size pipeline for a medium job (nor one
    medium seed's random weights for another's), and the medium job's prompt is
    encoded at the medium size's length (its transformer's text positions)."""
    from videojob_runtime.configs import MEDIUM_SIZES
    from videojob_runtime.generate import pipeline_kwargs
    from videojob_runtime.worker import RankWorker

    worker = RankWorker(0, 1)
    full, medium = _request(), _request(size="medium")
    assert worker._key(full) != worker._key(medium)
    assert worker._key(replace(full, seed=4)) == worker._key(full)  # real weights: the seed is not the pipeline's
    assert worker._key(replace(medium, seed=4)) != worker._key(medium)

    class Pipe:
        def __call__(self, prompt=None, max_sequence_length=226, **kwargs):  # a signature only
            raise AssertionError("not called")

    assert pipeline_kwargs(Pipe(), full, {}, on_step_end=None)["max_sequence_length"] == 226
    tokens = pipeline_kwargs(Pipe(), medium, {}, on_step_end=None)["max_sequence_length"]
    assert tokens == MEDIUM_SIZES["cogvideox-2b"].text_tokens == 16


def test_no_videojob_can_ask_for_the_medium_size(tmp_path, monkeypatch):
    """The API has no such field, both drivers' requests keep size "full", and the
    operator's driver refuses a job dict that names another size."""
    from videojob.api.resource import InvalidVideoJob, parse_videojob
    from videojob.api.spec import VideoJobSpec
    from videojob.driver_protocol import DriverRequest, GroupRequest
    from videojob.jobrequest import job_fields
    from videojob_runtime import driver, local

    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    assert not any("size" == name.lower() or "size" == (f.alias or "").lower()
                   for name, f in VideoJobSpec.model_fields.items())
    for where in ("spec", "model"):
        bad = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
        (bad["spec"] if where == "spec" else bad["spec"]["model"])["size"] = "medium"
        with pytest.raises(InvalidVideoJob):
            parse_videojob(bad)
    job = parse_videojob(doc)
    layout = {"offload": "none", "vaeTiling": False, "vaeSlicing": False, "fp8Weights": False,
              "decodeOffload": False, "cache": "off"}
    fields = job_fields(job, layout, "tiny-cpu", "tiny-cpu", seed=0)
    assert "size" not in fields and JobRequest(**fields).size == "full"  # the operator's driver requests
    assert local.job_request(job, layout, tmp_path).size == "full"  # videojob run's

    monkeypatch.setenv("VIDEOJOB_OUTPUT_ROOT", str(tmp_path))
    request = DriverRequest(namespace="default", name="tiny-cpu", uid="u", group=GroupRequest(name="g"),
                            job=fields, output_uri="local://videos/tiny-cpu")
    assert driver.job_request(request)[0].size == "full"
    with pytest.raises(ValueError, match="job.size is the benchmarks'"):
        driver.job_request(request.model_copy(update={"job": {**fields, "size": "medium"}}))


# Medium-size models for about 40 s: in `make test-slow`; `make bench` runs the benchmark itself.
@pytest.mark.slow
def test_runtime_bench_medium_dry_run_writes_its_section_and_keeps_the_tiny_one(tmp_path):
    """The medium section end to end on the tiny CogVideoX (Ray, a one-rank group,
    progress polling, outputs written; well under a minute), into a file that
    already holds a tiny section: that section's keys stay, with where they came from."""
    out = tmp_path / "runtime.json"
    tiny = {"benchmark": "runtime", "commit": "c0ffee", "dirty": False, "changedPaths": [], "machine": {},
            "command": "python benchmarks/runtime_bench.py", "date": "2026-12-01T00:00:00+00:00",
            "directSeconds": 0.7, "groupSeconds": 0.75, "groupOverhead": 0.07, "stepCache": {"speedup": 1.0}}
    out.write_text(json.dumps(tiny))
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "runtime_bench.py"), "--size", "medium", "--dry-run",
         "--out", str(out)],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["commit"]) == 40 and doc["command"].startswith("python benchmarks/runtime_bench.py --size medium")
    # The tiny section's keys are kept as they were, and say which run wrote them.
    assert {k: doc[k] for k in ("directSeconds", "groupSeconds", "groupOverhead", "stepCache")} == \
        {k: tiny[k] for k in ("directSeconds", "groupSeconds", "groupOverhead", "stepCache")}
    assert doc["kept"] == {"section": "tiny", "from": {k: tiny[k] for k in ("commit", "dirty", "date", "command")}}

    medium = doc["medium"]
    assert medium["dryRun"] is True and medium["job"]["model_id"] == "tiny-cogvideox"
    repeats = medium["repeats"]
    assert repeats >= 3
    assert {name: len(times) for name, times in medium["samples"].items()} == \
        {"direct": repeats, "group": repeats, "groupUntracked": repeats}
    for key in ("directSeconds", "groupSeconds", "groupSecondsWithoutMemoryTracking"):
        assert medium[key] > 0, key
    assert medium["overhead"] == pytest.approx(medium["groupSeconds"] / medium["directSeconds"] - 1, abs=2e-3)
    assert medium["overheadOfFastestRuns"] == pytest.approx(
        min(medium["samples"]["group"]) / min(medium["samples"]["direct"]) - 1, abs=2e-3)
    assert medium["goalOverhead"] == 0.05 and medium["goalMet"] == (medium["overhead"] <= 0.05)
    for side, parts in (("direct", ("buildSeconds", "firstCallSeconds")),
                        ("group", ("groupStartSeconds", "firstJobSeconds"))):
        cold = medium["coldVsWarm"][side]
        assert cold["coldSeconds"] == pytest.approx(sum(cold[p] for p in parts), abs=2e-3)
        assert cold["coldSeconds"] > 0 and cold["warmSeconds"] > 0
    assert medium["coldVsWarm"]["group"]["loadSeconds"] > 0  # the first job loaded the weights
    assert medium["warmReused"] is True and medium["sameFrames"] is True
    assert medium["outputsWritten"] == ["bench-medium.json", "bench-medium.mp4", "bench-medium.png"]
    assert medium["progressPollsPerJob"] >= 1
    assert medium["groupStageSecondsMedian"]["write"] > 0 and medium["groupStageSecondsMedian"]["load"] == 0
    share = medium["transformerShare"]
    assert 0 < share["transformerShareOfJob"] <= share["transformerShareOfDenoise"] <= 1
