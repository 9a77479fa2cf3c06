"""Every layout the planner can emit for the tiny models runs through the real worker.

The list comes from the planner (``enumerate_layouts``) for a 2-rank CPU
"node", over every cache policy each model allows and the ``spec.memory``
overrides (VAE slicing is only ever chosen by one): offload modes x VAE
tiling/slicing x cache policy x the parallel degrees the model allows. A new
layout the planner learns to emit is tested here without editing this file.

Each layout's frames must equal those of the one-rank, no-offload run with
the same cache policy and VAE settings (float tolerance), with the same
cache decisions (identical skip statistics). Cache thresholds sit at the
ends where a decision cannot depend on float noise: "always reuse after the
first computed step" (dbcache >= 1.0, fbcache and teacache huge), so a cache
that silently stopped working (e.g. dropped by offload re-arming) shows up
as different statistics and different frames.

`make test` runs a pairwise cover of the matrix (``pairwise_cover``: for each
model, every pair of values of two dimensions, e.g. group offload with a
ring degree of 2, appears in at least one case), about a quarter of it; the
rest is `slow` (`make test-slow`, `make bench`), for CI time.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("torch")
require_module("xfuser")

from videojob.api import parse_spec  # noqa: E402
from videojob.catalog import CATALOG, get_model  # noqa: E402
from videojob.planner import GiB, Inventory, Layout, candidate_layouts, request_from_spec  # noqa: E402

NODE = Inventory(gpu_memory=1024 * GiB, gpus_per_node=2, host_memory=4096 * GiB, gpu_type="generic")
TINY = tuple(m.id for m in CATALOG.values() if m.tiny)
# Thresholds at the "always reuse" end (module docstring).
ALWAYS = {"dbcache": 1.0, "fbcache": 1e9, "teacache": 1e9}
STEPS = 2


def _spec(model_id: str, cache: str, memory: dict) -> dict:
    model = get_model(model_id)
    data = {"model": {"name": model_id, "dtype": "float32"}, "prompt": "a tiny matrix video",
            "sampling": {"steps": STEPS}, "cache": {"policy": cache}, "resources": {"maxGPUs": 2}}
    if memory:
        data["memory"] = memory
    if "i2v" in model.tasks:
        data["image"] = "local://inputs/image.png"
    if "identity" in model.tasks:
        data["faceImage"] = "local://inputs/face.png"
    return data


def planner_layouts(model_id: str) -> list[Layout]:
    """The distinct layouts the planner can emit for this model on the 2-rank node."""
    model = get_model(model_id)
    out: dict[Layout, None] = {}
    # spec.memory overrides reach the layouts only they choose (VAE slicing; decode
    # offload, which the planner adds by itself only where decode sets the peak).
    for cache in (c for c in model.caches if c != "auto"):
        for memory in ({}, {"vaeSlicing": True}, {"decodeOffload": True}):
            request = request_from_spec(parse_spec(_spec(model_id, cache, memory)))
            for layout in candidate_layouts(request, NODE):
                out[layout] = None
    return list(out)


# Grouped by degrees, so one two-rank actor group at a time serves its cases.
CASES = sorted(((m, lay) for m in TINY for lay in planner_layouts(m)),
               key=lambda c: ((c[1].ulysses, c[1].ring, c[1].cfg), c[0], c[1].cache, c[1].offload))


def _dimensions(lay: Layout) -> dict[str, object]:
    return {"degrees": (lay.ulysses, lay.ring, lay.cfg), "offload": lay.offload,
            "vae": (lay.vae_tiling, lay.vae_slicing), "decodeOffload": lay.decode_offload, "cache": lay.cache}


def _pairs(case) -> set[tuple]:
    """(model, dimension, value, other dimension, its value) for every two dimensions of the case."""
    model_id, lay = case
    dims = _dimensions(lay)
    return {(model_id, a, dims[a], b, dims[b]) for a, b in itertools.combinations(sorted(dims), 2)}


def pairwise_cover(cases: list) -> list:
    """Cases covering every pair the whole list has (greedy: each pick covers the most
    pairs not yet covered; ties go to the earlier case, so the choice is stable)."""
    pairs = {case: _pairs(case) for case in cases}
    needed, chosen = set().union(*pairs.values()), []
    while needed:
        best = max(cases, key=lambda c: len(pairs[c] & needed))
        chosen.append(best)
        needed -= pairs[best]
    return chosen


COVER = set(pairwise_cover(CASES))


def _case_id(case) -> str:
    model_id, lay = case
    return f"{model_id}-u{lay.ulysses}r{lay.ring}c{lay.cfg}-{lay.offload}-t{int(lay.vae_tiling)}" \
           f"s{int(lay.vae_slicing)}d{int(lay.decode_offload)}-{lay.cache}"


def test_the_matrix_covers_what_the_issue_asks():
    """Guards the generator: offload modes, VAE settings, caches and degrees all appear."""
    layouts = [lay for _, lay in CASES]
    assert {lay.offload for lay in layouts} == {"none", "model", "group", "sequential"}
    assert {(lay.vae_tiling, lay.vae_slicing) for lay in layouts} == {(a, b) for a in (0, 1) for b in (0, 1)}
    assert {lay.decode_offload for lay in layouts} == {False, True}
    assert {lay.cache for lay in layouts} == {"off", "dbcache", "fbcache", "teacache"}
    assert {(lay.ulysses, lay.ring, lay.cfg) for lay in layouts} == {(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)}
    families = {get_model(m).family for m, _ in CASES}
    assert len(families) == len({get_model(m).family for m in TINY})


def test_the_pairwise_cover_has_every_pair_and_is_smaller():
    """`make test`'s subset: every pair of dimension values of every model, far fewer runs."""
    covered = set().union(*(_pairs(c) for c in COVER))
    assert covered == set().union(*(_pairs(c) for c in CASES))
    assert {m for m, _ in COVER} == set(TINY)
    assert len(COVER) < len(CASES) / 2, (len(COVER), len(CASES))


@pytest.fixture(scope="module")
def inputs(face_inputs):
    """An image for i2v and a face with precomputed ConsisID embeddings (one file serves both)."""
    return {"image": str(face_inputs), "face": str(face_inputs)}


def _request(model_id: str, lay: Layout, inputs: dict, job_id: str):
    from videojob_runtime.request import JobRequest

    model = get_model(model_id)
    task = model.tasks[0]
    return JobRequest(
        job_id=job_id, model_id=model_id, task=task, prompt="a tiny matrix video", width=model.native_width,
        height=model.native_height, frames=model.native_frames, fps=model.native_fps, steps=STEPS,
        guidance=model.default_guidance, seed=11, dtype="float32", offload=lay.offload,
        vae_tiling=lay.vae_tiling, vae_slicing=lay.vae_slicing, cache=lay.cache, decode_offload=lay.decode_offload,
        cache_threshold=ALWAYS.get(lay.cache), frames_dtype="float32", track_memory=False,
        image=inputs["image"] if task == "i2v" else None,
        face_image=inputs["face"] if task == "identity" else None,
        local_inputs_dir=str(Path(inputs["face"]).parent),  # the test's own files: plain paths inside it
    )


@pytest.fixture(scope="module")
def one_rank():
    from videojob_runtime.worker import RankWorker

    return RankWorker(0, 1)


@pytest.fixture(scope="module")
def reference(one_rank, inputs):
    """The one-rank, no-offload run per (model, cache, tiling, slicing)."""
    results: dict[tuple, dict] = {}

    def get(model_id: str, lay: Layout) -> dict:
        key = (model_id, lay.cache, lay.vae_tiling, lay.vae_slicing)
        if key not in results:
            base = Layout(cache=lay.cache, vae_tiling=lay.vae_tiling, vae_slicing=lay.vae_slicing)
            out = one_rank.run(_request(model_id, base, inputs, "reference"))
            assert out["ok"], out
            results[key] = out
        return results[key]

    return get


@pytest.fixture(scope="module")
def groups(ray_session):
    """The two-rank actor group for a degree triple; one at a time (2 CPUs)."""
    from videojob_runtime.group import ActorGroup, GroupSpec

    current: dict[tuple, ActorGroup] = {}

    def get(lay: Layout):
        key = (lay.ulysses, lay.ring, lay.cfg)
        if key not in current:
            for group in current.values():
                group.teardown()
            current.clear()
            spec = GroupSpec(f"vj-matrix-u{key[0]}r{key[1]}c{key[2]}", ulysses=key[0], ring=key[1], cfg=key[2])
            current[key] = ActorGroup.start(spec, timeout_s=120, cpus_per_rank=0.5)
        return current[key]

    yield get
    for group in current.values():
        group.teardown()


@pytest.mark.parametrize("case", [c if c in COVER else pytest.param(c, marks=pytest.mark.slow) for c in CASES],
                         ids=[_case_id(c) for c in CASES])
def test_layout_runs_and_matches_the_one_rank_run(case, one_rank, reference, groups, inputs):
    model_id, lay = case
    expected = reference(model_id, lay)
    request = _request(model_id, lay, inputs, _case_id(case))
    if lay.gpus == 1:
        result = one_rank.run(request)
    else:
        result = groups(lay).run(request, timeout_s=180)
    assert result["ok"], result.get("error")
    frames, want = result["frames"], expected["frames"]
    assert frames.shape == want.shape
    span = float(want.max() - want.min()) or 1.0
    tolerance = 1e-5 if lay.gpus == 1 else 1e-3 * span
    assert float(np.abs(frames - want).max()) <= tolerance
    assert result["cache"] == expected["cache"], "different cache decisions than the one-rank run"
    if lay.cache != "off":
        assert result["cache"]["skipped"] > 0, "the step cache never reused anything"
    if lay.gpus > 1:
        assert all(c > 0 for c in result["collectives_per_rank"]), "a rank ran without collectives"
