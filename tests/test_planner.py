"""Planner: calibrated memory model, layout choice, and `videojob plan`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import REPO, SPEC_SPACE, plannable_without_limits
from videojob.api import parse_spec
from videojob.catalog import CATALOG, get_model
from videojob.planner import (
    GiB, Inventory, Job, Layout, Request, choose, estimate_memory, load_calibration, plan_spec, resolve_cache,
)
from videojob.planner.anchors import LATENCY_ANCHORS, MEMORY_ANCHORS
from videojob.planner.calibration import Constants
from videojob.planner.choose import GPU_SAVING_THRESHOLD
from videojob.planner.fit import anchor_peak, calibrated_constants
from videojob.planner.memory import OFFLOAD_MODES, MemoryModel

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
# model offload + VAE tiling 11 (anchors.py, in-sample: the conv workspace is
# fitted to them). The estimate of diffusers as shipped must be within 10%.
ANCHOR_JOB = Job(get_model("cogvideox-2b"), 720, 480, 49, 50, 6.0, "float16")
AS_SHIPPED = dict(free_text_encoder=False, skip_unread_conv_cache=False)


@pytest.mark.parametrize("anchor", [a for a in MEMORY_ANCHORS if a.in_sample and a.bound == "about"],
                         ids=lambda a: a.label)
def test_in_sample_memory_anchors_within_10_percent(anchor):
    model = get_model(anchor.model)
    job = Job(model, anchor.width, anchor.height, anchor.frames, 50, model.default_guidance, anchor.dtype)
    peak = anchor_peak(MemoryModel(CAL.model(anchor.model), job), anchor) / GiB
    assert abs(peak - anchor.published_gb) / anchor.published_gb <= 0.10, (peak, anchor.published_gb)


def test_cogvideox_2b_sequential_anchor_under_4():
    layout = Layout(offload="sequential", vae_tiling=True, **AS_SHIPPED)
    assert estimate_memory(CAL.model("cogvideox-2b"), ANCHOR_JOB, layout).peak / GiB < 4.0


def test_every_anchor_cites_its_source_and_measure():
    for a in MEMORY_ANCHORS:
        assert "http" in a.source and a.measure in ("max_memory_allocated", "unstated"), a.label
        assert a.bound in ("about", "below", "from"), a.label
        assert a.model in CATALOG and get_model(a.model).frames.accepts(a.frames), a.label
    for a in LATENCY_ANCHORS:
        assert "http" in a.source
    fitted = {a.fits.split(".")[0] for a in (*MEMORY_ANCHORS, *LATENCY_ANCHORS) if a.fits}
    assert fitted <= set(Constants.names())
    assert sum(not a.in_sample for a in MEMORY_ANCHORS) >= 1 and sum(not a.in_sample for a in LATENCY_ANCHORS) >= 1


def test_every_constant_the_planner_uses_has_its_provenance():
    """calibration.json's constants: each one the planner reads, with how it was
    obtained; the fitted ones name the published figure they were fitted to."""
    import re

    table = json.loads((REPO / "operator" / "videojob" / "planner" / "calibration.json").read_text())
    constants = table["constants"]
    assert set(constants) == set(Constants.names())
    for name, entry in constants.items():
        assert entry["kind"] in ("measured", "fitted", "assumed", "counted"), name
        assert len(entry["provenance"]) > 30, name
        if entry["kind"] == "fitted":
            assert "fitted to" in entry["provenance"] and entry.get("figures"), name
    # The models use only these: no number of their own hides in the modules.
    for module in ("memory.py", "latency.py"):
        source = (REPO / "operator" / "videojob" / "planner" / module).read_text()
        used = set(re.findall(r"\bc\.([a-z_0-9]+)", source)) | set(re.findall(r"constants\.([a-z_0-9]+)", source))
        assert used <= set(Constants.names()) | {"replace", "names"}, used - set(Constants.names())
        top_level = re.findall(r"^([A-Z][A-Z_0-9]+) = ", source, flags=re.M)
        assert set(top_level) <= {"GiB", "OFFLOAD_MODES"}, top_level


def test_fitted_constants_are_what_the_fit_gives():
    """The fitted values in the checked-in table are the fit's, from its own samples and
    the published figures (a hand edit, or a figure changed without refitting, fails here)."""
    table = json.loads((REPO / "operator" / "videojob" / "planner" / "calibration.json").read_text())
    refit = calibrated_constants(table["models"])
    for name, entry in table["constants"].items():
        assert refit[name]["value"] == pytest.approx(entry["value"], rel=1e-9), name


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


def test_wan_runs_guidance_as_two_calls_at_batch_1():
    """Wan's pipeline calls the transformer twice per step at batch 1 (catalog:
    cfg_batched False): the activations are one batch-1 call's plus the first
    call's output, not a batch-2 call's; CogVideoX batches the two."""
    wan = Job(get_model("wan2.1-t2v-1.3b"), 832, 480, 81, 50, 5.0)
    cal = CAL.model(wan.model.id)
    model = MemoryModel(cal, wan)
    act = model.estimate(Layout()).stages["denoise"]["activations"]
    assert wan.calls_per_step == 2
    assert act == pytest.approx(cal.denoise.bytes(wan.tokens, 1, wan.dtype) + model.call_output)
    assert act < 0.6 * cal.denoise.bytes(wan.tokens, 2, wan.dtype)
    unguided = MemoryModel(cal, Job(wan.model, 832, 480, 81, 50, 1.0)).estimate(Layout())
    assert unguided.stages["denoise"]["activations"] == pytest.approx(cal.denoise.bytes(wan.tokens, 1, wan.dtype))
    cog = Job(get_model("cogvideox-5b"), 720, 480, 49, 50, 6.0)
    cog_cal = CAL.model(cog.model.id)
    cog_act = MemoryModel(cog_cal, cog).estimate(Layout()).stages["denoise"]["activations"]
    assert cog.calls_per_step == 1 and cog_act == pytest.approx(cog_cal.denoise.bytes(cog.tokens, 2, cog.dtype))


def test_host_ram_holds_every_component_while_loading_and_the_parked_encoder_per_rank():
    job = Job(get_model("cogvideox-5b"), 720, 480, 49, 50, 6.0)
    cal = CAL.model(job.model.id)
    weights = {n: c.weights(job.dtype) for n, c in cal.components.items()}
    model = MemoryModel(cal, job)
    for gpus in (1, 4):
        layout = Layout(ulysses=gpus)
        phases = model.host_phases(layout)
        assert phases["load"] == sum(weights.values())  # from_pretrained: everything on the host
        assert phases["job"] == weights["text_encoder"]  # parked after encoding, for the whole job
        process = cal.constants.process_host_bytes
        assert model.host(layout) == pytest.approx((process + sum(weights.values())) * gpus)
    moved = model.host_phases(Layout(decode_offload=True))["job"]
    assert moved == weights["text_encoder"] + weights["transformer"]
    kept = model.host_phases(Layout(free_text_encoder=False))["job"]
    assert kept == 0


def test_skipping_the_unread_conv_cache_lowers_the_cogvideox_decode_only():
    for model_id, applies in (("cogvideox-2b", True), ("consisid", True), ("wan2.1-t2v-1.3b", False)):
        model = get_model(model_id)
        job = Job(model, model.native_width, model.native_height, model.native_frames, 50, 6.0)
        memory = MemoryModel(CAL.model(model_id), job)
        for tiling in (False, True):
            ours = memory.estimate(Layout(vae_tiling=tiling)).stages["decode"]["activations"]
            shipped = memory.estimate(Layout(vae_tiling=tiling, skip_unread_conv_cache=False)).stages["decode"]
            if applies:
                assert ours < 0.9 * shipped["activations"], (model_id, tiling)
            else:
                assert ours == shipped["activations"], (model_id, tiling)


def _consisid_request(**kw) -> Request:
    job = Job(get_model("consisid"), 720, 480, 49, 50, 6.0)
    return Request(job=job, max_gpus=6, cache="off", **kw)


def test_decode_offload_chosen_where_only_it_fits():
    """ConsisID on 6 GPUs (ulysses 3 x cfg 2) peaks in the untiled decode with
    the idle transformer resident; with tiling ruled out, a GPU too small for
    that but big enough once the transformer is on the host gets the offload."""
    request = _consisid_request(vae_tiling=False)
    result = choose(request, Inventory(gpu_memory=24 * GiB, gpus_per_node=6), CAL)
    chosen = result.chosen
    assert chosen is not None and chosen.layout.decode_offload and chosen.layout.offload == "none"
    assert chosen.layout.gpus == 6 and chosen.memory.decoding_ranks == 1  # xfuser: the last rank decodes
    twin = MemoryModel(CAL.model("consisid"), request.job)
    without = replace(chosen.layout, decode_offload=False)
    assert twin.decode_sets_peak(without) and twin.need(without) > 24 * GiB
    assert "transformer" not in chosen.memory.stages["decode"]
    assert chosen.to_json()["decodeOffload"] is True
    # With room for the transformer through the decode, no offload.
    roomy = choose(request, Inventory(gpu_memory=48 * GiB, gpus_per_node=6), CAL).chosen
    assert roomy is not None and not roomy.layout.decode_offload


@settings(max_examples=150, deadline=None)
@given(job=jobs(), gib=st.sampled_from([12, 16, 24, 32, 48, 80]), gpus=st.sampled_from([1, 2, 4, 8]))
def test_decode_offload_only_when_it_is_needed(job, gib, gpus):
    """Chosen only where decode sets the peak and the same layout without it does not fit."""
    result = choose(_request(job), Inventory(gpu_memory=gib * GiB, gpus_per_node=gpus), CAL)
    for alt in result.alternatives:
        if alt.layout.decode_offload:
            assert alt.layout.offload == "none"
            model = MemoryModel(CAL.model(job.model.id), job)
            twin = replace(alt.layout, decode_offload=False)
            assert model.decode_sets_peak(twin) and model.need(twin) > alt.need
    if result.chosen and result.chosen.layout.decode_offload:
        model = MemoryModel(CAL.model(job.model.id), job)
        assert model.need(replace(result.chosen.layout, decode_offload=False)) > gib * GiB


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


@settings(max_examples=400, deadline=None)
@given(spec=SPEC_SPACE)
def test_what_validates_plans(spec):
    """validate ok => plan does not fail for a reason the spec alone decides
    (planned on a node with as much of everything as a job can ask for)."""
    from videojob.api import InvalidVideoJob

    try:
        parse_spec(spec)
    except InvalidVideoJob:
        return
    assert plannable_without_limits(spec) is None, spec


def test_a_parallel_override_is_checked_against_the_node():
    spec = parse_spec({"model": {"name": "cogvideox-5b"}, "prompt": "x", "parallel": {"ulysses": 2, "cfg": 2}})
    result = plan_spec(spec, Inventory(gpu_memory=80 * GiB, gpus_per_node=1, host_memory=512 * GiB))
    assert result.chosen is None and "needs 4 GPUs in one node; this node has 1" in result.reason


def _sizes(model):
    """The native size and, where the model allows it, two others the rules treat differently."""
    yield {}
    if not model.fixed_resolution:
        m = model.size_multiple
        yield {"width": max(model.min_size, model.native_width // 2 // m * m),
               "height": max(model.min_size, (model.native_height * 2 // 3) // m * m)}
        yield {"frames": next(f for f in range(model.frames.maximum, 0, -1) if model.frames.accepts(f))}


def test_parallel_overrides_validate_exactly_when_they_plan():
    """Every model, a few sizes, both guidance regimes, every cache policy and every
    degree triple up to 8 GPUs: the spec validates if and only if the planner can
    run that layout (validation is neither weaker nor stricter than the planner)."""
    from videojob.api import InvalidVideoJob
    from videojob.catalog import CATALOG

    node = Inventory(gpu_memory=10**6 * GiB, gpus_per_node=8, host_memory=10**7 * GiB)
    checked = disagreements = 0
    triples = [(u, r, c) for u in range(1, 9) for r in range(1, 9) for c in (1, 2) if u * r * c <= 8]
    for model in CATALOG.values():
        inputs = {"image": "pvc://in/a.png"} if "i2v" in model.tasks else {}
        inputs |= {"faceImage": "pvc://in/f.png"} if "identity" in model.tasks else {}
        for video in _sizes(model):
            for guidance in (1.0, model.default_guidance):
                for cache in (c for c in model.caches):
                    for u, r, c in triples:
                        data = {"model": {"name": model.id}, "prompt": "x", **inputs, "video": video,
                                "sampling": {"guidanceScale": guidance}, "cache": {"policy": cache},
                                "parallel": {"ulysses": u, "ring": r, "cfg": c}}
                        try:
                            parse_spec(data)
                            valid = True
                        except InvalidVideoJob:
                            valid = False
                        plans = plannable_without_limits(data) is None if valid else (
                            plan_spec(parse_spec({k: v for k, v in data.items() if k != "parallel"}), node).chosen
                            is not None and _layout_ok(model, video, guidance, cache, (u, r, c)))
                        checked += 1
                        disagreements += valid != plans
                        assert valid == plans, (data, valid, plans)
    assert checked > 5000 and disagreements == 0


def _layout_ok(model, video, guidance, cache, degrees) -> bool:
    from videojob.planner.choose import layout_problem

    job = Job(model, video.get("width", model.native_width), video.get("height", model.native_height),
              video.get("frames", model.native_frames), 10, guidance)
    return layout_problem(job, *degrees, resolve_cache(model, cache)) is None


def test_spec_memory_decode_offload_is_forced_or_forbidden():
    inventory = Inventory(gpu_memory=80 * GiB, gpus_per_node=4, host_memory=512 * GiB)
    forced = plan_spec(parse_spec(_memory_spec({"decodeOffload": True})), inventory).chosen
    assert forced.layout.decode_offload and "denoiser to host for decode" in forced.layout.summary()
    never = plan_spec(parse_spec(_memory_spec({"decodeOffload": False})), inventory)
    assert not any(a.layout.decode_offload for a in never.alternatives)
