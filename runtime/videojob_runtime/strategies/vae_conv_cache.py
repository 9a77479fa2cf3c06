"""CogVideoX VAE decode: skip the conv cache that is never read.

``CogVideoXCausalConv3d.forward`` keeps the last ``time_kernel_size - 1``
input frames as a cache for the next frame batch:
``inputs[:, :, -self.time_kernel_size + 1:].clone()``. For a kernel of 1 in
time that slice is ``inputs[:, :, 0:]``: the whole input is cloned, and the
next call ignores it (``fake_context_parallel_forward`` reads the cache only
when the kernel is longer than 1). The kernel-1 convs are ``conv_y`` and
``conv_b`` of every ``CogVideoXSpatialNorm3D`` in the decoder, each fed the
upsampled latents at full resolution, so the dead clones are a large part of
the decode's working set (DESIGN.md: 14.74 -> 11.66 GiB untiled, 3.76 -> 3.00
tiled at 49x720x480; the calibration measures it per model).

``apply_vae_conv_cache`` replaces ``forward`` on exactly those instances
with the same computation minus the clone (it returns ``None`` as the cache,
which the next call never reads): the decoded frames are bit-identical. It is
switched on and off per job like tiling; VAEs without such convs (Wan, the
UNet models' AutoencoderKL) are left alone and reported as not applicable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["VaeConvCacheConfig", "VaeConvCacheResult", "apply_vae_conv_cache", "unread_cache_convs"]

_PATCHED_ATTR = "_videojob_skip_unread_cache"


@dataclass(frozen=True)
class VaeConvCacheConfig:
    """Whether the VAE skips its never-read conv cache."""

    skip_unread: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.skip_unread, bool):
            raise ValueError(f"VaeConvCacheConfig.skip_unread must be a bool, got {self.skip_unread!r}")


@dataclass(frozen=True)
class VaeConvCacheResult:
    applicable: bool  # the VAE has convs whose cache is never read
    skipping: int  # how many of them skip it now


def unread_cache_convs(vae: torch.nn.Module) -> list[torch.nn.Module]:
    """The causal convs whose returned cache is never read (kernel 1 in time, constant padding)."""
    try:
        from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d
    except ImportError:  # pragma: no cover - diffusers without CogVideoX
        return []
    return [m for m in vae.modules()
            if isinstance(m, CogVideoXCausalConv3d) and m.time_kernel_size == 1 and m.pad_mode != "replicate"]


def _forward_without_cache(module):
    def forward(inputs: torch.Tensor, conv_cache: torch.Tensor | None = None):
        # CogVideoXCausalConv3d.forward without ``conv_cache = inputs[:, :, 0:].clone()``:
        # with a kernel of 1 the padding step returns ``inputs`` unchanged and ignores the cache.
        return module.conv(module.fake_context_parallel_forward(inputs, conv_cache)), None

    return forward


def apply_vae_conv_cache(vae: torch.nn.Module, config: VaeConvCacheConfig) -> VaeConvCacheResult:
    """Make ``vae``'s kernel-1 causal convs skip (or keep, ``skip_unread=False``) their unread cache."""
    if not isinstance(config, VaeConvCacheConfig):
        raise ValueError(f"config must be a VaeConvCacheConfig, got {type(config).__name__}")
    if not isinstance(vae, torch.nn.Module):
        raise ValueError(f"VaeConvCacheConfig: expected the pipeline's vae module, got {type(vae).__name__}")
    convs = unread_cache_convs(vae)
    for conv in convs:
        ours = getattr(conv, _PATCHED_ATTR, None)
        if config.skip_unread and ours is None:
            if "forward" in conv.__dict__:
                raise ValueError(f"VaeConvCacheConfig.skip_unread: {type(conv).__name__}.forward is already "
                                 "replaced on this instance (another hook); refusing to wrap it")
            conv.forward = _forward_without_cache(conv)
            setattr(conv, _PATCHED_ATTR, conv.forward)
        elif not config.skip_unread and ours is not None:
            if conv.__dict__.get("forward") is not ours:
                raise ValueError(f"VaeConvCacheConfig.skip_unread: {type(conv).__name__}.forward was wrapped "
                                 "again after the cache was skipped; cannot restore it")
            del conv.forward  # the instance attribute; the class's forward shows again
            setattr(conv, _PATCHED_ATTR, None)
    return VaeConvCacheResult(bool(convs), sum(getattr(c, _PATCHED_ATTR, None) is not None for c in convs))
