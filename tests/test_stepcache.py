"""Step caches on the tiny random-weight CogVideoX and Wan (real cache-dit and
diffusers hooks, float32). Block evaluations are counted by the handle's
hooks on each block's feed-forward; both tiny transformers have 2 blocks, so
the first block (always computed) bounds skipping at 50%.

CogVideoX batches CFG into one denoiser call per step; Wan calls it twice per
step (cond, uncond), with separate cache contexts.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from videojob_runtime.pipelines import build_tiny_pipeline
from videojob_runtime.stepcache import StepCacheConfig, apply_step_cache

STEPS = 8
MODELS = ("tiny-cogvideox", "tiny-wan")
CALLS_PER_STEP = {"tiny-cogvideox": 1, "tiny-wan": 2}
BLOCKS = 2
PROMPT, NEGATIVE = "a cat walks on the grass", "blurry"

# Thresholds for the tiny models' tests (their first-block residual moves
# 0.3-0.6 per step on CogVideoX, 0.09-0.22 on Wan: far more than a trained
# model, whose library defaults are 0.08 / 0.05). Chosen mid-way between
# measured decision values, so numeric noise cannot flip a decision:
#   CogVideoX 0.55: on its cached path the diffs are 0.305 0.363 0.429 0.457
#     0.447 (cached) 0.605 (computed) 0.385 (cached) -> 6 of 16 blocks skipped.
#   Wan 0.2: cond 0.087..0.185 cached, 0.219 computed (uncond 0.187 / 0.223)
#     -> 12 of 32 skipped.
# Both 37.5%; dbcache (1 warmup step) and fbcache make the same decisions here.
TINY_THRESHOLDS = {"tiny-cogvideox": 0.55, "tiny-wan": 0.2}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(pipe, steps: int = STEPS, seed: int = 0, **kwargs) -> np.ndarray:
    out = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=64, width=64, num_frames=9,
               num_inference_steps=steps, max_sequence_length=16, output_type="np",
               generator=torch.Generator().manual_seed(seed), **kwargs)
    return np.asarray(out.frames)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Frames are in [0, 1]: peak 1."""
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.fixture(scope="module")
def tiny():
    """Per model: a pipeline (shared: every test removes its cache), its
    cache-off frames, and the frames of another seed (an unrelated video)."""
    out = {}
    for m in MODELS:
        pipe = build_tiny_pipeline(m, "t2v")
        out[m] = SimpleNamespace(pipe=pipe, off=_run(pipe), other_seed=_run(pipe, seed=1))
    return out


@pytest.fixture
def cached(tiny):
    handles = []

    def apply(model, policy, threshold=None, target=None, **kw):
        h = apply_step_cache(target or tiny[model].pipe, StepCacheConfig(policy, threshold, STEPS, **kw))
        handles.append(h)
        return h

    yield apply
    for h in handles:
        h.remove()


def _total(model: str, steps: int = STEPS) -> int:
    return steps * CALLS_PER_STEP[model] * BLOCKS


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy, threshold, cached_calls_per_context", [
    ("dbcache", 0.0, 0),            # <= 0 never caches
    ("dbcache", 1.0, STEPS - 1),    # >= 1 caches every step after the 1 warmup step
    ("fbcache", 0.0, 0),            # diff > 0 always: computes
    ("fbcache", 1e9, STEPS - 1),    # caches every call after the first
])
def test_threshold_ends(tiny, cached, model, policy, threshold, cached_calls_per_context):
    h = cached(model, policy, threshold)
    frames = _run(tiny[model].pipe)
    skipped = cached_calls_per_context * CALLS_PER_STEP[model] * (BLOCKS - 1)
    assert h.stats() == {"evaluations": _total(model) - skipped, "skipped": skipped,
                         "calls": STEPS * CALLS_PER_STEP[model]}
    if skipped == 0:
        np.testing.assert_array_equal(frames, tiny[model].off)   # bit-identical to cache-off
    else:
        assert not np.array_equal(frames, tiny[model].off)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", ["dbcache", "fbcache"])
def test_tiny_default_threshold_skips_a_third_and_keeps_the_video(tiny, cached, model, policy):
    h = cached(model, policy, TINY_THRESHOLDS[model])
    frames = _run(tiny[model].pipe)
    st = h.stats()
    ratio = st["skipped"] / (st["evaluations"] + st["skipped"])
    assert ratio >= 0.30, st
    # Bound: at least 20 dB above the PSNR between the videos of two seeds
    # (12.5 dB CogVideoX, 28.2 dB Wan), i.e. an RMS error under a tenth of
    # the distance to an unrelated video (the cache perturbs the video, it
    # does not replace it), and never below 35 dB in absolute terms.
    # Measured: CogVideoX 47.1 dB, Wan 64.6 dB (always-cache: 41.4 / 64.4).
    got = psnr(frames, tiny[model].off)
    floor = max(35.0, psnr(tiny[model].other_seed, tiny[model].off) + 20.0)
    assert got > floor, (got, floor, st)


@pytest.mark.parametrize("model", MODELS)
def test_refresh_resets_the_context_between_jobs(tiny, cached, model):
    h = cached(model, "dbcache", TINY_THRESHOLDS[model])
    first = _run(tiny[model].pipe)
    stats = h.stats()
    h.refresh(4)            # a different job in between, on the warm pipeline
    _run(tiny[model].pipe, steps=4)
    assert h.stats()["calls"] == 4 * CALLS_PER_STEP[model]
    h.refresh(STEPS)
    second = _run(tiny[model].pipe)
    assert h.stats() == stats
    np.testing.assert_array_equal(second, first)


def test_a_job_without_refresh_is_refused(tiny, cached):
    """cache-dit's context persists: a second job would reuse the first's residuals."""
    h = cached("tiny-cogvideox", "dbcache", 1.0)
    _run(tiny["tiny-cogvideox"].pipe)
    with pytest.raises(RuntimeError, match="refresh"):
        _run(tiny["tiny-cogvideox"].pipe)
    h.refresh(STEPS)
    _run(tiny["tiny-cogvideox"].pipe)


def test_wan_without_cfg_uses_one_context(tiny, cached):
    h = cached("tiny-wan", "dbcache", 1.0)
    h.refresh(STEPS, cfg=False)
    _run(tiny["tiny-wan"].pipe, guidance_scale=1.0)
    assert h.stats() == {"evaluations": STEPS + 1, "skipped": STEPS - 1, "calls": STEPS}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("policy", ["dbcache", "fbcache", "off"])
def test_remove_restores_cache_off(tiny, model, policy):
    pipe = tiny[model].pipe
    h = apply_step_cache(pipe, StepCacheConfig(policy, 1e3 if policy == "fbcache" else 1.0, STEPS))
    _run(pipe)
    h.remove()
    h.remove()  # idempotent
    np.testing.assert_array_equal(_run(pipe), tiny[model].off)
    assert not getattr(pipe.transformer, "_is_cached", False)
    with pytest.raises(RuntimeError, match="removed"):
        h.refresh(STEPS)


def test_dbcache_goes_before_model_offload(tiny):
    """Model offload re-arms its hooks after every call; cache first survives that."""
    from videojob_runtime.strategies import OffloadConfig, apply_offload

    pipe = build_tiny_pipeline("tiny-cogvideox", "t2v")
    apply_offload(pipe, OffloadConfig("model", "cpu"))
    with pytest.raises(ValueError, match="before model offload"):
        apply_step_cache(pipe, StepCacheConfig("dbcache", 1.0, STEPS))
    pipe = build_tiny_pipeline("tiny-cogvideox", "t2v")
    h = apply_step_cache(pipe, StepCacheConfig("dbcache", 1.0, STEPS))
    apply_offload(pipe, OffloadConfig("model", "cpu"))
    for _ in range(2):
        h.refresh(STEPS)
        _run(pipe)
        assert h.stats()["skipped"] == STEPS - 1


def test_off_only_counts(tiny, cached):
    h = cached("tiny-wan", "off")
    np.testing.assert_array_equal(_run(tiny["tiny-wan"].pipe), tiny["tiny-wan"].off)
    assert h.stats() == {"evaluations": _total("tiny-wan"), "skipped": 0, "calls": 2 * STEPS}


def test_an_object_exposing_transformer_gets_dbcache(tiny, cached):
    """xfuser's CogVideoX wrapper is not a diffusers pipeline and never runs
    CogVideoXPipeline.__call__; the transformer-only cache works through it."""
    holder = SimpleNamespace(transformer=tiny["tiny-cogvideox"].pipe.transformer)
    h = cached("tiny-cogvideox", "dbcache", 1.0, target=holder)
    _run(tiny["tiny-cogvideox"].pipe)
    assert h.stats()["skipped"] == STEPS - 1
    with pytest.raises(ValueError, match="already has a step cache"):
        apply_step_cache(tiny["tiny-cogvideox"].pipe, StepCacheConfig("dbcache", 0.1, STEPS))


def test_fbcache_refusals(tiny, monkeypatch):
    holder = SimpleNamespace(transformer=tiny["tiny-wan"].pipe.transformer)
    with pytest.raises(ValueError, match="policy fbcache needs a diffusers pipeline"):
        apply_step_cache(holder, StepCacheConfig("fbcache", 0.1, STEPS))
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    with pytest.raises(ValueError, match="policy fbcache: FirstBlockCache decides per rank"):
        apply_step_cache(tiny["tiny-wan"].pipe, StepCacheConfig("fbcache", 0.1, STEPS))


def test_consisid_is_refused():
    from videojob_runtime.configs import build_component

    holder = SimpleNamespace(transformer=build_component("tiny-consisid", "transformer", "float32"))
    for policy in ("dbcache", "fbcache"):
        with pytest.raises(ValueError, match="ConsisID"):
            apply_step_cache(holder, StepCacheConfig(policy, 0.1, STEPS))


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "magic"}, "StepCacheConfig.policy must be one of"),
    ({"policy": "teacache"}, "teacache is teacache.apply_teacache"),
    ({"policy": "auto"}, "StepCacheConfig.policy 'auto'"),
    ({"policy": "dbcache", "threshold": -0.1}, "StepCacheConfig.threshold"),
    ({"policy": "dbcache", "threshold": float("nan")}, "StepCacheConfig.threshold"),
    ({"policy": "dbcache", "threshold": "0.1"}, "StepCacheConfig.threshold"),
    ({"policy": "dbcache", "num_inference_steps": 0}, "StepCacheConfig.num_inference_steps"),
    ({"policy": "fbcache", "warmup_steps": 2}, "StepCacheConfig.warmup_steps"),
    ({"policy": "dbcache", "warmup_steps": -1}, "StepCacheConfig.warmup_steps"),
])
def test_bad_config_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepCacheConfig(**kwargs)


def test_defaults():
    assert StepCacheConfig("dbcache").resolved_threshold() == 0.08
    assert StepCacheConfig("fbcache").resolved_threshold() == 0.05
    assert StepCacheConfig("off", 0.3).resolved_threshold() is None
    assert StepCacheConfig("dbcache", num_inference_steps=50).resolved_warmup() == 8
    assert StepCacheConfig("dbcache", num_inference_steps=8).resolved_warmup() == 1
    with pytest.raises(ValueError, match="apply_step_cache needs an object with a .transformer"):
        apply_step_cache(object(), StepCacheConfig("dbcache"))


def test_block_layouts_agree_with_the_catalog():
    """One fact, two readers: the catalog says which families call the denoiser
    once per CFG branch; the step cache's block layouts must say the same."""
    from videojob.catalog import CATALOG, Family
    from videojob_runtime.stepcache import _LAYOUTS

    block_of = {Family.COGVIDEOX: "CogVideoXBlock", Family.WAN: "WanTransformerBlock"}
    for model in CATALOG.values():
        if model.family in block_of:
            assert _LAYOUTS[block_of[model.family]].separate_cfg == (not model.cfg_batched), model.id


def test_parallel_pipelines_agree_with_the_catalog():
    """Every (model, task) the catalog allows on several GPUs has an xfuser wiring, and no other."""
    from videojob.catalog import CATALOG
    from videojob_runtime.pipelines import runs_parallel

    for model in CATALOG.values():
        for task in model.tasks:
            assert runs_parallel(model.id, task) == model.sequence_parallel, (model.id, task)


class _ForwardingWrapper(torch.nn.Module):
    """As xfuser's transformer wrappers: attributes it lacks come from the wrapped
    model, and its forward is its own (it calls the model's parts, not its forward)."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def forward(self, hidden_states):
        return (self.module.proj(hidden_states),)


def test_teacache_hooks_the_wrapper_not_the_wrapped_model():
    """After a job, diffusers' cache contexts have given the wrapped model a hook
    registry; the wrapper's attribute forwarding then offered that registry, the
    TeaCache hook wrapped a forward nobody calls, and the cache silently did
    nothing (found by benchmarks/stepcache_bench.py on xfuser's CogVideoX)."""
    from diffusers.hooks import HookRegistry

    from videojob_runtime.teacache import TeaCacheConfig, apply_teacache

    inner = torch.nn.Module()
    inner.proj = torch.nn.Linear(4, 4)
    HookRegistry.check_if_exists_or_initialize(inner)
    wrapper = _ForwardingWrapper(inner)
    handle = apply_teacache(wrapper, TeaCacheConfig(threshold=1e9))
    x = torch.randn(2, 4)
    for _ in range(4):
        wrapper(x)
    assert handle.stats() == {"calls": 4, "evaluations": 1, "skipped": 3}
    handle.remove()
    wrapper(x)
    assert handle.stats()["calls"] == 4
