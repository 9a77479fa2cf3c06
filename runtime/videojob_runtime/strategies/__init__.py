"""Memory strategies the planner chooses per job, one technique per module.

Each module has a small frozen config (bad values raise ValueError naming the
field) and one function that applies it to a pipeline or model:

* ``offload``: ``apply_offload(pipe, OffloadConfig(mode, device, use_stream))``
* ``vae``: ``apply_vae(pipe, VaeConfig(tiling, slicing))``
* ``fp8``: ``apply_fp8_storage(transformer, Fp8Config(enabled, storage_dtype), compute_dtype)``
* ``text_encoder``: ``encode_and_release(pipe, TextEncoderConfig(release), prompt, ...)``
* ``vae_conv_cache``: ``apply_vae_conv_cache(vae, VaeConvCacheConfig(skip_unread))``
* ``decode_offload``: ``apply_decode_offload(pipe, denoiser, DecodeOffloadConfig(enabled), device)``

The order they are applied in is stated once, in ``order.py``: step cache,
fp8 storage, offload (once per warm pipeline), then VAE and decode offload
(per job); the prompt is encoded (and the encoder released) per job, before
the pipeline call.
"""

from .fp8 import FP8_STORAGE_DTYPES, Fp8Config, Fp8Result, apply_fp8_storage
from .offload import OFFLOAD_MODES, OffloadConfig, OffloadResult, apply_offload
from .text_encoder import RELEASE_MODES, PromptEmbeds, TextEncoderConfig, encode_and_release
from .vae import VaeConfig, VaeResult, apply_vae
from .vae_conv_cache import VaeConvCacheConfig, VaeConvCacheResult, apply_vae_conv_cache
from .decode_offload import DecodeOffload, DecodeOffloadConfig, apply_decode_offload, restore_denoiser
from .order import (
    STRATEGY_ORDER, AppliedStrategies, JobStrategies, LoadStrategies, apply_job_strategies, apply_load_strategies,
)

__all__ = [
    "FP8_STORAGE_DTYPES", "Fp8Config", "Fp8Result", "apply_fp8_storage",
    "OFFLOAD_MODES", "OffloadConfig", "OffloadResult", "apply_offload",
    "RELEASE_MODES", "PromptEmbeds", "TextEncoderConfig", "encode_and_release",
    "VaeConfig", "VaeResult", "apply_vae",
    "VaeConvCacheConfig", "VaeConvCacheResult", "apply_vae_conv_cache",
    "DecodeOffload", "DecodeOffloadConfig", "apply_decode_offload", "restore_denoiser",
    "STRATEGY_ORDER", "AppliedStrategies", "JobStrategies", "LoadStrategies", "apply_job_strategies",
    "apply_load_strategies",
]
