"""The calibration table the planner reads (operator/videojob/planner/calibration.json).

For every catalog model: the weights of each component in three dtypes (no
forward needed) and a set of measured activation peaks (encode, denoise,
decode) at the model's native size and at smaller sizes / batches, so the
planner can fit activations linearly in tokens and batch. Every number comes
from running the real module at full size under FakeTensorMode (see
``stages``); nothing is allocated, no GPU is used.

Then the table's ``constants``: every constant the planner's memory and
latency models use, with its provenance, fitted to the published figures
(``videojob.planner.fit``, ``videojob.planner.anchors``) against the profile
just measured, or assumed with the reason written down.

Each model entry records when it was profiled and how long it took
(``profiled``); ``environment.profiling_seconds`` is their sum, so merging a
subset (``--models``) keeps the other models' records.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

from ..configs import component_configs
from . import stages

__all__ = ["SCHEMA", "METHOD", "sample_plan", "profile_model", "component_table",
           "environment", "write_calibration"]

SCHEMA = 2  # the planner's calibration.SCHEMA: 2 added constants, fp8 bytes, skip and two-call samples
METHOD = (
    "Each component is built at full size from its published config with random weights under "
    "torch FakeTensorMode on the fake CPU device (no memory allocated), the exact inputs the "
    "diffusers pipeline passes are built, and the forward runs under no_grad inside a "
    "TorchDispatchMode that adds the bytes of every new tensor storage and subtracts them when "
    "the storage dies (weakref finalizer); activation_peak_bytes is the high-water mark of those "
    "live bytes, weights and pre-built inputs excluded, outputs included, with SDPA routed to the "
    "flash kernel (output + fp32 logsumexp, no seq x seq matrix)."
)
NOTES = [
    "Bytes are exact tensor-storage bytes; not included: CUDA context (~0.5 GiB), allocator "
    "rounding/fragmentation, cuDNN/cuBLAS workspaces (the VAE decode's conv workspace showed as a "
    "~3.9 GiB gap against published CogVideoX-2b figures, see DESIGN.md).",
    "denoise batch 2 = one prompt with classifier-free guidance in one call (CogVideoX, ConsisID, "
    "I2VGen-XL, AnimateDiff pipelines); WanPipeline calls the transformer twice at batch 1: its "
    "'calls': 2 sample is one step as the pipeline runs it, the first call's output alive during the second.",
    "decode 'skip_unread_conv_cache': true = with the runtime's strategies/vae_conv_cache.py (CogVideoX-family "
    "VAEs: the kernel-1 causal convs no longer clone their input into a cache that is never read; "
    "bit-identical frames). Models without such convs have no such samples.",
    "fp8_weight_bytes (denoisers): the weights under the runtime's fp8 storage (strategies/fp8.py: diffusers "
    "layerwise casting to float8 with the model's skip patterns), counted from the layers it casts.",
    "latent_tokens: transformer patch tokens of the video (text excluded); for the UNets "
    "(i2vgen-xl, animatediff) latent pixels frames x (H/8) x (W/8).",
    "CogVideoX 1.5: text_tokens 226 (the diffusers pipeline's max_sequence_length default; the "
    "model card's 224-token prompt limit does not change the padded length); latent frames are "
    "padded to a multiple of patch_size_t=2 for denoise and stripped before decode.",
    "decode: the pipeline's own decode step (CogVideoX decode_latents, Wan latents_mean/std "
    "un-normalisation, I2VGen-XL decode_chunk_size=1, AnimateDiff decode_chunk_size=16); "
    "tiling = vae.enable_tiling() with its default tile sizes (it does not engage where the video "
    "is not larger than one tile, e.g. AnimateDiff 512x512).",
    "Component extras: buffer_bytes (non-parameter buffers, e.g. CogVideoX-2b's float64 sincos "
    "table), group_offload_unmatched_bytes (weights outside the repeated blocks, onloaded for the "
    "whole forward under block-level group offload), group_offload_block_modules (the "
    "block_modules to pass to enable_group_offload to get num_blocks groups), fp32_params "
    "(parameters kept in float32 when loaded in that dtype: T5/UMT5 'wo' in float16, Wan norms "
    "and time embedder).",
    "Tiny models are profiled in float32 (the CPU runtime's dtype).",
    "stage image_encode (not part of the schema's encode/denoise/decode): the conditioning image "
    "through the VAE encoder (I2V and identity models, one frame at the native size) and through "
    "the CLIP image encoder (I2VGen-XL); the VAE weights are resident then, not the text encoder.",
]

Progress = Callable[[str], None]


def environment() -> dict:
    import diffusers
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "generated": _now(),
    }


def _native(model_id: str) -> tuple[int, int, int]:
    from videojob.catalog import get_model

    info = get_model(model_id)
    return info.native_width, info.native_height, info.native_frames


def half_frames(model_id: str) -> int:
    """A valid frame count of about half the native one (smaller than native)."""
    from videojob.catalog import get_model

    info = get_model(model_id)
    native = info.native_frames
    candidates = [n for n in range(info.frames.minimum, native) if info.frames.accepts(n)]
    if not candidates:
        return native
    return min(candidates, key=lambda n: (abs(n - native / 2), n))


def sample_plan(model_id: str) -> list[tuple[str, Callable[[], dict]]]:
    """(label, thunk) for every sample of a model."""
    from videojob.catalog import get_model

    info = get_model(model_id)
    w, h, f = _native(model_id)
    half = half_frames(model_id)
    comps = component_configs(model_id)
    big = "float32" if info.tiny else "bfloat16"
    enc_dtypes = ("float32",) if info.tiny else ("bfloat16", "float16")
    plan: list[tuple[str, Callable[[], dict]]] = []
    for dt in enc_dtypes:
        plan.append((f"encode text_encoder {dt}", lambda dt=dt: stages.profile_encode(model_id, dt, 1)))
    if "image_encoder" in comps:
        plan.append((f"image_encode image_encoder {big}",
                     lambda: stages.profile_image_encode(model_id, big, 1)))
    if set(info.tasks) & {"i2v", "identity"}:
        plan.append((f"image_encode vae {w}x{h} {big}", lambda: stages.profile_vae_encode(model_id, w, h, big)))
    for frames, batch in ((f, 2), (f, 1), (half, 2)):
        plan.append((f"denoise {w}x{h}x{frames} b{batch} {big}",
                     lambda frames=frames, batch=batch: stages.profile_denoise(
                         model_id, w, h, frames, batch, big)))
    if info.denoiser_calls_per_step(info.default_guidance) == 2:
        plan.append((f"denoise {w}x{h}x{f} b1 x2 calls {big}",
                     lambda: stages.profile_denoise(model_id, w, h, f, 1, big, calls=2)))
    skips = (False, True) if stages.skips_unread_conv_cache(model_id) else (False,)
    for skip in skips:
        for frames, tiling in ((f, False), (f, True), (half, False)):
            label = f"decode {w}x{h}x{frames}{' tiled' if tiling else ''}{' skip-unread-cache' if skip else ''} {big}"
            plan.append((label, lambda frames=frames, tiling=tiling, skip=skip: stages.profile_decode(
                model_id, w, h, frames, big, tiling, skip_unread_conv_cache=skip)))
    return plan


def component_table(model_id: str, progress: Progress | None = None) -> dict:
    out: dict[str, dict] = {}
    for name, comp in component_configs(model_id).items():
        t0 = time.perf_counter()
        per = {dt: stages.component_stats(model_id, name, dt) for dt in stages.DTYPES}
        first = per["bfloat16"]
        entry = {
            "class": comp.class_name,
            "source": comp.source,
            "params": first["params"],
            "num_blocks": first["num_blocks"],
            "weight_bytes": {dt: per[dt]["weight_bytes"] for dt in stages.DTYPES},
            "largest_leaf_bytes": {dt: per[dt]["largest_leaf_bytes"] for dt in stages.DTYPES},
            "largest_block_bytes": {dt: per[dt]["largest_block_bytes"] for dt in stages.DTYPES},
            "buffer_bytes": {dt: per[dt]["buffer_bytes"] for dt in stages.DTYPES},
            "group_offload_unmatched_bytes": {
                dt: per[dt]["group_offload_unmatched_bytes"] for dt in stages.DTYPES},
            "group_offload_block_modules": first["group_offload_block_modules"],
            "fp32_params": {dt: per[dt]["fp32_params"] for dt in stages.DTYPES},
        }
        if "fp8_weight_bytes" in first:
            entry["fp8_weight_bytes"] = {dt: per[dt]["fp8_weight_bytes"] for dt in stages.DTYPES}
        if comp.notes:
            entry["notes"] = list(comp.notes)
        out[name] = entry
        if progress:
            gib = entry["weight_bytes"]["bfloat16"] / 2**30
            progress(f"  {model_id} weights {name}: {entry['params'] / 1e9:.3f}B params, "
                     f"{gib:.2f} GiB bf16 ({time.perf_counter() - t0:.1f}s)")
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def profile_model(model_id: str, progress: Progress | None = None) -> dict:
    """Components and samples of one model (raises on the first failure)."""
    start = time.perf_counter()
    components = component_table(model_id, progress)
    samples = []
    for label, thunk in sample_plan(model_id):
        s = thunk()
        samples.append(s)
        if progress:
            progress(f"  {model_id} {label}: {s['activation_peak_bytes'] / 2**30:.3f} GiB "
                     f"({s['seconds']:.1f}s)")
    env = environment()
    profiled = {"at": _now(), "seconds": round(time.perf_counter() - start, 1),
                **{k: env[k] for k in ("torch", "diffusers", "transformers")}}
    return {"components": components, "samples": samples, "profiled": profiled}


def write_calibration(path: str | os.PathLike, models: Iterable[str] | None = None,
                      progress: Progress | None = print, merge: bool | None = None) -> dict:
    """Profile ``models`` (default: every catalog model) and write the table.

    With a model subset and an existing file, the other models' entries are
    kept (``merge`` defaults to True exactly then). A model that fails is
    left out of ``models`` and listed in ``missing`` with the reason.
    """
    from videojob.catalog import MODEL_IDS

    ids = list(models) if models is not None else list(MODEL_IDS)
    unknown = [m for m in ids if m not in MODEL_IDS]
    if unknown:
        raise KeyError(f"unknown model ids: {', '.join(unknown)}")
    path = Path(path)
    if merge is None:
        merge = models is not None and path.exists()
    table: dict = {"schema": SCHEMA, "environment": environment(), "method": METHOD,
                   "notes": NOTES, "models": {}, "missing": {}}
    old: dict = {}
    if merge and path.exists():
        old = json.loads(path.read_text())
        if old.get("schema") == SCHEMA:  # an older schema's entries lack what this one measures
            table["models"].update(old.get("models", {}))
            table["missing"].update(old.get("missing", {}))
    t_all = time.perf_counter()
    for mid in ids:
        t0 = time.perf_counter()
        if progress:
            progress(f"{mid}:")
        try:
            table["models"][mid] = profile_model(mid, progress)
            table["missing"].pop(mid, None)
        except Exception as exc:  # noqa: BLE001 - recorded, not hidden
            table["models"].pop(mid, None)
            reason = f"{type(exc).__name__}: {exc}".strip()
            table["missing"][mid] = reason[:500]
            if progress:
                progress(f"  {mid} FAILED: {reason[:300]}")
                progress(traceback.format_exc(limit=3))
        if progress:
            progress(f"  {mid} done in {time.perf_counter() - t0:.1f}s")
    total = time.perf_counter() - t_all
    # Catalog order, so diffs stay small.
    table["models"] = {m: table["models"][m] for m in MODEL_IDS if m in table["models"]}
    # Over every model in the table (a merge keeps the others' records): what
    # re-profiling all of it takes, and what this run did.
    table["environment"]["profiling_seconds"] = round(
        sum(m.get("profiled", {}).get("seconds", 0.0) for m in table["models"].values()), 1)
    table["environment"]["this_run"] = {"models": ids, "seconds": round(total, 1), "merged": bool(merge)}
    if not table["missing"]:
        del table["missing"]
    table["constants"] = _constants(table["models"], old, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
    if progress:
        progress(f"wrote {path} ({len(table['models'])} models) in {total:.1f}s")
    return table


def _constants(models: dict, old: dict, progress: Progress | None) -> dict:
    """The planner's constants for this table: fitted here, or carried over
    (from the merged file, else the checked-in table) where the table lacks
    the model a figure is about."""
    from videojob.planner.calibration import CALIBRATION_FILE
    from videojob.planner.fit import calibrated_constants

    carried = old.get("constants")
    if carried is None and CALIBRATION_FILE.exists():
        checked_in = json.loads(CALIBRATION_FILE.read_text())
        carried = checked_in.get("constants")
    constants = calibrated_constants(models, carried)
    if progress:
        for name, entry in constants.items():
            if entry["kind"] == "fitted":
                progress(f"  constant {name} = {entry['value']!r} ({entry['provenance'][:100]}...)")
    return constants


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m videojob_runtime.profiling",
        description="Profile every catalog model symbolically and write the planner's calibration table.")
    ap.add_argument("--out", required=True, help="output JSON path")
    ap.add_argument("--models", default=None, help="comma-separated model ids (default: all)")
    ap.add_argument("--no-merge", action="store_true",
                    help="with --models, do not keep the other models of an existing file")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    table = write_calibration(args.out, models, progress=lambda s: print(s, flush=True),
                              merge=False if args.no_merge else None)
    return 1 if table.get("missing") and models is not None and any(
        m in table["missing"] for m in models) else 0


if __name__ == "__main__":
    sys.exit(main())
