"""Unit tests for the API models and rules: no cluster, no torch."""

from __future__ import annotations

import pytest

from helpers import EXAMPLES, INVALID, expected_field, load
from videojob.api import InvalidVideoJob, Phase, VideoJobStatus, parse_bytes, parse_spec, parse_videojob
from videojob.catalog import CATALOG, get_model

BASE = {"model": {"name": "cogvideox-5b"}, "prompt": "a cat"}


def problems(spec: dict) -> dict[str, str]:
    try:
        parse_spec(spec)
    except InvalidVideoJob as exc:
        return {p.field: p.message for p in exc.problems}
    return {}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path):
    job = parse_videojob(load(path))
    assert job.name == load(path)["metadata"]["name"]


def test_examples_cover_the_required_models():
    models = {load(p)["spec"]["model"]["name"] for p in EXAMPLES}
    assert {"cogvideox-5b", "cogvideox-5b-i2v", "consisid", "wan2.1-t2v-14b", "tiny-cogvideox"} <= models


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_files_name_their_field(path):
    with pytest.raises(InvalidVideoJob) as exc:
        parse_videojob(load(path))
    fields = [p.field for p in exc.value.problems]
    assert expected_field(path) in fields, exc.value.problems


def test_at_least_fifteen_distinct_bad_files():
    assert len(INVALID) >= 15
    assert len({expected_field(p) for p in INVALID}) >= 12


def test_resolved_fills_model_defaults():
    spec = parse_spec({"model": {"name": "wan2.1-t2v-14b"}, "prompt": "a fox"}).resolved()
    assert (spec.video.width, spec.video.height, spec.video.frames, spec.video.fps) == (1280, 720, 81, 16)
    assert spec.sampling.steps == 50 and spec.sampling.guidance_scale == 5.0
    assert spec.task == "t2v"


def test_resolved_keeps_explicit_zero_guidance():
    spec = parse_spec({**BASE, "sampling": {"guidanceScale": 0}}).resolved()
    assert spec.sampling.guidance_scale == 0


def test_default_task_comes_from_model():
    spec = parse_spec({"model": {"name": "cogvideox-5b-i2v"}, "prompt": "x", "image": "pvc://in/a.png"})
    assert spec.effective_task == "i2v"


def test_every_problem_reported_at_once():
    found = problems({**BASE, "video": {"frames": 50, "width": 721}, "seed": -3, "parallel": {"ulysses": 5}})
    assert {"spec.video.frames", "spec.video.width", "spec.seed", "spec.parallel.ulysses"} <= set(found)


def test_frame_error_suggests_nearest_valid():
    assert "nearest valid value is 49" in problems({**BASE, "video": {"frames": 50}})["spec.video.frames"]


def test_unknown_field_is_an_error_not_ignored():
    found = problems({**BASE, "vidoe": {"frames": 49}})
    assert "spec.vidoe" in found and "camelCase" in found["spec.vidoe"]


def test_yaml_boolean_off_gets_a_hint():
    found = problems({**BASE, "cache": {"policy": False}})
    assert "quote" in found["spec.cache.policy"]


@pytest.mark.parametrize(
    "uri,ok",
    [
        ("pvc://videos/job-1", True),
        ("local://videos/job-1", True),
        ("local://videos/../x", False),
        ("local://../x", False),
        ("local:///etc", False),
        ("pvc://Bad_Name/x", False),
        ("s3://bucket/x", True),
        ("gs://bucket/x", False),
        ("s3://bucket/../x", False),
        ("local://", False),
        ("pvc://videos//tmp/x", False),  # issue 8: an empty segment after the claim made it /tmp/x
        ("local://videos/%2e%2e/x", False),
        ("local://videos/job-1/", True),  # a trailing '/' names the directory
    ],
)
def test_output_uri_rules(uri, ok):
    assert ("spec.output.uri" not in problems({**BASE, "output": {"uri": uri}})) is ok


@pytest.mark.parametrize(
    "source,ok",
    [("hf://THUDM/CogVideoX-5b", True), ("hf://THUDM", False), ("pvc://models/cogvideox", True), ("ftp://x/y", False),
     ("hf://THUDM/CogVideoX-5b@v1.0", True), ("hf://THUDM/../x", False), ("local://models/./x", False)],
)
def test_model_source_rules(source, ok):
    assert ("spec.model.source" not in problems({**BASE, "model": {"name": "cogvideox-5b", "source": source}})) is ok


def test_ulysses_must_divide_heads_per_model():
    assert "spec.parallel.ulysses" in problems({**BASE, "model": {"name": "cogvideox-2b"}, "parallel": {"ulysses": 4}})
    assert problems({**BASE, "parallel": {"ulysses": 3}}) == {}  # 48 heads, 30 latent rows


def test_parallel_must_divide_the_latent_rows_the_planner_would_refuse():
    """The issue's example: 4 ranks on CogVideoX at 480p passed validation and failed to plan."""
    found = problems({**BASE, "parallel": {"ulysses": 4}})
    assert set(found) == {"spec.parallel"} and "30 latent patch rows" in found["spec.parallel"]
    assert "[1, 2, 3, 5, 6]" in found["spec.parallel"], "the message lists the degrees that work"
    assert problems({**BASE, "video": {"height": 768, "width": 1360}, "parallel": {"ulysses": 4}}) == {}


def test_cfg_parallel_needs_guidance():
    assert "spec.parallel.cfg" in problems({**BASE, "sampling": {"guidanceScale": 1}, "parallel": {"cfg": 2}})
    assert problems({**BASE, "sampling": {"guidanceScale": 6}, "parallel": {"cfg": 2}}) == {}


def test_unet_models_are_single_rank():
    assert "spec.parallel.ring" in problems({"model": {"name": "i2vgen-xl"}, "prompt": "x",
                                             "image": "pvc://in/a.png", "parallel": {"ring": 2}})


@pytest.mark.parametrize("text,expected", [("24Gi", 24 * 2**30), ("24GiB", 24 * 2**30), ("80GB", 80 * 10**9), ("1.5Gi", int(1.5 * 2**30))])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(ValueError, match="24Gi"):
        parse_bytes("lots")


def test_catalog_frame_rules_accept_native_frames():
    for model in CATALOG.values():
        assert model.frames.accepts(model.native_frames), model.id
        assert model.native_width % model.size_multiple == 0, model.id
        assert model.tasks, model.id


def test_unknown_model_lookup_lists_known_ids():
    with pytest.raises(KeyError, match="cogvideox-5b"):
        get_model("sora")


def test_status_round_trips_with_camel_case():
    status = VideoJobStatus.model_validate(
        {"phase": "Running", "plan": {"gpus": 2, "ulysses": 2, "estimatedPeakGiBPerGPU": 20.5},
         "measured": {"peakGiB": 19.0}, "attempts": [{"number": 1, "result": "OutOfMemory"}]}
    )
    wire = status.to_wire()
    assert wire["plan"]["estimatedPeakGiBPerGPU"] == 20.5 and wire["measured"]["peakGiB"] == 19.0
    assert status.phase is Phase.RUNNING and not status.phase.terminal
    assert Phase.FAILED.terminal


def test_operator_package_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys, videojob.cli, videojob.api, videojob.crd, videojob.planner, videojob.controller.handlers, "
            "videojob.raycluster.embedded, videojob.metrics, videojob.driver_protocol, videojob.jobrequest; "
            "videojob.planner.load_calibration(); "
            "bad = [m for m in ('torch', 'diffusers', 'transformers', 'ray', 'xfuser') if m in sys.modules]; "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
