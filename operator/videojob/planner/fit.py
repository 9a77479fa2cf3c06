"""The calibrated constants of calibration.json: fitted, measured or assumed, each with its provenance.

``videojob profile`` (``make calibrate``) calls :func:`calibrated_constants`
after profiling, so the table it writes carries, for every constant the
memory and latency models use, its value and where it came from:

* fitted: solved here from published figures (``anchors.py``, the in-sample
  ones) and the profile just measured; refitting is rerunning the command.
* assumed: a value nobody here measured, with the reason for it (``ASSUMED``
  is the one place these numbers are written).
* counted: read off the code it describes.

Pure Python (no torch): the planner and the tests can refit and compare.
"""

from __future__ import annotations

from typing import Any

from ..catalog import get_model
from .anchors import LATENCY_JOB, MemoryAnchor, latency_anchor, memory_anchor
from .calibration import Constants, parse_models

GiB = 1024**3
PROFILE_COMMAND = "videojob profile --out operator/videojob/planner/calibration.json (make calibrate)"


def _entry(value: Any, unit: str, kind: str, provenance: str, **extra: Any) -> dict[str, Any]:
    return {"value": value, "unit": unit, "kind": kind, "provenance": provenance, **extra}


# Values nobody here has measured (no GPU in this project's CI). The GPU check
# (make gpu-check) measures peaks and s/step on a GPU to replace them.
ASSUMED: dict[str, dict[str, Any]] = {
    "cuda_context_bytes": _entry(
        int(0.5 * GiB), "bytes", "assumed",
        "CUDA context per process, seen by nvidia-smi and OOMs, not by max_memory_allocated: ~0.5 GiB "
        "(DESIGN.md, 'The memory planner'); not measured here (no GPU)."),
    "fragmentation": _entry(
        0.05, "fraction of the peak", "assumed",
        "caching-allocator reserve above allocated: a planning margin. The ConsisID diffusers table shows "
        "reserved 7-50% above allocated (37 -> 44 GB untiled); the margin is not fitted to it."),
    "cache_residuals": _entry(
        {"off": 0, "teacache": 1, "fbcache": 3, "dbcache": 3}, "hidden-state tensors per sequence", "counted",
        "residuals a step cache keeps between steps: FBCache/DBCache the first block's residual and the "
        "cached output residuals of the video and text streams (runtime/videojob_runtime/stepcache.py, "
        "cache-dit), TeaCache one residual (runtime/videojob_runtime/teacache.py)."),
    "process_host_bytes": _entry(
        3 * GiB, "bytes", "assumed",
        "host RAM of a runtime process besides weights (torch, CUDA libraries, the Ray worker); not measured."),
    "group_offload_host_factor": _entry(
        2.0, "x weights", "assumed",
        "group offload with CUDA streams keeps pinned host copies: about 2x the weights in host RAM "
        "(DESIGN.md, from the diffusers group-offloading docs); not measured here."),
    "pcie_bytes_per_s": _entry(20e9, "bytes/s", "assumed", "host<->GPU over PCIe 4 x16, pinned, effective."),
    "model_offload_bytes_per_s": _entry(
        10e9, "bytes/s", "assumed",
        "whole-module .to() between host and GPU from pageable memory (model offload, decode offload): about "
        "half the pinned bandwidth, each way."),
    "sequential_efficiency": _entry(
        0.4, "fraction of PCIe", "assumed", "leaf-level offload copies synchronously from unpinned memory."),
    "group_offload_overhead": _entry(
        0.08, "fraction of step time", "assumed", "block-level offload with streams: the copies mostly overlap."),
    "disk_bytes_per_s": _entry(1.5e9, "bytes/s", "assumed",
                               "weight loading from a local volume; denoising checkpoints are written at it too."),
    "checkpoint_latent_copies": _entry(
        3, "latent-sized tensors per checkpoint", "counted",
        "a denoising checkpoint holds the whole latents plus the solver's history: at most two more "
        "latent-sized tensors (DPM/UniPC multistep outputs, CogVideoX DPM's old_pred_original_sample; DDIM "
        "and flow Euler none): runtime/videojob_runtime/resume.py. An upper bound."),
    "decode_s_per_pixel_frame": _entry(
        10.0 / (49 * 720 * 480), "s per output pixel-frame (A100)", "assumed",
        "a CogVideoX decode of 49x720x480 takes on the order of 10 s on an A100; rough, for ranking only."),
    "tiling_slowdown": _entry(1.15, "x decode time", "assumed", "tiled decode recomputes the tile overlaps."),
    "encode_seconds": _entry(0.5, "s", "assumed", "a T5/UMT5 prompt encode on a datacenter GPU."),
    "cache_evaluated_fraction": _entry(
        {"off": 1.0, "teacache": 0.6, "fbcache": 0.65, "dbcache": 0.65}, "fraction of denoiser calls",
        "assumed",
        "share of denoiser calls a step cache evaluates at its default threshold; informed by TeaCache's "
        "published speedups (ConsisID 110 -> 70 s at 0.1: 0.64; Wan2.1-1.3B 175 -> 88 s: 0.50; DESIGN.md), "
        "not fitted."),
}

# Filled in by the fits below; the other GPU kinds are assumed.
_GPU_SPEED_ASSUMED = {"h100": 2.2, "h200": 2.3, "generic": 1.0}


def provisional_constants(**values: Any) -> Constants:
    """Constants with the assumed values and neutral fitted ones (the fits start from these)."""
    table = {name: dict(entry) for name, entry in ASSUMED.items()}
    neutral = {"conv_workspace_bytes_per_pixel": 0.0, "a100_flops_per_s": 1.0,
               "gpu_speed": {"a100": 1.0, "l40": 1.0, **_GPU_SPEED_ASSUMED},
               "ulysses_overhead": 0.0, "ring_overhead": 0.0, "cfg_overhead": 0.0}
    for name, value in {**neutral, **values}.items():
        table[name] = _entry(value, "", "fitted", "provisional (being fitted)")
    return Constants.from_table(table)


def _anchor_estimate(models: dict[str, Any], anchor: MemoryAnchor, constants: Constants) -> float:
    from .memory import Job, MemoryModel

    cal = parse_models({anchor.model: models[anchor.model]}, constants)[anchor.model]
    model = get_model(anchor.model)
    job = Job(model, anchor.width, anchor.height, anchor.frames, model.default_steps, model.default_guidance,
              anchor.dtype)
    return anchor_peak(MemoryModel(cal, job), anchor)


def anchor_peak(memory_model, anchor: MemoryAnchor) -> float:
    """The planner's peak for an anchor, over the stages its source ran on the GPU."""
    est = memory_model.estimate(anchor.layout)
    stages = anchor.gpu_stages or tuple(est.stages)
    return max(est.stage_total(s) for s in stages)


def fit_conv_workspace(models: dict[str, Any]) -> dict[str, Any]:
    """Per-pixel conv workspace: the mean gap between the untiled in-sample
    figures (where the decode sets the peak) and the profile's estimate without it."""
    anchors = [a for a in memory_anchor("conv_workspace_bytes_per_pixel") if not a.layout.vae_tiling]
    zero = provisional_constants()
    gaps = []
    for a in anchors:
        estimate = _anchor_estimate(models, a, zero)
        gaps.append((a.published_gb * GiB - estimate) / (a.width * a.height))
    value = sum(gaps) / len(gaps)
    figures = "; ".join(f"{a.label}: {a.published_gb:g} GB" for a in anchors)
    return _entry(
        value, "bytes per decoded pixel (untiled 3D-VAE decode)", "fitted",
        f"fitted to {anchors[0].source}: {figures} ({anchors[0].model}, {anchors[0].frames}x{anchors[0].width}x"
        f"{anchors[0].height}, {anchors[0].dtype}), as the mean gap between each figure and the profile's "
        "estimate without the term; no tensor shows it (cuDNN conv workspace, DESIGN.md). Refitted by "
        + PROFILE_COMMAND,
        figures=[a.label for a in anchors], gapsGiB=[round(g * a.width * a.height / GiB, 3)
                                                      for g, a in zip(gaps, anchors)])


def _step_seconds(models: dict[str, Any], constants: Constants, gpu: str, degrees: tuple[int, int, int]) -> float:
    from .latency import LatencyModel
    from .memory import Job, Layout

    model_id, width, height, frames = LATENCY_JOB
    model = get_model(model_id)
    cal = parse_models({model_id: models[model_id]}, constants)[model_id]
    job = Job(model, width, height, frames, 1, model.default_guidance)
    u, r, c = degrees
    return LatencyModel(cal, job, gpu).estimate(Layout(ulysses=u, ring=r, cfg=c)).denoise


def fit_latency(models: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Effective FLOP/s per GPU kind and the per-doubling parallel overheads,
    each solved from one xDiT figure (``anchors.LATENCY_ANCHORS``, in-sample)."""
    out: dict[str, dict[str, Any]] = {}
    base = provisional_constants()

    def figure(anchor) -> str:
        return (f"{anchor.gpu.upper()} ulysses {anchor.ulysses} x ring {anchor.ring} x cfg {anchor.cfg}: "
                f"{anchor.published_s_per_step} s/step, {anchor.source}")

    a100 = latency_anchor("a100_flops_per_s")
    flops = _step_seconds(models, base, "a100", (1, 1, 1))  # seconds at 1 FLOP/s = FLOPs of one step
    out["a100_flops_per_s"] = _entry(
        flops / a100.published_s_per_step, "FLOP/s (effective, video DiT inference)", "fitted",
        f"fitted to {figure(a100)}: the FLOPs of one step (CogVideoX-5b, batch 2, the profile's parameter "
        f"count) over the published seconds. Refitted by {PROFILE_COMMAND}", figures=[figure(a100)])
    fitted = base.replace(a100_flops_per_s=out["a100_flops_per_s"]["value"])
    l40 = latency_anchor("gpu_speed.l40")
    one_l40 = _step_seconds(models, fitted, "l40", (1, 1, 1))  # at l40 speed 1.0
    speeds = {"a100": 1.0, "l40": one_l40 / l40.published_s_per_step, **_GPU_SPEED_ASSUMED}
    out["gpu_speed"] = _entry(
        speeds, "x A100 effective FLOP/s", "fitted",
        f"a100 1.0 by definition; l40 fitted to {figure(l40)}; h100 2.2 and h200 2.3 assumed from the vendors' "
        "dense bf16 ratio (989 vs 312 TFLOPS) at a lower efficiency; generic 1.0 assumed.",
        figures=[figure(l40)], assumed=sorted(_GPU_SPEED_ASSUMED))
    fitted = fitted.replace(gpu_speed=speeds)
    for name, degrees in (("ulysses_overhead", (2, 1, 1)), ("ring_overhead", (1, 2, 1)), ("cfg_overhead", (1, 1, 2))):
        anchor = latency_anchor(name)
        ideal = _step_seconds(models, fitted, anchor.gpu, degrees)  # with zero overhead
        raw = anchor.published_s_per_step / ideal - 1
        value = max(raw, 0.0)
        clipped = f" (the fit gives {raw:+.3f}: a speed-up beyond ideal, clipped to 0)" if raw < 0 else ""
        out[name] = _entry(
            round(value, 6), "fraction per doubling", "fitted",
            f"fitted to {figure(anchor)} against the ideal 1/2 of the 1-GPU time{clipped}. Refitted by "
            + PROFILE_COMMAND, figures=[figure(anchor)])
    return out


def calibrated_constants(models: dict[str, Any], carried: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The ``constants`` section for a table holding ``models``.

    A fit needs its anchor's model in the table (cogvideox-2b, cogvideox-5b);
    a table without it (a tiny-model table for tests) carries the fitted value
    over from ``carried`` (another table's constants) and says so."""
    out = {name: dict(entry) for name, entry in ASSUMED.items()}
    fits: dict[str, dict[str, Any]] = {}
    if "cogvideox-2b" in models:
        fits["conv_workspace_bytes_per_pixel"] = fit_conv_workspace(models)
    if LATENCY_JOB[0] in models:
        fits.update(fit_latency(models))
    needed = ("conv_workspace_bytes_per_pixel", "a100_flops_per_s", "gpu_speed", "ulysses_overhead",
              "ring_overhead", "cfg_overhead")
    for name in needed:
        if name in fits:
            out[name] = fits[name]
        elif carried and name in carried:
            entry = dict(carried[name])
            note = " (carried over: this table lacks the model the figure is about)"
            if not entry["provenance"].endswith(note):
                entry["provenance"] += note
            out[name] = entry
        else:
            raise ValueError(f"cannot fit {name}: its anchor model is not in the table and no table to carry "
                             "it from; profile cogvideox-2b and cogvideox-5b too")
    return dict(sorted(out.items()))


def constants_for(models: dict[str, Any], carried: dict[str, Any] | None = None) -> Constants:
    return Constants.from_table(calibrated_constants(models, carried))


__all__ = ["ASSUMED", "PROFILE_COMMAND", "anchor_peak", "calibrated_constants", "constants_for",
           "fit_conv_workspace", "fit_latency", "provisional_constants"]
