"""The calibration table the planner reads (operator/videojob/planner/calibration.json).

For every catalog model: the weights of each component in three dtypes (no
forward needed) and a set of measured activation peaks (encode, denoise,
decode) at the model's native size and at smaller sizes / batches, so the
planner can fit activations linearly in tokens and batch. Every number comes
from running the real module at full size under FakeTensorMode (see
``stages``); nothing is allocated, no GPU is used.
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

SCHEMA = 1
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
    "I2VGen-XL, AnimateDiff pipelines); WanPipeline calls the transformer twice at batch 1.",
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
        "generated": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
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
    for frames, tiling in ((f, False), (f, True), (half, False)):
        plan.append((f"decode {w}x{h}x{frames}{' tiled' if tiling else ''} {big}",
                     lambda frames=frames, tiling=tiling: stages.profile_decode(
                         model_id, w, h, frames, big, tiling)))
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
        if comp.notes:
            entry["notes"] = list(comp.notes)
        out[name] = entry
        if progress:
            gib = entry["weight_bytes"]["bfloat16"] / 2**30
            progress(f"  {model_id} weights {name}: {entry['params'] / 1e9:.3f}B params, "
                     f"{gib:.2f} GiB bf16 ({time.perf_counter() - t0:.1f}s)")
    return out


def profile_model(model_id: str, progress: Progress | None = None) -> dict:
    """Components and samples of one model (raises on the first failure)."""
    components = component_table(model_id, progress)
    samples = []
    for label, thunk in sample_plan(model_id):
        s = thunk()
        samples.append(s)
        if progress:
            progress(f"  {model_id} {label}: {s['activation_peak_bytes'] / 2**30:.3f} GiB "
                     f"({s['seconds']:.1f}s)")
    return {"components": components, "samples": samples}


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
    if merge and path.exists():
        old = json.loads(path.read_text())
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
    table["environment"]["profiling_seconds"] = round(total, 1)
    # Catalog order, so diffs stay small.
    table["models"] = {m: table["models"][m] for m in MODEL_IDS if m in table["models"]}
    if not table["missing"]:
        del table["missing"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
    if progress:
        progress(f"wrote {path} ({len(table['models'])} models) in {total:.1f}s")
    return table


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
