"""Where a pipeline's weights live while it runs (offload).

The planner picks one of four modes per job (DESIGN.md, "The memory
planner"); this file makes the pipeline match that plan:

* ``none``: every component on the device. Most memory, fastest.
* ``model``: whole components swap between host and device, one at a time
  (diffusers ``enable_model_cpu_offload``: accelerate ``cpu_offload_with_hook``
  chained in ``model_cpu_offload_seq`` order).
* ``group``: block-level group offload (diffusers hooks). The denoiser runs
  one block group on the device and prefetches the next on a CUDA stream
  (pinned host copies: ~2x weights in host RAM). Text encoders and VAEs run
  once per job, so they get groups without streams: block-level where the
  module has repeated blocks (the same ``block_modules`` the planner's
  calibration counts, ``profiling.stages.group_offload_block_modules``), leaf
  level where it has none. Leaf level matters for VAEs such as CogVideoX's:
  its ``decode`` never calls ``forward``, so a block-level "unmatched" group
  hooked on ``forward`` would leave the decoder's weights on the host.
* ``sequential``: leaf-level accelerate hooks, weights parked on ``meta``
  between uses. Least memory, slowest.

On a CPU (``device="cpu"``) the same hook code paths run, with host and
"device" both the CPU and streams off (they need an accelerator backend), so
tests exercise the real hooks; what differs per mode is in ``OffloadResult``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OFFLOAD_MODES", "OffloadConfig", "OffloadResult", "apply_offload"]

OFFLOAD_MODES = ("none", "model", "group", "sequential")

# Components called once per denoising step: the only ones worth a stream.
_DENOISERS = ("transformer", "transformer_2", "unet")
_APPLIED_ATTR = "_videojob_offload"


@dataclass(frozen=True)
class OffloadConfig:
    """How to place a pipeline's weights (see the module docstring)."""

    mode: str = "none"
    device: str = "cuda"
    # Group mode only: overlap the next block's copy with compute on a CUDA
    # stream. Ignored for other modes and on a CPU device.
    use_stream: bool = True

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise ValueError(f"OffloadConfig.mode must be one of {OFFLOAD_MODES}, got {self.mode!r}")
        if not isinstance(self.device, str):
            raise ValueError(f"OffloadConfig.device must be a device string such as 'cuda', "
                             f"got {self.device!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ValueError(f"OffloadConfig.device {self.device!r} is not a torch device") from None
        if dev.type == "meta":
            raise ValueError("OffloadConfig.device cannot be 'meta': nothing can run there")
        if not isinstance(self.use_stream, bool):
            raise ValueError(f"OffloadConfig.use_stream must be a bool, got {self.use_stream!r}")


@dataclass(frozen=True)
class OffloadResult:
    """What ``apply_offload`` did: per component, and whether streams are on."""

    mode: str
    device: str
    streams: bool
    components: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "device": self.device, "streams": self.streams,
                "components": dict(self.components), "notes": list(self.notes)}


def apply_offload(pipe, config: OffloadConfig) -> OffloadResult:
    """Place ``pipe``'s weights as ``config`` says; returns what was applied.

    A pipeline takes one offload layout for its lifetime (a warm actor keeps
    its layout): applying the same config again is a no-op, a different one
    is a ValueError (build a fresh pipeline instead).
    """
    if not isinstance(config, OffloadConfig):
        raise ValueError(f"config must be an OffloadConfig, got {type(config).__name__}")
    if not hasattr(pipe, "components"):
        raise ValueError(f"apply_offload needs a diffusers pipeline, got {type(pipe).__name__}")
    device = torch.device(config.device)
    _check_available(device)
    previous = getattr(pipe, _APPLIED_ATTR, None)
    if previous is not None:
        if previous[0] == config:
            return previous[1]
        raise ValueError(
            f"OffloadConfig.mode: this pipeline already has offload {previous[0].mode!r} on "
            f"{previous[0].device!r}; load a fresh pipeline to change it"
        )
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    apply = {"none": _none, "model": _model, "group": _group, "sequential": _sequential}[config.mode]
    result = apply(pipe, modules, device, config)
    setattr(pipe, _APPLIED_ATTR, (config, result))
    return result


def _check_available(device: torch.device) -> None:
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ValueError(f"OffloadConfig.device {str(device)!r}: no {device.type} device on this machine")
    if device.index is not None and device.index >= backend.device_count():
        raise ValueError(f"OffloadConfig.device {str(device)!r}: only {backend.device_count()} "
                         f"{device.type} device(s) here")


def _none(pipe, modules, device, config) -> OffloadResult:
    pipe.to(device)
    return OffloadResult("none", str(device), False, {n: f"resident on {device}" for n in modules})


def _model(pipe, modules, device, config) -> OffloadResult:
    # diffusers refuses only an implicit CPU device; an explicit "cpu" runs
    # the same accelerate chain (its execution device becomes "cpu:0", and
    # every move is then a no-op).
    pipe.enable_model_cpu_offload(device=str(device))
    seq = (pipe.model_cpu_offload_seq or "").split("->")
    comps = {n: ("on the device while it runs, host otherwise (accelerate cpu_offload_with_hook)"
                 if n not in getattr(pipe, "_exclude_from_cpu_offload", []) else f"resident on {device}")
             for n in modules}
    notes = [f"swap order: {' -> '.join(n for n in seq if n in modules)}"]
    if device.type == "cpu":
        notes.append("cpu: hooks run, host and device are the same memory")
    return OffloadResult("model", str(device), False, comps, tuple(notes))


def _sequential(pipe, modules, device, config) -> OffloadResult:
    if device.type != "cpu":
        pipe.enable_sequential_cpu_offload(device=str(device))
    else:
        # enable_sequential_cpu_offload turns "cpu" into torch.device("cpu:0").
        # Parameter.to("cpu:0") on a tensor that reports "cpu" returns a plain
        # Tensor (not the Parameter), so accelerate's onload leaves Tensors in
        # _parameters and its post-forward fails rebuilding them (TypeError:
        # Tensor(value, requires_grad=...) in set_module_tensor_to_device).
        # CUDA tensors report "cuda:0": no such change there. So run the same
        # loop as diffusers, with device "cpu".
        from accelerate import cpu_offload

        pipe.remove_all_hooks()
        pipe._offload_gpu_id = 0
        pipe._offload_device = device
        excluded = getattr(pipe, "_exclude_from_cpu_offload", [])
        for name, module in modules.items():
            if name in excluded:
                module.to(device)
            else:
                cpu_offload(module, device, offload_buffers=len(module._parameters) > 0)
    comps = {n: "leaf modules onloaded per call, weights on meta between uses (accelerate cpu_offload)"
             for n in modules}
    notes = ("cpu: weights really leave the modules (meta) between uses, so a weight used outside "
             "its module's forward fails here as it would on a GPU",) if device.type == "cpu" else ()
    return OffloadResult("sequential", str(device), False, comps, notes)


def _group(pipe, modules, device, config) -> OffloadResult:
    from diffusers.hooks import apply_group_offloading

    from ..profiling.stages import block_groups, group_offload_block_modules

    host = torch.device("cpu")
    streams = config.use_stream and device.type != "cpu"
    comps: dict[str, str] = {}
    for name, module in modules.items():
        if name in _DENOISERS:
            kwargs = dict(onload_device=device, offload_device=host, offload_type="block_level",
                          num_blocks_per_group=1, use_stream=streams)
            if hasattr(module, "enable_group_offload"):
                module.enable_group_offload(**kwargs)
            else:
                apply_group_offloading(module, **kwargs)
            stream = ", prefetch on a CUDA stream" if streams else ""
            comps[name] = f"block_level, 1 block per group{stream}"
            continue
        block_modules = group_offload_block_modules(module)
        groups, _ = block_groups(module, block_modules)
        if groups:
            apply_group_offloading(module, onload_device=device, offload_device=host,
                                   offload_type="block_level", num_blocks_per_group=1,
                                   block_modules=block_modules, use_stream=False)
            comps[name] = f"block_level, {len(groups)} groups, no stream (runs once per job)"
        else:
            apply_group_offloading(module, onload_device=device, offload_device=host,
                                   offload_type="leaf_level", use_stream=False)
            comps[name] = "leaf_level, no stream (no repeated blocks; decode bypasses forward)"
    notes = []
    if config.use_stream and not streams:
        notes.append("cpu: streams need an accelerator backend, so they are off")
    return OffloadResult("group", str(device), streams, comps, tuple(notes))
