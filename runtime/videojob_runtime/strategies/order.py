"""The one order in which a job's plan is applied to a pipeline.

    step cache -> fp8 storage -> offload -> VAE

Why this order (each step wraps what the previous one left):
* step cache first: every cache wraps the denoiser's ``forward`` (cache-dit,
  or a diffusers hook). Model offload installs accelerate hooks that remember
  the forward they wrapped and put it back on every re-arm (diffusers re-arms
  after each pipeline call); a cache installed after offload is dropped then,
  silently, after the first job. Installed before, it is the forward that
  offload remembers, and it survives.
* fp8 storage before offload: offload must move the float8 weights (group
  offload keeps pinned host copies of whatever dtype it finds).
* offload last among the load-time strategies: it places the weights
  (``none`` moves the pipeline to the device).
* VAE tiling/slicing per job: they only change how decode runs, so a warm
  pipeline follows each job's plan.

``apply_load_strategies`` runs the first three once per (warm) pipeline;
``apply_job_strategies`` runs the VAE step before every job. The worker calls
only these two; the caches and strategies refuse to be applied out of order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from videojob.catalog import get_model

from ..pipelines import denoiser, inner_pipeline
from .fp8 import Fp8Config, Fp8Result, apply_fp8_storage
from .offload import OffloadConfig, OffloadResult, apply_offload
from .vae import VaeConfig, VaeResult, apply_vae

STRATEGY_ORDER = ("step_cache", "fp8", "offload", "vae")
LOAD_TIME = STRATEGY_ORDER[:3]
JOB_TIME = STRATEGY_ORDER[3:]


@dataclass(frozen=True)
class LoadStrategies:
    """What a pipeline is built with (part of the warm pipeline's key)."""

    model_id: str
    cache: str = "off"
    cache_threshold: float | None = None
    steps: int = 50
    fp8_weights: bool = False
    offload: str = "none"
    device: str = "cpu"
    dtype: str = "float32"


@dataclass
class AppliedStrategies:
    cache: Any  # a StepCacheHandle, a TeaCacheHandle, or None
    fp8: Fp8Result
    offload: OffloadResult
    order: tuple[str, ...] = LOAD_TIME

    def describe(self) -> dict[str, Any]:
        return {"order": list(self.order), "cache": type(self.cache).__name__ if self.cache else None,
                "fp8": self.fp8.enabled, "offload": self.offload.mode}


def apply_step_cache_for(pipe, model_id: str, policy: str, threshold: float | None, steps: int):
    """The job's step cache on ``pipe`` (a diffusers pipeline or an xfuser wrapper); None for off."""
    if policy == "off":
        return None
    model = get_model(model_id)
    if policy not in model.caches or policy == "auto":
        raise ValueError(f"step cache {policy!r}: {model_id} takes {', '.join(c for c in model.caches if c != 'auto')} "
                         "(auto is resolved by the planner)")
    if policy == "teacache":
        from ..teacache import DEFAULT_THRESHOLD, TeaCacheConfig, apply_teacache

        config = TeaCacheConfig(threshold=threshold or DEFAULT_THRESHOLD,
                                calls_per_step=model.denoiser_calls_per_step(guidance=2.0))
        return apply_teacache(denoiser(pipe), config)
    from ..stepcache import StepCacheConfig, apply_step_cache

    return apply_step_cache(pipe, StepCacheConfig(policy=policy, threshold=threshold, num_inference_steps=steps))


def apply_load_strategies(pipe, plan: LoadStrategies) -> AppliedStrategies:
    """Step cache, fp8 storage, offload: in ``STRATEGY_ORDER``. On failure the
    pipeline is half-built; the caller must drop it."""
    cache = apply_step_cache_for(pipe, plan.model_id, plan.cache, plan.cache_threshold, plan.steps)
    inner = inner_pipeline(pipe)
    fp8 = apply_fp8_storage(denoiser(pipe), Fp8Config(enabled=plan.fp8_weights), plan.dtype)
    device = "cpu" if plan.device == "cpu" else "cuda"
    offload = apply_offload(inner, OffloadConfig(mode=plan.offload, device=device, use_stream=device == "cuda"))
    return AppliedStrategies(cache, fp8, offload)


def apply_job_strategies(pipe, vae_tiling: bool, vae_slicing: bool) -> VaeResult:
    """The per-job VAE settings on a (warm) pipeline."""
    return apply_vae(inner_pipeline(pipe), VaeConfig(tiling=vae_tiling, slicing=vae_slicing))
