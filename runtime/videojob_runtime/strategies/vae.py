"""VAE decode working set: tiling and slicing.

Decode sets the peak for long videos (DESIGN.md: CogVideoX 49x720x480 decode
14.74 GiB, 3.76 tiled). Tiling decodes overlapping spatial tiles and blends
them (output differs slightly at tile seams); slicing decodes one batch item
at a time (no change to the output, engages only with batch > 1). Both are
switched on AND off here, so a warm pipeline follows each job's plan.

CogVideoX's tiled decode steps ``int(T * (1 - f))`` latent rows from tile to
tile (``T`` = tile size in latents, ``f`` = overlap factor) but keeps
``8T - int(8T * f)`` pixel rows of each tile. Unless these agree (x8) the video
comes out larger than asked: the tiny models' default 24x32 tiles with
factors 1/6 and 1/5 decode a 64x64 video to 76x70. The real 2b/5b defaults
(240x360 tiles for 480x720) agree. Where they do not, ``apply_vae`` moves each
factor to the nearest ``k / T``, which makes both exact (and the tiled encode
consistent too), and reports the factors it used.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VaeConfig", "VaeResult", "apply_vae"]


@dataclass(frozen=True)
class VaeConfig:
    """The planner's VAE choice for one job."""

    tiling: bool = False
    slicing: bool = False

    def __post_init__(self) -> None:
        for name in ("tiling", "slicing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"VaeConfig.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class VaeResult:
    tiling: bool
    slicing: bool
    # Tiles engage when the decoded frame is larger than this (height, width).
    tile_sample_min: tuple[int, int] | None = None
    # CogVideoX-style VAEs: the (height, width) overlap factors in use.
    tile_overlap: tuple[float, float] | None = None


def apply_vae(pipe, config: VaeConfig) -> VaeResult:
    """Set ``pipe.vae``'s tiling and slicing to exactly ``config``."""
    if not isinstance(config, VaeConfig):
        raise ValueError(f"config must be a VaeConfig, got {type(config).__name__}")
    vae = getattr(pipe, "vae", None)
    if vae is None:
        raise ValueError(f"VaeConfig: {type(pipe).__name__} has no vae")
    for name, wanted in (("tiling", config.tiling), ("slicing", config.slicing)):
        if wanted and not hasattr(vae, f"enable_{name}"):
            raise ValueError(f"VaeConfig.{name}: {type(vae).__name__} has no enable_{name}()")
        method = getattr(vae, f"{'enable' if wanted else 'disable'}_{name}", None)
        if method is not None:
            method()
    tile = overlap = None
    if getattr(vae, "use_tiling", False) and hasattr(vae, "tile_sample_min_height"):
        if hasattr(vae, "tile_overlap_factor_height") and hasattr(vae, "tile_latent_min_height"):
            fh, fw = _consistent_overlap(vae, "height"), _consistent_overlap(vae, "width")
            vae.enable_tiling(tile_overlap_factor_height=fh, tile_overlap_factor_width=fw)
            overlap = (fh, fw)
        tile = (int(vae.tile_sample_min_height), int(vae.tile_sample_min_width))
    return VaeResult(bool(getattr(vae, "use_tiling", False)), bool(getattr(vae, "use_slicing", False)),
                     tile, overlap)


def _consistent_overlap(vae, axis: str) -> float:
    """The overlap factor nearest the VAE's own for which CogVideoX's tile
    stride (latents) and kept rows (pixels) agree (module docstring)."""
    scale = 2 ** (len(vae.config.block_out_channels) - 1)
    t_px = int(getattr(vae, f"tile_sample_min_{axis}"))
    t_lat = int(t_px / scale)
    current = float(getattr(vae, f"tile_overlap_factor_{axis}"))

    def consistent(f: float) -> bool:  # the expressions diffusers' tiled_decode evaluates
        stride = int(t_lat * (1 - f))
        return stride >= 1 and t_px - int(t_px * f) == scale * stride

    if consistent(current):
        return current
    for k in sorted(range(1, t_lat), key=lambda k: abs(k / t_lat - current)):
        if consistent(k / t_lat):
            return k / t_lat
    raise ValueError(f"VaeConfig.tiling: {type(vae).__name__} tile_sample_min_{axis}={t_px} has no "
                     f"overlap that tiles exactly (it must be a multiple of {scale}, "
                     f"at least {2 * scale})")
