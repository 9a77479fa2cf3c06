"""The planner against a fresh profile of the real modules at sizes the
calibration never saw: activation estimates must agree within 10%."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("diffusers")

from videojob.catalog import get_model  # noqa: E402
from videojob.planner import Job, Layout, MemoryEstimate, load_calibration  # noqa: E402
from videojob.planner.memory import MemoryModel  # noqa: E402
from videojob_runtime.profiling import profile_decode, profile_denoise  # noqa: E402

CASES = [("cogvideox-2b", 256, 160, 17), ("wan2.1-t2v-1.3b", 320, 192, 21), ("cogvideox-5b", 480, 320, 33)]


@pytest.mark.parametrize("model_id,width,height,frames", CASES, ids=[c[0] for c in CASES])
def test_denoise_activations_within_10_percent(model_id, width, height, frames):
    measured = profile_denoise(model_id, width, height, frames, batch=2, dtype="bfloat16")
    model = get_model(model_id)
    assert measured["latent_tokens"] == model.arch.tokens(width, height, frames)
    estimate: MemoryEstimate = MemoryModel(
        load_calibration().model(model_id), Job(model, width, height, frames, 10, 6.0)
    ).estimate(Layout())
    predicted = estimate.stages["denoise"]["activations"]
    assert abs(predicted - measured["activation_peak_bytes"]) / measured["activation_peak_bytes"] < 0.10


@pytest.mark.parametrize("model_id,width,height,frames", CASES, ids=[c[0] for c in CASES])
def test_decode_activations_within_10_percent(model_id, width, height, frames):
    measured = profile_decode(model_id, width, height, frames, dtype="bfloat16", tiling=False)
    model = get_model(model_id)
    estimate = MemoryModel(load_calibration().model(model_id), Job(model, width, height, frames, 10, 6.0))
    predicted = estimate.estimate(Layout()).stages["decode"]["activations"]
    assert abs(predicted - measured["activation_peak_bytes"]) / measured["activation_peak_bytes"] < 0.10


def test_profile_cli_writes_a_table_the_planner_reads(tmp_path):
    import subprocess
    import sys

    from videojob.planner import Inventory, choose, parse_calibration
    from videojob.planner.choose import Request

    out = tmp_path / "calibration.json"
    result = subprocess.run(
        [sys.executable, "-m", "videojob.cli", "profile", "--out", str(out), "--models", "tiny-cogvideox"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    import json

    table = parse_calibration(json.loads(out.read_text()))
    assert list(table.models) == ["tiny-cogvideox"]
    model = get_model("tiny-cogvideox")
    job = Job(model, model.native_width, model.native_height, model.native_frames, 4, 6.0, "float32")
    assert choose(Request(job=job), Inventory(), table).chosen is not None
