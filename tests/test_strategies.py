"""Memory strategies on the tiny random-weight pipelines (real diffusers,
accelerate and transformers code; float32).

On a CPU every offload mode runs its real hooks with host and "device" the
same memory, so equality with ``none`` checks the hook plumbing, and the
onload tracker below checks what equality cannot: that every weight a module
uses was onloaded by a group when it ran (on a GPU a miss is a device-mismatch
error; on a CPU it would pass silently). With a GPU the same tests run on it.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from videojob_runtime.pipelines import build_tiny_pipeline
from videojob_runtime.strategies import (
    Fp8Config,
    OffloadConfig,
    TextEncoderConfig,
    VaeConfig,
    apply_fp8_storage,
    apply_offload,
    apply_vae,
    encode_and_release,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODELS = ("tiny-cogvideox", "tiny-wan")
PROMPT, NEGATIVE = "a cat walks on the grass", "blurry"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(pipe, steps: int = 2, **kwargs) -> np.ndarray:
    kw = dict(prompt=PROMPT, negative_prompt=NEGATIVE)
    kw.update(kwargs)
    out = pipe(height=64, width=64, num_frames=9, num_inference_steps=steps, max_sequence_length=16,
               output_type="np", generator=torch.Generator().manual_seed(0), **kw)
    return np.asarray(out.frames)


def _fresh(model: str, offload: str = "none"):
    pipe = build_tiny_pipeline(model, "t2v")
    apply_offload(pipe, OffloadConfig(offload, DEVICE))
    return pipe


@pytest.fixture(scope="module")
def reference():
    """Frames with everything resident on DEVICE (offload none), per model."""
    return {m: _run(_fresh(m)) for m in MODELS}


# ---------------------------------------------------------------- offload

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", ["model", "group", "sequential"])
def test_offload_mode_gives_the_frames_of_none(model, mode, reference):
    pipe = build_tiny_pipeline(model, "t2v")
    result = apply_offload(pipe, OffloadConfig(mode, DEVICE))
    assert result.mode == mode and set(result.components) == {"text_encoder", "transformer", "vae"}
    first = _run(pipe)
    assert first.shape == (1, 9, 64, 64, 3)
    assert np.abs(first - reference[model]).max() <= 1e-5
    # the hooks survive a call (diffusers re-arms model offload after each one)
    assert np.abs(_run(pipe) - reference[model]).max() <= 1e-5


def test_offload_result_says_what_was_applied():
    pipe = build_tiny_pipeline("tiny-cogvideox", "t2v")
    result = apply_offload(pipe, OffloadConfig("group", DEVICE))
    assert "block_level" in result.components["transformer"]
    assert "block_level" in result.components["text_encoder"]     # T5 blocks, via block_modules
    assert "leaf_level" in result.components["vae"]                # CogVideoX VAE: no block lists
    assert result.streams == (DEVICE != "cpu")
    if DEVICE == "cpu":
        assert any("streams" in n for n in result.notes)
    wan = build_tiny_pipeline("tiny-wan", "t2v")
    assert "block_level" in apply_offload(wan, OffloadConfig("group", DEVICE)).components["vae"]
    model = apply_offload(build_tiny_pipeline("tiny-wan", "t2v"), OffloadConfig("model", DEVICE))
    assert model.to_dict()["mode"] == "model" and "text_encoder -> transformer -> vae" in model.notes[0]


class OnloadTracker:
    """Records modules that ran while one of their own weights had not been
    onloaded by a diffusers group-offload group. Install before the offload
    hooks (so it runs inside them); ``close()`` restores ModuleGroup."""

    def __init__(self, pipe):
        from diffusers.hooks import group_offloading as go

        self._go, self._orig = go, (go.ModuleGroup.onload_, go.ModuleGroup.offload_)
        self.onloaded: set[int] = set()
        self.missed: set[str] = set()
        tracker = self

        def tensors(group):
            ts = [t for m in group.modules for t in [*m.parameters(), *m.buffers()]]
            return ts + list(group.parameters) + list(group.buffers)

        def onload_(group):
            tracker._orig[0](group)
            tracker.onloaded.update(id(t) for t in tensors(group))

        def offload_(group):
            tracker._orig[1](group)
            tracker.onloaded.difference_update(id(t) for t in tensors(group))

        go.ModuleGroup.onload_, go.ModuleGroup.offload_ = onload_, offload_
        for cname, comp in pipe.components.items():
            if not isinstance(comp, torch.nn.Module):
                continue
            for name, mod in comp.named_modules():
                own = [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]
                if own:
                    mod.forward = self._wrap(mod.forward, own, f"{cname}.{name}")

    def _wrap(self, forward, own, name):
        def checked(*args, **kwargs):
            if any(id(t) not in self.onloaded for t in own):
                self.missed.add(name)
            return forward(*args, **kwargs)
        return checked

    def close(self):
        self._go.ModuleGroup.onload_, self._go.ModuleGroup.offload_ = self._orig


@pytest.mark.parametrize("model", MODELS)
def test_group_offload_onloads_every_weight_a_module_uses(model, reference):
    pipe = build_tiny_pipeline(model, "t2v")
    tracker = OnloadTracker(pipe)
    try:
        apply_offload(pipe, OffloadConfig("group", DEVICE))
        frames = _run(pipe)
    finally:
        tracker.close()
    assert tracker.missed == set()
    assert np.abs(frames - reference[model]).max() <= 1e-5


def test_onload_tracker_catches_block_level_on_the_cogvideox_vae():
    """Why the CogVideoX VAE gets leaf-level groups: its decode never calls
    forward, so block-level's only group (hooked on forward) never onloads."""
    from diffusers.hooks import apply_group_offloading

    pipe = build_tiny_pipeline("tiny-cogvideox", "t2v")
    tracker = OnloadTracker(pipe)
    try:
        apply_group_offloading(pipe.vae, onload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1)
        _run(pipe, steps=1)
    finally:
        tracker.close()
    assert any(name.startswith("vae.decoder.") for name in tracker.missed)


def test_offload_reapply_same_is_a_noop_and_a_change_is_refused():
    pipe = build_tiny_pipeline("tiny-wan", "t2v")
    first = apply_offload(pipe, OffloadConfig("model", DEVICE))
    assert apply_offload(pipe, OffloadConfig("model", DEVICE)) is first
    with pytest.raises(ValueError, match="OffloadConfig.mode"):
        apply_offload(pipe, OffloadConfig("group", DEVICE))


@pytest.mark.parametrize("kwargs, field", [
    ({"mode": "disk"}, "mode"),
    ({"mode": "model", "device": "gpu-please"}, "device"),
    ({"mode": "model", "device": "meta"}, "device"),
    ({"mode": "group", "use_stream": "yes"}, "use_stream"),
])
def test_bad_offload_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"OffloadConfig.{field}"):
        OffloadConfig(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_offload_to_a_missing_device_is_refused_up_front():
    with pytest.raises(ValueError, match="OffloadConfig.device 'cuda'"):
        apply_offload(build_tiny_pipeline("tiny-wan", "t2v"), OffloadConfig("model", "cuda"))


# -------------------------------------------------------------------- vae

class _Spy:
    """Counts calls of one method on one object."""

    def __init__(self, obj, name):
        self.calls, orig = 0, getattr(obj, name)

        def spy(*args, **kwargs):
            self.calls += 1
            return orig(*args, **kwargs)
        setattr(obj, name, spy)


@pytest.mark.parametrize("model", MODELS)
def test_vae_tiling_engages_and_switches_off_again(model, reference):
    pipe = _fresh(model)
    vae = pipe.vae
    # 32-pixel tiles: a 64x64 video decodes as overlapping tiles
    vae.tile_sample_min_height = vae.tile_sample_min_width = 32
    if hasattr(vae, "tile_sample_stride_height"):  # Wan: explicit stride
        vae.tile_sample_stride_height = vae.tile_sample_stride_width = 24
    tiled = _Spy(vae, "tiled_decode")
    result = apply_vae(pipe, VaeConfig(tiling=True))
    assert result.tiling and result.tile_sample_min == (32, 32)
    frames = _run(pipe)
    assert tiled.calls == 1
    assert frames.shape == (1, 9, 64, 64, 3)
    # Seams differ (random-weight decoder, tiny tiles): measured mean |diff|
    # 0.025 (CogVideoX) and 0.026 (Wan); an unrelated video is ~0.2 away.
    assert np.isfinite(frames).all() and np.abs(frames - reference[model]).mean() < 0.08
    # a warm pipeline switches back: no tiles, the untiled frames exactly
    assert apply_vae(pipe, VaeConfig()).tiling is False
    assert np.array_equal(_run(pipe), reference[model])
    assert tiled.calls == 1


def test_cogvideox_tile_overlap_is_made_exact():
    """With its default factors (1/6, 1/5) and the tiny model's 24x32 tiles,
    diffusers decodes 64x64 to 76x70; apply_vae picks factors that tile exactly."""
    pipe = _fresh("tiny-cogvideox")
    result = apply_vae(pipe, VaeConfig(tiling=True))
    assert result.tile_sample_min == (24, 32)
    assert result.tile_overlap == (1 / 3, 1 / 4)
    assert _run(pipe, steps=1).shape == (1, 9, 64, 64, 3)


@pytest.mark.parametrize("model", MODELS)
def test_vae_slicing_decodes_one_video_at_a_time(model):
    pipe = _fresh(model)
    two = dict(prompt=[PROMPT, "a dog"], negative_prompt=[NEGATIVE, NEGATIVE])
    whole = _run(pipe, **two)
    decodes = _Spy(pipe.vae, "_decode")
    assert apply_vae(pipe, VaeConfig(slicing=True)).slicing
    sliced = _run(pipe, **two)
    assert decodes.calls == 2 and sliced.shape == (2, 9, 64, 64, 3)
    assert np.abs(sliced - whole).max() <= 1e-5


def test_bad_vae_config_names_the_field():
    with pytest.raises(ValueError, match="VaeConfig.tiling"):
        VaeConfig(tiling="yes")
    with pytest.raises(ValueError, match="VaeConfig.slicing"):
        VaeConfig(slicing=1)
    pipe = _fresh("tiny-cogvideox")
    pipe.vae.tile_sample_min_height = 30  # not a multiple of 8: cannot tile exactly
    with pytest.raises(ValueError, match="VaeConfig.tiling"):
        apply_vae(pipe, VaeConfig(tiling=True))


# -------------------------------------------------------------------- fp8

@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("storage", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_storage_runs_and_stays_finite(model, storage, reference):
    pipe = _fresh(model)
    result = apply_fp8_storage(pipe.transformer, Fp8Config(True, storage), "float32")
    dtypes = {p.dtype for p in pipe.transformer.parameters()}
    assert getattr(torch, storage) in dtypes and result.float8_params > 0
    assert result.full_params > 0          # patch embedding and norms stay float32
    frames = _run(pipe)
    assert frames.shape == (1, 9, 64, 64, 3) and np.isfinite(frames).all()
    # quantised weights move the output a little (measured <= 0.02 for e4m3)
    assert np.abs(frames - reference[model]).max() < 0.25
    # applying the same again is a no-op; turning it off is impossible
    assert apply_fp8_storage(pipe.transformer, Fp8Config(True, storage), torch.float32).enabled
    with pytest.raises(ValueError, match="Fp8Config.enabled"):
        apply_fp8_storage(pipe.transformer, Fp8Config(False), torch.float32)


def test_bad_fp8_config_names_the_field():
    with pytest.raises(ValueError, match="Fp8Config.storage_dtype"):
        Fp8Config(True, "int8")
    with pytest.raises(ValueError, match="Fp8Config.enabled"):
        Fp8Config("on")
    with pytest.raises(ValueError, match="compute_dtype"):
        apply_fp8_storage(torch.nn.Linear(2, 2), Fp8Config(True), "float64")
    assert apply_fp8_storage(torch.nn.Linear(2, 2), Fp8Config(False), "float32").enabled is False


# ------------------------------------------------------------ text encoder

@pytest.mark.parametrize("model, offload", [("tiny-cogvideox", "none"), ("tiny-wan", "none"),
                                            ("tiny-cogvideox", "model"), ("tiny-wan", "group")])
def test_encode_then_drop_gives_identical_frames_and_frees_the_encoder(model, offload, reference):
    pipe = _fresh(model, offload)
    encoder = weakref.ref(pipe.text_encoder)
    embeds = encode_and_release(pipe, TextEncoderConfig("drop"), PROMPT, NEGATIVE, max_sequence_length=16)
    assert embeds.released == {"text_encoder": "dropped from the pipeline"}
    assert pipe.text_encoder is None
    gc.collect()
    assert encoder() is None, "something still holds the text encoder"
    frames = _run(pipe, prompt=None, negative_prompt=None, **embeds.pipeline_kwargs())
    np.testing.assert_array_equal(frames, reference[model])
    with pytest.raises(RuntimeError, match="no text encoder"):
        encode_and_release(pipe, TextEncoderConfig(), PROMPT)


@pytest.mark.parametrize("model", MODELS)
def test_encode_then_move_to_cpu_keeps_it_for_the_next_job(model, reference):
    pipe = _fresh(model)
    before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    embeds = encode_and_release(pipe, TextEncoderConfig("cpu"), PROMPT, NEGATIVE, max_sequence_length=16)
    assert embeds.released == {"text_encoder": "moved to cpu"}
    assert {p.device.type for p in pipe.text_encoder.parameters()} == {"cpu"}
    if DEVICE == "cuda":
        assert torch.cuda.memory_allocated() < before
    frames = _run(pipe, prompt=None, negative_prompt=None, **embeds.pipeline_kwargs())
    np.testing.assert_array_equal(frames, reference[model])


def test_release_under_offload_hooks_is_a_noop():
    pipe = _fresh("tiny-wan", "sequential")
    embeds = encode_and_release(pipe, TextEncoderConfig("cpu"), PROMPT, max_sequence_length=16)
    assert "already on the host" in embeds.released["text_encoder"]
    keep = encode_and_release(pipe, TextEncoderConfig("keep"), PROMPT, max_sequence_length=16)
    assert keep.released == {"text_encoder": "kept"} and pipe.text_encoder is not None


def test_bad_text_encoder_config_names_the_field():
    with pytest.raises(ValueError, match="TextEncoderConfig.release"):
        TextEncoderConfig("gpu")


# ---------------------------------------------------------------- VAE unread conv cache

def test_skipping_the_unread_conv_cache_is_bit_identical_and_lowers_the_decode_peak(reference):
    from videojob_runtime.profiling import stages
    from videojob_runtime.strategies import VaeConvCacheConfig, apply_vae_conv_cache

    pipe = _fresh("tiny-cogvideox")
    result = apply_vae_conv_cache(pipe.vae, VaeConvCacheConfig(skip_unread=True))
    assert result.applicable and result.skipping > 0
    assert np.array_equal(_run(pipe), reference["tiny-cogvideox"])
    for tiling in (False, True):  # and the same with tiles
        apply_vae(pipe, VaeConfig(tiling=tiling))
        skipped = _run(pipe, steps=1)
        apply_vae_conv_cache(pipe.vae, VaeConvCacheConfig(skip_unread=False))
        assert np.array_equal(skipped, _run(pipe, steps=1)), tiling
        apply_vae_conv_cache(pipe.vae, VaeConvCacheConfig(skip_unread=True))
    # The decode's live bytes, measured on the real tiny VAE (not fake tensors).
    torch.manual_seed(0)
    from videojob_runtime.configs import build_component

    peaks = {}
    for skip in (False, True):
        vae = build_component("tiny-cogvideox", "vae", "float32")
        apply_vae_conv_cache(vae, VaeConvCacheConfig(skip_unread=skip))
        inputs, call = stages._decode_call("tiny-cogvideox", vae, 64, 64, 9, "float32")
        peaks[skip], _ = stages._measure(vae, inputs, call)
    assert peaks[True] < 0.9 * peaks[False]
    profiled = stages.profile_decode("tiny-cogvideox", 64, 64, 9, "float32", skip_unread_conv_cache=True)
    assert profiled["activation_peak_bytes"] == peaks[True]


def test_vae_conv_cache_leaves_other_vaes_alone_and_names_the_field():
    from videojob_runtime.strategies import VaeConvCacheConfig, apply_vae_conv_cache

    wan = build_tiny_pipeline("tiny-wan", "t2v")
    result = apply_vae_conv_cache(wan.vae, VaeConvCacheConfig())
    assert not result.applicable and result.skipping == 0
    with pytest.raises(ValueError, match="VaeConvCacheConfig.skip_unread"):
        VaeConvCacheConfig(skip_unread="yes")
    with pytest.raises(ValueError, match="VaeConvCacheConfig"):
        apply_vae_conv_cache(wan, VaeConvCacheConfig())  # the pipeline, not its vae


# ---------------------------------------------------------------- decode offload

def _job(**kw):
    from videojob_runtime.request import JobRequest

    base = dict(job_id="d", model_id="tiny-cogvideox", task="t2v", prompt=PROMPT, negative_prompt=NEGATIVE,
                width=64, height=64, frames=9, fps=8, steps=2, guidance=6.0, seed=3, frames_dtype="float32",
                track_memory=False)
    return JobRequest(**{**base, **kw})


@pytest.mark.parametrize("model", MODELS)
def test_decode_offload_moves_the_denoiser_between_the_last_step_and_the_decode(model):
    """Through the worker: the denoiser goes to the host after its last call and
    before vae.decode, comes back before the next job's first call, and the
    frames are those of a job without it."""
    from videojob_runtime.pipelines import denoiser, inner_pipeline
    from videojob_runtime.worker import RankWorker

    worker = RankWorker(0, 1)
    plain = worker.run(_job(model_id=model, job_id="plain"))
    assert plain["ok"] and plain["decode_offload"] is None  # never armed: nothing installed
    log: list[tuple[str, str]] = []
    inner = inner_pipeline(worker.pipe)
    transformer = denoiser(worker.pipe)
    move = transformer.to

    def to(*args, **kwargs):
        log.append(("to", str(torch.device(args[0] if args else kwargs["device"]))))
        return move(*args, **kwargs)

    transformer.to = to
    transformer.register_forward_pre_hook(
        lambda mod, args: log.append(("forward", str(next(mod.parameters()).device))))
    decode = inner.vae.decode
    inner.vae.decode = lambda *a, **k: (log.append(("decode", "")), decode(*a, **k))[1]

    moved = worker.run(_job(model_id=model, job_id="moved", decode_offload=True))
    assert moved["ok"] and moved["decode_offload"]["parked"] and moved["reused"]
    assert moved["frames_digest"] == plain["frames_digest"]
    assert np.array_equal(moved["frames"], plain["frames"])
    kinds = [k for k, _ in log]
    park = kinds.index("to")
    assert ("to", "cpu") == log[park]
    assert "forward" in kinds[:park] and "forward" not in kinds[park:]  # after the last denoiser call
    assert kinds[park + 1] == "decode"  # right before the decode
    assert all(p.device.type == "cpu" for p in transformer.parameters())  # on the host (here: the CPU)
    state = getattr(inner, "_videojob_decode_offload")
    assert [e for e, _ in state.events] == ["decode", "park"]

    log.clear()
    again = worker.run(_job(model_id=model, job_id="after"))  # the next job, without the offload
    assert again["ok"] and again["frames_digest"] == plain["frames_digest"]
    kinds = [k for k, _ in log]
    assert kinds[0] == "to" and log[0] == ("to", DEVICE) and kinds.index("forward") > 0  # back before denoising
    assert "to" not in kinds[1:]  # and not moved again: this job did not ask for it
    assert [e for e, _ in state.events][-2:] == ["restore", "decode"]
    assert again["decode_offload"]["restoreSeconds"] >= 0 and not again["decode_offload"]["parked"]


def test_decode_offload_refuses_offload_hooks_and_names_the_field():
    from videojob_runtime.pipelines import denoiser
    from videojob_runtime.request import JobRequest
    from videojob_runtime.strategies import DecodeOffloadConfig, apply_decode_offload

    with pytest.raises(ValueError, match="JobRequest.decode_offload"):
        _job(decode_offload=True, offload="model")
    with pytest.raises(ValueError, match="DecodeOffloadConfig.enabled"):
        DecodeOffloadConfig(enabled="yes")
    with pytest.raises(ValueError, match="DecodeOffloadConfig.host"):
        DecodeOffloadConfig(enabled=True, host="cuda")
    pipe = build_tiny_pipeline("tiny-cogvideox", "t2v")
    with pytest.raises(ValueError, match="DecodeOffloadConfig.enabled"):
        apply_decode_offload(pipe, denoiser(pipe), DecodeOffloadConfig(enabled=True), "cpu", offload="group")
    assert JobRequest.from_dict(_job(decode_offload=True).to_dict()).decode_offload is True


def test_catalog_decoding_ranks_match_how_the_runtime_runs_each_family():
    """xfuser's pipeline wrappers decode on the last rank only; the plain
    diffusers pipeline (Wan, with xfuser's transformer) decodes on every rank."""
    from videojob.catalog import CATALOG
    from videojob_runtime.pipelines import _PARALLEL

    for model in CATALOG.values():
        if not model.sequence_parallel:
            continue
        kind, _ = _PARALLEL[(model.family, model.tasks[0])]
        assert model.decoding_ranks == ("last" if kind == "wrapper" else "all"), model.id
