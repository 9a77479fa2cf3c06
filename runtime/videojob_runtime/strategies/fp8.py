"""Store the denoiser's weights in float8, compute in the job's dtype.

Halves the transformer's resident weights against bf16/fp16 (the planner's
``fp8_weights``) at a small quality cost: diffusers layerwise casting keeps
each layer's weight in float8 and upcasts it just for that layer's forward.
The model's own skip patterns (patch embedding, norms, condition embedders)
stay in full precision. Works on a CPU with float32 compute (tests).

It is one-way: the float8 weights have lost their precision, so a pipeline
that has it cannot be turned back; load a fresh one.
Apply it before offload (group offload then moves the float8 weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FP8_STORAGE_DTYPES", "Fp8Config", "Fp8Result", "apply_fp8_storage"]

FP8_STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
_COMPUTE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Fp8Config:
    """Whether the denoiser's weights are stored in float8."""

    enabled: bool = False
    storage_dtype: str = "float8_e4m3fn"

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"Fp8Config.enabled must be a bool, got {self.enabled!r}")
        if self.storage_dtype not in FP8_STORAGE_DTYPES:
            raise ValueError(f"Fp8Config.storage_dtype must be one of {FP8_STORAGE_DTYPES}, "
                             f"got {self.storage_dtype!r}")


@dataclass(frozen=True)
class Fp8Result:
    enabled: bool
    storage_dtype: str | None = None
    compute_dtype: str | None = None
    float8_params: int = 0      # parameters now stored in float8
    full_params: int = 0        # parameters kept in full precision (skip patterns)


def apply_fp8_storage(transformer, config: Fp8Config, compute_dtype) -> Fp8Result:
    """Store ``transformer``'s weights as ``config.storage_dtype``; layers
    compute in ``compute_dtype`` (a torch dtype or "float32"/"float16"/"bfloat16")."""
    if not isinstance(config, Fp8Config):
        raise ValueError(f"config must be an Fp8Config, got {type(config).__name__}")
    compute = _compute_dtype(compute_dtype)
    from diffusers.hooks.layerwise_casting import _is_layerwise_casting_active

    active = _is_layerwise_casting_active(transformer)
    if not config.enabled:
        if active:
            raise ValueError("Fp8Config.enabled=False, but this transformer already stores float8 "
                             "weights (one-way); load a fresh pipeline")
        return Fp8Result(False)
    storage = getattr(torch, config.storage_dtype)
    if not active:
        if not hasattr(transformer, "enable_layerwise_casting"):
            raise ValueError(f"Fp8Config.enabled: {type(transformer).__name__} is not a diffusers model")
        transformer.enable_layerwise_casting(storage_dtype=storage, compute_dtype=compute)
    dtypes = [p.dtype for p in transformer.parameters()]
    n8 = sum(d == storage for d in dtypes)
    if active and n8 == 0:
        raise ValueError(f"Fp8Config.storage_dtype: this transformer already stores weights in "
                         f"another float8 type than {config.storage_dtype}; load a fresh pipeline")
    return Fp8Result(True, config.storage_dtype, str(compute).removeprefix("torch."), n8, len(dtypes) - n8)


def _compute_dtype(value) -> torch.dtype:
    if isinstance(value, str):
        if value not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype must be one of {tuple(_COMPUTE_DTYPES)}, got {value!r}")
        return _COMPUTE_DTYPES[value]
    if value not in _COMPUTE_DTYPES.values():
        raise ValueError(f"compute_dtype must be float32, float16 or bfloat16, got {value!r}")
    return value
