"""The one order in which a job's plan is applied to a pipeline.

    step cache -> fp8 storage -> offload -> VAE -> decode offload

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
* VAE per job: tiling/slicing and skipping the CogVideoX VAE's unread conv
  cache (``vae_conv_cache``) only change how decode runs, so a warm pipeline
  follows each job's plan.
* decode offload last, per job: it needs the weights placed (offload none)
  and hooks ``vae.decode`` as the VAE step left it; it first brings back a
  denoiser the previous job parked, so the job's denoise finds it on the device.

``apply_load_strategies`` runs the first three once per (warm) pipeline;
``apply_job_strategies`` runs the last two before every job. The worker calls
only these two; the caches and strategies refuse to be applied out of order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from videojob.catalog import get_model

from ..pipelines import denoiser, inner_pipeline
from .decode_offload import DecodeOffload, DecodeOffloadConfig, apply_decode_offload
from .fp8 import Fp8Config, Fp8Result, apply_fp8_storage
from .offload import OffloadConfig, OffloadResult, apply_offload
from .vae import VaeConfig, VaeResult, apply_vae
from .vae_conv_cache import VaeConvCacheConfig, VaeConvCacheResult, apply_vae_conv_cache

STRATEGY_ORDER = ("step_cache", "fp8", "offload", "vae", "decode_offload")
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


@dataclass
class JobStrategies:
    vae: VaeResult
    conv_cache: VaeConvCacheResult
    decode_offload: DecodeOffload | None
    order: tuple[str, ...] = JOB_TIME


def apply_job_strategies(pipe, vae_tiling: bool, vae_slicing: bool, *, skip_unread_conv_cache: bool = True,
                         decode_offload: bool = False, offload: str = "none", device: str = "cpu") -> JobStrategies:
    """The per-job settings on a (warm) pipeline, in ``JOB_TIME`` order: the VAE's
    tiling, slicing and unread conv cache, then the decode offload (which first
    brings back a denoiser the previous job left on the host)."""
    inner = inner_pipeline(pipe)
    vae = apply_vae(inner, VaeConfig(tiling=vae_tiling, slicing=vae_slicing))
    cache = apply_vae_conv_cache(inner.vae, VaeConvCacheConfig(skip_unread=skip_unread_conv_cache))
    target = "cpu" if device == "cpu" else "cuda"
    moved = apply_decode_offload(inner, denoiser(pipe), DecodeOffloadConfig(enabled=decode_offload), target,
                                 offload=offload)
    return JobStrategies(vae, cache, moved)
