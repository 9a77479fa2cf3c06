"""Planner: calibrated memory model, layout choice, and `videojob plan`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import REPO
from videojob.api import parse_spec
from videojob.catalog import CATALOG, get_model
from videojob.planner import (
    GiB, Inventory, Job, Layout, Request, choose, estimate_memory, load_calibration, plan_spec, resolve_cache,
)
from videojob.planner.choose import GPU_SAVING_THRESHOLD
from videojob.planner.memory import OFFLOAD_MODES

CAL = load_calibration()
REAL_MODELS = [m for m in CATALOG.values() if not m.tiny and m.id in CAL.models]
DIT_MODELS = [m for m in REAL_MODELS if m.sequence_parallel]


def test_every_catalog_model_is_calibrated():
    assert set(CAL.models) == set(CATALOG), f"missing: {set(CATALOG) - set(CAL.models)} {CAL.missing}"


@pytest.mark.parametrize("model", [m for m in CATALOG.values() if m.components], ids=lambda m: m.id)
def test_catalog_parameter_counts_match_the_real_modules(model):
    measured = CAL.model(model.id).components
    for comp in model.components:
        got = measured[comp.name].params
        assert abs(got - comp.params) / comp.params < 0.03, (comp.name, got, comp.params)


# CogVideoX-2b, 49 frames 720x480, fp16: diffusers' published peaks
# (max_memory_allocated, GiB): none 33, model offload 19, sequential < 4,
# model offload + VAE tiling 11. Our estimate must be within 20%.
ANCHOR_JOB = Job(get_model("cogvideox-2b"), 720, 480, 49, 50, 6.0, "float16")


@pytest.mark.parametrize(
    "layout,published",
    [
        (Layout(offload="none", free_text_encoder=False), 33.0),
        (Layout(offload="model"), 19.0),
        (Layout(offload="model", vae_tiling=True), 11.0),
    ],
    ids=["none", "model", "model+tiling"],
)
def test_cogvideox_2b_anchor(layout, published):
    peak = estimate_memory(CAL.model("cogvideox-2b"), ANCHOR_JOB, layout).peak / GiB
    assert abs(peak - published) / published <= 0.20, f"estimate {peak:.2f} GiB vs published {published}"


def test_cogvideox_2b_sequential_anchor_under_4():
    peak = estimate_memory(CAL.model("cogvideox-2b"), ANCHOR_JOB, Layout(offload="sequential", vae_tiling=True)).peak
    assert peak / GiB < 4.0


def test_offload_modes_order_memory():
    peaks = [estimate_memory(CAL.model("cogvideox-5b"), Job(get_model("cogvideox-5b"), 720, 480, 49, 50, 6.0),
                             Layout(offload=m)).peak for m in OFFLOAD_MODES]
    assert peaks == sorted(peaks, reverse=True)


def test_step_cache_adds_memory():
    job = Job(get_model("wan2.1-t2v-1.3b"), 832, 480, 81, 50, 5.0)
    off = estimate_memory(CAL.model(job.model.id), job, Layout()).stages["denoise"]
    on = estimate_memory(CAL.model(job.model.id), job, Layout(cache="dbcache")).stages["denoise"]
    assert sum(on.values()) > sum(off.values()) and "step cache" in on


@st.composite
def jobs(draw, models=REAL_MODELS):
    model = draw(st.sampled_from(models))
    frames = draw(st.sampled_from([f for f in range(1, model.frames.maximum + 1) if model.frames.accepts(f)]))
    if model.fixed_resolution:
        width, height = model.native_width, model.native_height
    else:
        m = model.size_multiple
        width = draw(st.integers(max(model.min_size, 256) // m, model.native_width // m)) * m
        height = draw(st.integers(max(model.min_size, 256) // m, model.native_height // m)) * m
    steps = draw(st.integers(1, 60))
    guidance = draw(st.sampled_from([1.0, 5.0, 6.0]))
    return Job(model, width, height, frames, steps, guidance, draw(st.sampled_from(["bfloat16", "float16"])))


def _request(job: Job, max_gpus: int = 8) -> Request:
    return Request(job=job, max_gpus=max_gpus, cache=resolve_cache(job.model, "auto"))


@settings(max_examples=150, deadline=None)
@given(job=jobs(), low=st.sampled_from([8, 12, 16, 24, 40]), extra=st.sampled_from([4, 8, 24, 40, 100]),
       gpus=st.sampled_from([1, 2, 4, 8]))
def test_more_gpu_memory_never_slower_or_more_offloaded(job, low, extra, gpus):
    small = choose(_request(job), Inventory(gpu_memory=low * GiB, gpus_per_node=gpus, host_memory=2048 * GiB), CAL)
    big = choose(_request(job), Inventory(gpu_memory=(low + extra) * GiB, gpus_per_node=gpus,
                                          host_memory=2048 * GiB), CAL)
    if small.chosen is None:
        return
    assert big.chosen is not None, "a job that fits in less memory must fit in more"
    a, b = small.chosen, big.chosen
    assert OFFLOAD_MODES.index(b.layout.offload) <= OFFLOAD_MODES.index(a.layout.offload)
    # Slower only by the documented GPU-saving allowance: each GPU doubling saved may cost up to 10%.
    allowance = (1 / (1 - GPU_SAVING_THRESHOLD)) ** max(math.log2(a.layout.gpus / b.layout.gpus), 0)
    assert b.latency.total <= a.latency.total * allowance * (1 + 1e-9)


@settings(max_examples=150, deadline=None)
@given(job=jobs(), gib=st.sampled_from([8, 12, 16, 24, 48, 80, 141]), gpus=st.sampled_from([1, 2, 4, 8]),
       host=st.sampled_from([32, 64, 256, 1024]))
def test_chosen_estimate_never_exceeds_capacity(job, gib, gpus, host):
    inventory = Inventory(gpu_memory=gib * GiB, gpus_per_node=gpus, host_memory=host * GiB)
    result = choose(_request(job), inventory, CAL)
    if result.chosen:
        assert result.chosen.memory.need <= inventory.gpu_memory
        assert result.chosen.memory.host_bytes <= inventory.host_memory
        assert result.chosen.layout.gpus <= gpus
    else:
        assert result.reason.startswith("nothing fits") or "no parallel layout" in result.reason


@settings(max_examples=150, deadline=None)
@given(job=jobs(DIT_MODELS), degrees=st.sampled_from([(1, 1, 2, 1), (1, 1, 1, 2), (2, 1, 4, 1), (2, 1, 2, 2),
                                                        (1, 2, 2, 2), (2, 2, 4, 2), (1, 1, 8, 1)]))
def test_raising_sp_never_raises_activation_bytes(job, degrees):
    u1, r1, u2, r2 = degrees
    cal = CAL.model(job.model.id)

    def activation(u, r):
        stage = estimate_memory(cal, job, Layout(ulysses=u, ring=r)).stages["denoise"]
        return stage["activations"] + stage.get("ring buffers", 0.0)

    assert activation(u2, r2) <= activation(u1, r1)


def test_layout_constraints_respected():
    spec = parse_spec({"model": {"name": "cogvideox-2b"}, "prompt": "x", "sampling": {"guidanceScale": 1.0}})
    result = plan_spec(spec, Inventory(gpu_memory=80 * GiB, gpus_per_node=8))
    tokens = get_model("cogvideox-2b").arch.tokens(720, 480, 49)
    for alt in result.alternatives:
        assert 30 % alt.layout.ulysses == 0
        assert tokens % (alt.layout.ulysses * alt.layout.ring) == 0
        assert alt.layout.cfg == 1  # guidance 1: no CFG to split


def test_unet_models_stay_on_one_gpu():
    spec = parse_spec({"model": {"name": "animatediff"}, "prompt": "x"})
    result = plan_spec(spec, Inventory(gpu_memory=80 * GiB, gpus_per_node=8))
    assert {a.layout.gpus for a in result.alternatives} == {1}


def test_fewer_gpus_preferred_when_gain_is_small():
    job = Job(get_model("cogvideox-5b"), 720, 480, 49, 50, 6.0)
    result = choose(_request(job), Inventory(gpu_memory=80 * GiB, gpus_per_node=8), CAL)
    chosen = result.chosen
    for alt in result.alternatives:
        if alt.fits and alt.layout.offload == chosen.layout.offload and alt.layout.gpus < chosen.layout.gpus:
            gain = (alt.latency.total - chosen.latency.total) / alt.latency.total
            assert gain >= GPU_SAVING_THRESHOLD - 1e-9, (alt.layout, chosen.layout, gain)


def test_nothing_fits_names_the_smallest_change():
    spec = parse_spec({"model": {"name": "cogvideox-5b"}, "prompt": "x", "resources": {"allowOffload": False}})
    result = plan_spec(spec, Inventory(gpu_memory=12 * GiB, gpus_per_node=1, host_memory=64 * GiB))
    assert result.chosen is None
    assert "allowOffload: true" in result.reason and "GiB" in result.reason


def test_spec_gpu_memory_overrides_inventory():
    spec = parse_spec({"model": {"name": "cogvideox-5b"}, "prompt": "x", "resources": {"gpuMemory": "16Gi"}})
    result = plan_spec(spec, Inventory(gpu_memory=80 * GiB, gpus_per_node=1, host_memory=64 * GiB))
    assert result.chosen and result.chosen.memory.need <= 16 * GiB


def _videojob(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "videojob.cli", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_plan_cli_json_for_the_cogvideox_example():
    result = _videojob("plan", "examples/cogvideox-5b-t2v.yaml", "--gpu-memory", "24GiB", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert set(out) == {"chosen", "alternatives", "reason"}
    chosen = out["chosen"]
    for key in ("gpus", "ulysses", "ring", "cfg", "offload", "vaeTiling", "vaeSlicing", "cache",
                "peakGiBPerGPU", "hostRAMGiB", "estimatedSeconds", "fits", "breakdownGiB"):
        assert key in chosen
    assert chosen["fits"] and chosen["needGiBPerGPU"] <= 24
    assert chosen in out["alternatives"] and any(not a["fits"] for a in out["alternatives"])
    assert set(chosen["breakdownGiB"]) == {"encode", "denoise", "decode"}


def test_plan_cli_flags_and_table():
    result = _videojob("plan", "--model", "wan2.1-t2v-14b", "--width", "1280", "--height", "720", "--frames", "81",
                       "--gpu-memory", "80GiB", "--gpus", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.index("Chosen:") < result.stdout.index("Alternatives")
    assert "Memory per GPU (GiB)" in result.stdout and "transformer" in result.stdout


def test_plan_cli_bad_flag_names_it():
    result = _videojob("plan", "--model", "cogvideox-5b", "--frames", "50")
    assert result.returncode == 1 and "--frames: " in result.stderr


def test_plan_cli_nothing_fits_exits_3():
    result = _videojob("plan", "--model", "wan2.1-t2v-14b", "--gpu-memory", "8GiB", "--host-memory", "16GiB")
    assert result.returncode == 3 and "Nothing fits" in result.stdout


def test_plan_cli_sweep():
    result = _videojob("plan", "--sweep", "cogvideox-2b", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["gpuGiB"] for r in rows] == [12, 16, 24, 48, 80, 141]
    sizes = [(r["width"] or 0) * (r["height"] or 0) * (r["frames"] or 0) for r in rows]
    assert sizes == sorted(sizes) and sizes[-1] > 0


@pytest.mark.parametrize("model_id", ["cogvideox-5b", "wan2.1-t2v-14b", "animatediff"])
def test_fast_totals_match_the_breakdown(model_id):
    """The planner ranks with totals computed without the breakdown: both must agree."""
    model = get_model(model_id)
    job = Job(model, model.native_width, model.native_height, model.native_frames, 30, 6.0)
    result = choose(_request(job), Inventory(gpu_memory=40 * GiB, gpus_per_node=8), CAL)
    for alt in result.alternatives:
        assert alt.need == pytest.approx(alt.memory.need, rel=1e-12)
        assert alt.host == pytest.approx(alt.memory.host_bytes, rel=1e-12)
        assert alt.seconds == pytest.approx(alt.latency.total, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(job=jobs(), gib=st.sampled_from([8, 12, 16, 24, 48, 80]), gpus=st.sampled_from([1, 2, 4, 8]))
def test_fast_path_chooses_the_same_layout(job, gib, gpus):
    inventory = Inventory(gpu_memory=gib * GiB, gpus_per_node=gpus)
    full = choose(_request(job), inventory, CAL, exhaustive=True)
    fast = choose(_request(job), inventory, CAL, exhaustive=False)
    assert (full.chosen and full.chosen.layout) == (fast.chosen and fast.chosen.layout)


def test_text_encoder_freed_after_encoding_without_offload():
    job = Job(get_model("cogvideox-5b"), 720, 480, 49, 50, 6.0)
    stages = estimate_memory(CAL.model("cogvideox-5b"), job, Layout()).stages
    assert "text_encoder" in stages["encode"]
    assert "text_encoder" not in stages["denoise"] and "text_encoder" not in stages["decode"]
    kept = estimate_memory(CAL.model("cogvideox-5b"), job, Layout(free_text_encoder=False)).stages
    assert "text_encoder" in kept["decode"]


def test_fbcache_keeps_the_job_on_one_gpu():
    spec = parse_spec({"model": {"name": "cogvideox-5b"}, "prompt": "x", "cache": {"policy": "fbcache"}})
    result = plan_spec(spec, Inventory(gpu_memory=80 * GiB, gpus_per_node=8))
    assert {a.layout.gpus for a in result.alternatives} == {1}


def _memory_spec(memory: dict, **extra) -> dict:
    return {"model": {"name": "cogvideox-5b"}, "prompt": "x", "memory": memory, **extra}


def test_spec_memory_forces_the_strategy():
    inventory = Inventory(gpu_memory=80 * GiB, gpus_per_node=1, host_memory=512 * GiB)
    free = plan_spec(parse_spec(_memory_spec({})), inventory).chosen
    forced = plan_spec(parse_spec(_memory_spec({"offload": "model", "vaeTiling": True, "vaeSlicing": True})),
                       inventory).chosen
    assert free.layout.offload == "none"
    assert (forced.layout.offload, forced.layout.vae_tiling, forced.layout.vae_slicing) == ("model", True, True)
    assert "VAE slicing" in forced.layout.summary()


def test_a_forced_layout_that_does_not_fit_is_refused_with_the_reason():
    inventory = Inventory(gpu_memory=16 * GiB, gpus_per_node=1, host_memory=512 * GiB)
    result = plan_spec(parse_spec(_memory_spec({"offload": "none"})), inventory)
    assert result.chosen is None
    assert "needs" in result.reason and "remove the spec.memory override (offload: none)" in result.reason
    assert plan_spec(parse_spec(_memory_spec({})), inventory).chosen is not None


def test_spec_memory_rules_name_the_field():
    from videojob.api import InvalidVideoJob

    for memory, extra in (({"offload": "model"}, {"resources": {"allowOffload": False}}),
                          ({"offload": "group"}, {"parallel": {"ulysses": 2}})):
        with pytest.raises(InvalidVideoJob) as info:
            parse_spec(_memory_spec(memory, **extra))
        assert [p.field for p in info.value.problems] == ["spec.memory.offload"]
    parse_spec(_memory_spec({"offload": "none"}, parallel={"ulysses": 2}))  # none is fine with parallel
