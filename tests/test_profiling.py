"""Symbolic memory profiling (runtime/videojob_runtime/profiling) and the
calibration table the planner reads.

Everything here runs on the CPU in well under a minute: full-size models are
only ever built under FakeTensorMode.
"""
from __future__ import annotations

import json
import resource
from pathlib import Path

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

torch = require_module("torch")
require_module("diffusers")
require_module("transformers")

from videojob.catalog import MODEL_IDS, get_model  # noqa: E402
from videojob_runtime.configs import build_component, component_configs  # noqa: E402
from videojob_runtime.profiling import memtrack, stages  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CALIBRATION = REPO / "operator" / "videojob" / "planner" / "calibration.json"
GiB = 1024**3
DTYPES = ("bfloat16", "float16", "float32")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_tracker_real_equals_fake_on_tiny_transformer():
    """The same forward, once on real CPU tensors and once under
    FakeTensorMode, reaches the same live-bytes peak, to the byte."""
    mid = "tiny-cogvideox"
    info = get_model(mid)
    w, h, f = info.native_width, info.native_height, info.native_frames
    torch.manual_seed(0)
    module = build_component(mid, "transformer", "float32")
    inputs, call = stages._denoise_call(mid, module, w, h, f, 2, "float32")
    real_peak, tracker = stages._measure(module, inputs, call)
    assert real_peak > 0
    assert tracker.sdpa_calls > 0  # attention went through the flash route
    assert "_scaled_dot_product_flash_attention_for_cpu" in tracker.ops
    fake = stages.profile_denoise(mid, w, h, f, 2, "float32")
    assert fake["activation_peak_bytes"] == real_peak


def test_tracker_real_equals_fake_on_tiny_vae_decode():
    mid = "tiny-cogvideox"
    info = get_model(mid)
    w, h, f = info.native_width, info.native_height, info.native_frames
    torch.manual_seed(0)
    vae = build_component(mid, "vae", "float32")
    inputs, call = stages._decode_call(mid, vae, w, h, f, "float32")
    real_peak, _ = stages._measure(vae, inputs, call)
    fake = stages.profile_decode(mid, w, h, f, "float32", tiling=False)
    assert fake["activation_peak_bytes"] == real_peak > 0


def test_tracker_counts_new_storages_not_views_or_residents():
    x = torch.randn(256, 256)  # 256 KiB, pre-existing: resident
    with torch.no_grad(), memtrack.LiveBytes(resident=[x]) as tr:
        v = x.t()  # a view: no new storage
        assert tr.live == 0
        y = x * 2  # a new 256 KiB storage
        assert tr.live == 256 * 256 * 4
        del y
        assert tr.live == 0
        z = v.contiguous()
    assert tr.peak == 256 * 256 * 4
    del z


def test_denoise_profile_tiny_cogvideox_grows_with_frames():
    mid = "tiny-cogvideox"
    info = get_model(mid)
    w, h = info.native_width, info.native_height
    small = stages.profile_denoise(mid, w, h, 9, 2, "float32")
    large = stages.profile_denoise(mid, w, h, 17, 2, "float32")
    assert small["activation_peak_bytes"] > 0
    assert large["activation_peak_bytes"] > small["activation_peak_bytes"]
    assert large["latent_tokens"] > small["latent_tokens"]
    assert small["stage"] == "denoise" and small["component"] == "transformer"


def test_full_size_cogvideox_2b_stats_without_allocating():
    """1,693,783,872 parameters (the published CogVideoX-2b transformer has
    1.69e9), built under FakeTensorMode: no real memory."""
    before = _rss_bytes()
    stats = stages.component_stats("cogvideox-2b", "transformer", "float16")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert abs(stats["params"] - 1.69e9) / 1.69e9 < 0.01
    assert stats["num_blocks"] == 30
    # fp16 parameters: 3.15 GiB (DESIGN.md); weights add the float64 sincos table.
    assert abs(stats["weight_bytes"] - stats["buffer_bytes"] - 3.15 * GiB) < 0.01 * GiB
    assert 0 < stats["largest_block_bytes"] < stats["weight_bytes"] / 20
    assert stats["largest_leaf_bytes"] > 0
    assert grown < 1 * GiB


def test_full_size_reference_figures():
    """DESIGN.md's measured figures: CogVideoX-2b transformer activations at
    batch 2 (1.53 GiB), T5-XXL weights in fp16 with 'wo' in fp32 (10.75 GiB)
    and in bf16 (8.87 GiB)."""
    den = stages.profile_denoise("cogvideox-2b", 720, 480, 49, 2, "float16")
    assert den["latent_tokens"] == 13 * 30 * 45
    assert abs(den["activation_peak_bytes"] / GiB - 1.53) < 0.02
    t5_16 = stages.component_stats("cogvideox-2b", "text_encoder", "float16")
    t5_bf = stages.component_stats("cogvideox-2b", "text_encoder", "bfloat16")
    assert abs(t5_16["weight_bytes"] / GiB - 10.75) < 0.01
    assert abs(t5_bf["weight_bytes"] / GiB - 8.87) < 0.01
    assert t5_16["fp32_params"] == 24 * 4096 * 10240 and t5_bf["fp32_params"] == 0


def test_t5_keeps_wo_in_fp32_only_in_fp16():
    te16 = build_component("tiny-cogvideox", "text_encoder", "float16")
    tebf = build_component("tiny-cogvideox", "text_encoder", "bfloat16")
    wo16 = {n: p.dtype for n, p in te16.named_parameters() if ".wo." in n}
    assert wo16 and set(wo16.values()) == {torch.float32}
    others = {p.dtype for n, p in te16.named_parameters() if ".wo." not in n}
    assert others == {torch.float16}
    assert {p.dtype for p in tebf.parameters()} == {torch.bfloat16}


def test_every_catalog_model_has_component_configs():
    for mid in MODEL_IDS:
        comps = component_configs(mid)
        assert "text_encoder" in comps and "vae" in comps
        assert ("transformer" in comps) != ("unet" in comps)
        for c in comps.values():
            assert c.class_name and c.source and isinstance(c.config, dict)


def test_checked_in_calibration_table():
    assert CALIBRATION.exists(), "run: python -m videojob_runtime.profiling --out " + str(CALIBRATION)
    table = json.loads(CALIBRATION.read_text())
    assert table["schema"] == 2
    for key in ("torch", "diffusers", "transformers", "python", "platform", "generated"):
        assert table["environment"][key]
    assert table["method"] and table["constants"]
    assert table["environment"]["profiling_seconds"] == pytest.approx(
        sum(m["profiled"]["seconds"] for m in table["models"].values()), abs=0.1 * len(table["models"]))
    models = table["models"]
    missing = table.get("missing", {})
    assert set(models) | set(missing) == set(MODEL_IDS)
    assert set(models) == set(MODEL_IDS), f"models left out: {missing}"
    for mid, entry in models.items():
        comps = entry["components"]
        assert set(comps) == set(component_configs(mid)), mid
        for name, c in comps.items():
            for key in ("class", "source", "params", "num_blocks"):
                assert key in c, (mid, name, key)
            assert c["params"] > 0
            for key in ("weight_bytes", "largest_leaf_bytes", "largest_block_bytes"):
                assert set(c[key]) == set(DTYPES), (mid, name, key)
                assert all(isinstance(v, int) and v >= 0 for v in c[key].values())
            assert c["weight_bytes"]["float32"] > c["weight_bytes"]["bfloat16"] > 0
        stages_seen = {s["stage"] for s in entry["samples"]}
        assert stages_seen >= {"encode", "denoise", "decode"}, mid
        for s in entry["samples"]:
            base = {"stage", "component", "dtype", "activation_peak_bytes", "seconds"}
            need = {
                "encode": base | {"batch"},
                "denoise": base | {"batch", "width", "height", "frames", "latent_tokens", "text_tokens"},
                "decode": base | {"width", "height", "frames", "tiling"},
            }.get(s["stage"], base)
            assert need <= set(s), (mid, s)
            assert isinstance(s["activation_peak_bytes"], int) and s["activation_peak_bytes"] > 0
            if s["stage"] == "encode" and s["component"] == "text_encoder":
                assert s["text_tokens"] > 0
        info = get_model(mid)
        den = [s for s in entry["samples"] if s["stage"] == "denoise"]
        assert {s["batch"] for s in den} == {1, 2}
        assert any(s["frames"] == info.native_frames for s in den)
        assert any(s["frames"] < info.native_frames for s in den)
        dec = [s for s in entry["samples"] if s["stage"] == "decode"]
        assert {s["tiling"] for s in dec} == {True, False}
        assert entry["profiled"]["at"] and entry["profiled"]["torch"]
        denoiser = "transformer" if "transformer" in comps else "unet"
        assert 0.4 < comps[denoiser]["fp8_weight_bytes"]["bfloat16"] / comps[denoiser]["weight_bytes"]["bfloat16"] < 0.75
        skipped = [s for s in dec if s.get("skip_unread_conv_cache")]
        assert bool(skipped) == (info.family.value in ("cogvideox", "consisid")), mid
        if skipped:
            assert {s["tiling"] for s in skipped} == {True, False}
        two_calls = [s for s in den if s.get("calls") == 2]
        assert bool(two_calls) == (not info.cfg_batched), mid
        if not info.tiny:
            enc = {s["dtype"] for s in entry["samples"]
                   if s["stage"] == "encode" and s["component"] == "text_encoder"}
            assert enc >= {"bfloat16", "float16"}


def test_merging_a_subset_keeps_the_other_models_records(tmp_path):
    """`videojob profile --models X` into an existing table: X is re-profiled,
    every other model keeps its entry and its own profiling record, and the
    environment's profiling_seconds is the sum over the table (not the run's)."""
    from videojob_runtime.profiling import write_calibration

    out = tmp_path / "cal.json"
    first = write_calibration(out, ["tiny-wan"], progress=None, merge=False)
    wan = first["models"]["tiny-wan"]
    second = write_calibration(out, ["tiny-cogvideox"], progress=None)
    assert list(second["models"]) == ["tiny-cogvideox", "tiny-wan"]
    assert second["models"]["tiny-wan"]["profiled"] == wan["profiled"]
    assert second["environment"]["this_run"]["models"] == ["tiny-cogvideox"]
    assert second["environment"]["this_run"]["merged"] is True
    total = sum(m["profiled"]["seconds"] for m in second["models"].values())
    assert second["environment"]["profiling_seconds"] == pytest.approx(total, abs=0.15)
    assert second["environment"]["profiling_seconds"] > second["models"]["tiny-cogvideox"]["profiled"]["seconds"]
    # The constants are complete; fitted ones a tiny table cannot refit are carried over, and say so.
    from videojob.planner import parse_calibration

    table = json.loads(out.read_text())
    assert "carried over" in table["constants"]["conv_workspace_bytes_per_pixel"]["provenance"]
    assert parse_calibration(table).constants is not None


def test_two_call_step_holds_the_first_output():
    """A Wan step under guidance (two batch-1 calls) peaks above one batch-1 call
    by at least the first call's output, which it keeps."""
    one = stages.profile_denoise("tiny-wan", 64, 64, 9, 1, "float32")
    two = stages.profile_denoise("tiny-wan", 64, 64, 9, 1, "float32", calls=2)
    out = 1 * 4 * 3 * 8 * 8 * 4  # [1, C=4, latent frames 3, 8, 8] float32
    assert two["calls"] == 2 and "calls" not in one
    assert two["activation_peak_bytes"] >= one["activation_peak_bytes"] + out
    with pytest.raises(ValueError, match="calls"):
        stages.profile_denoise("tiny-wan", 64, 64, 9, 1, "float32", calls=3)
