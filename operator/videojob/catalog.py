"""The model catalog: what each supported model accepts and what it can do.

The operator imports no torch, so everything the API validation and the
planner need to know about a model lives here as plain data. Numbers come
from the public model configs named in ``config_source``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Family(str, Enum):
    """Architecture families; the runtime picks a loader per family."""

    COGVIDEOX = "cogvideox"
    CONSISID = "consisid"
    WAN = "wan"
    I2VGEN_XL = "i2vgen-xl"
    ANIMATEDIFF = "animatediff"


@dataclass(frozen=True)
class FrameRule:
    """Frame counts a model accepts: ``step * k + offset``, up to ``maximum``."""

    step: int
    offset: int
    maximum: int
    minimum: int = 1

    def accepts(self, frames: int) -> bool:
        return (
            self.minimum <= frames <= self.maximum
            and (frames - self.offset) % self.step == 0
        )

    def describe(self) -> str:
        if self.step == 1:
            return f"between {self.minimum} and {self.maximum}"
        form = f"{self.step}k+{self.offset}" if self.offset else f"{self.step}k"
        examples = [
            n for n in range(self.minimum, self.maximum + 1) if self.accepts(n)
        ]
        shown = ", ".join(str(n) for n in examples[-3:])
        return f"of the form {form}, at most {self.maximum} (e.g. {shown})"

    def nearest(self, frames: int) -> int:
        """The closest accepted frame count, for error messages."""
        candidates = [
            n for n in range(self.minimum, self.maximum + 1) if self.accepts(n)
        ]
        return min(candidates, key=lambda n: (abs(n - frames), n))


@dataclass(frozen=True)
class Arch:
    """Architecture numbers the memory and latency models need.

    ``tokens`` are the transformer's patch tokens for the video (DiTs) or the
    latent positions (UNets); ``text_tokens`` the padded prompt length.
    """

    kind: str  # "dit" or "unet"
    layers: int
    head_dim: int
    patch_t: int
    patch_hw: int
    vae_spatial: int
    vae_temporal: int
    latent_channels: int
    text_tokens: int
    text_encoder: str

    def latent_frames(self, frames: int) -> int:
        if self.vae_temporal == 1:
            return frames
        latent = (frames - 1) // self.vae_temporal + 1
        # CogVideoX 1.5 pads latent frames up to a multiple of patch_t.
        return -(-latent // self.patch_t) * self.patch_t

    def tokens(self, width: int, height: int, frames: int) -> int:
        side = self.vae_spatial * self.patch_hw
        return (self.latent_frames(frames) // self.patch_t) * (height // side) * (width // side)


@dataclass(frozen=True)
class Component:
    """One module of a pipeline, with its published parameter count."""

    name: str
    cls: str
    params: float
    source: str


@dataclass(frozen=True)
class ModelInfo:
    """One catalog entry. ``id`` is stable, lower-case and used in specs."""

    id: str
    family: Family
    description: str
    config_source: str
    tasks: tuple[str, ...]
    native_width: int
    native_height: int
    native_frames: int
    native_fps: int
    frames: FrameRule
    size_multiple: int
    attention_heads: int
    default_steps: int
    default_guidance: float
    caches: tuple[str, ...]
    arch: Arch
    components: tuple[Component, ...]
    offload_modes: tuple[str, ...] = ("none", "model", "group", "sequential")
    # xfuser 0.7.0 facts (checked on CPU, see DESIGN.md): its CogVideoX
    # wrapper shards the latent height (patch rows must divide by the SP
    # degree) and needs guidance > 1 under SP; Wan shards the token
    # sequence and has no CFG parallel.
    sp_split: str = "tokens"  # "tokens" or "height"
    cfg_parallel: bool = True
    sp_needs_guidance: bool = False
    # With guidance, the pipeline batches the conditional and unconditional
    # passes into one denoiser call per step (CogVideoX, ConsisID, the UNets);
    # Wan's calls the denoiser twice per step, each at batch 1.
    cfg_batched: bool = True
    # Which ranks of a multi-rank job run the VAE decode: "all" (Wan: the plain
    # diffusers pipeline on every rank, each decoding the whole video) or
    # "last" (xfuser 0.7.0's CogVideoX and ConsisID wrappers decode on the
    # last data-parallel rank only, ``is_dp_last_group``; the others return
    # None). One rank either way for single-GPU models.
    decoding_ranks: str = "all"
    # Learned positional embeddings pin the resolution (CogVideoX-5b-I2V).
    fixed_resolution: bool = False
    min_size: int = 64
    max_size: int = 2048
    # DiTs run sequence-parallel through xfuser; UNets run on one rank.
    sequence_parallel: bool = True
    tiny: bool = False
    hub_id: str | None = None
    # Models shipped as an add-on to a base pipeline (AnimateDiff's motion
    # adapter on Stable Diffusion 1.5): the base's hub id.
    base_hub_id: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def denoiser_calls_per_step(self, guidance: float) -> int:
        """Denoiser calls per step: 2 when guidance runs as a separate call."""
        return 1 if self.cfg_batched or guidance <= 1.0 else 2

    @property
    def max_ulysses(self) -> int:
        return self.attention_heads if self.sequence_parallel else 1


_DIT_CACHES = ("off", "auto", "fbcache", "dbcache", "teacache")
# ConsisID: diffusers' FirstBlockCache does not work as shipped (DESIGN.md), and
# cache-dit's DBCache changes its output even at threshold 0 (it swaps the block
# list while ConsisID applies face cross-attention by block index): only the
# TeaCache-style cache, which never enters the transformer (runtime/teacache.py).
_CONSISID_CACHES = ("off", "auto", "teacache")
_UNET_CACHES = ("off", "auto")

_COGVIDEOX_FRAMES = FrameRule(step=8, offset=1, maximum=49)
_COGVIDEOX15_FRAMES = FrameRule(step=16, offset=1, maximum=161)
_WAN_FRAMES = FrameRule(step=4, offset=1, maximum=81)
_UNET_FRAMES = FrameRule(step=1, offset=0, maximum=32)

_MODELS: tuple[ModelInfo, ...] = (
    ModelInfo(
        id="cogvideox-2b",
        family=Family.COGVIDEOX,
        description="CogVideoX 2B text-to-video",
        config_source="THUDM/CogVideoX-2b transformer/config.json",
        hub_id="THUDM/CogVideoX-2b",
        tasks=("t2v",),
        native_width=720,
        native_height=480,
        native_frames=49,
        native_fps=8,
        frames=_COGVIDEOX_FRAMES,
        size_multiple=16,
        attention_heads=30,
        default_steps=50,
        default_guidance=6.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=30, head_dim=64, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=16, text_tokens=226, text_encoder="t5-xxl"),
        components=(
            Component("text_encoder", "T5EncoderModel", 4.762e9, "google/t5-v1_1-xxl encoder, as THUDM/CogVideoX-2b text_encoder/config.json"),
            Component("transformer", "CogVideoXTransformer3DModel", 1.692e9, "THUDM/CogVideoX-2b transformer/config.json"),
            Component("vae", "AutoencoderKLCogVideoX", 215.6e6, "THUDM/CogVideoX-2b vae/config.json"),
        ),
        sp_split="height",
        sp_needs_guidance=True,
        decoding_ranks="last",
    ),
    ModelInfo(
        id="cogvideox-5b",
        family=Family.COGVIDEOX,
        description="CogVideoX 5B text-to-video",
        config_source="THUDM/CogVideoX-5b transformer/config.json",
        hub_id="THUDM/CogVideoX-5b",
        tasks=("t2v",),
        native_width=720,
        native_height=480,
        native_frames=49,
        native_fps=8,
        frames=_COGVIDEOX_FRAMES,
        size_multiple=16,
        attention_heads=48,
        default_steps=50,
        default_guidance=6.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=42, head_dim=64, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=16, text_tokens=226, text_encoder="t5-xxl"),
        components=(
            Component("text_encoder", "T5EncoderModel", 4.762e9, "google/t5-v1_1-xxl encoder, as THUDM/CogVideoX-2b text_encoder/config.json"),
            Component("transformer", "CogVideoXTransformer3DModel", 5.570e9, "THUDM/CogVideoX-5b transformer/config.json"),
            Component("vae", "AutoencoderKLCogVideoX", 215.6e6, "THUDM/CogVideoX-2b vae/config.json"),
        ),
        sp_split="height",
        sp_needs_guidance=True,
        decoding_ranks="last",
    ),
    ModelInfo(
        id="cogvideox-5b-i2v",
        family=Family.COGVIDEOX,
        description="CogVideoX 5B image-to-video",
        config_source="THUDM/CogVideoX-5b-I2V transformer/config.json",
        hub_id="THUDM/CogVideoX-5b-I2V",
        tasks=("i2v",),
        native_width=720,
        native_height=480,
        native_frames=49,
        native_fps=8,
        frames=_COGVIDEOX_FRAMES,
        size_multiple=16,
        attention_heads=48,
        default_steps=50,
        default_guidance=6.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=42, head_dim=64, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=16, text_tokens=226, text_encoder="t5-xxl"),
        components=(
            Component("text_encoder", "T5EncoderModel", 4.762e9, "google/t5-v1_1-xxl encoder, as THUDM/CogVideoX-2b text_encoder/config.json"),
            Component("transformer", "CogVideoXTransformer3DModel", 5.570e9, "THUDM/CogVideoX-5b-I2V transformer/config.json"),
            Component("vae", "AutoencoderKLCogVideoX", 215.6e6, "THUDM/CogVideoX-2b vae/config.json"),
        ),
        fixed_resolution=True,
        sp_split="height",
        sp_needs_guidance=True,
        decoding_ranks="last",
        # xfuser 0.7.0 has no image-to-video CogVideoX wrapper: one rank.
        sequence_parallel=False,
    ),
    ModelInfo(
        id="cogvideox1.5-5b",
        family=Family.COGVIDEOX,
        description="CogVideoX 1.5 5B text-to-video",
        config_source="THUDM/CogVideoX1.5-5B transformer/config.json",
        hub_id="THUDM/CogVideoX1.5-5B",
        tasks=("t2v",),
        native_width=1360,
        native_height=768,
        native_frames=81,
        native_fps=16,
        frames=_COGVIDEOX15_FRAMES,
        size_multiple=16,
        attention_heads=48,
        default_steps=50,
        default_guidance=6.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=42, head_dim=64, patch_t=2, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=16, text_tokens=226, text_encoder="t5-xxl"),
        components=(
            Component("text_encoder", "T5EncoderModel", 4.762e9, "google/t5-v1_1-xxl encoder, as THUDM/CogVideoX-2b text_encoder/config.json"),
            Component("transformer", "CogVideoXTransformer3DModel", 5.570e9, "THUDM/CogVideoX1.5-5B transformer/config.json"),
            Component("vae", "AutoencoderKLCogVideoX", 215.6e6, "THUDM/CogVideoX-2b vae/config.json"),
        ),
        sp_split="height",
        sp_needs_guidance=True,
        decoding_ranks="last",
    ),
    ModelInfo(
        id="consisid",
        family=Family.CONSISID,
        description="ConsisID identity-preserving text-to-video (CogVideoX-5b based)",
        config_source="BestWishYsh/ConsisID-preview transformer/config.json",
        hub_id="BestWishYsh/ConsisID-preview",
        tasks=("identity",),
        native_width=720,
        native_height=480,
        native_frames=49,
        native_fps=8,
        frames=_COGVIDEOX_FRAMES,
        size_multiple=16,
        attention_heads=48,
        default_steps=50,
        default_guidance=6.0,
        caches=_CONSISID_CACHES,
        arch=Arch(kind="dit", layers=42, head_dim=64, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=16, text_tokens=226, text_encoder="t5-xxl"),
        components=(
            Component("text_encoder", "T5EncoderModel", 4.762e9, "google/t5-v1_1-xxl encoder, as THUDM/CogVideoX-2b text_encoder/config.json"),
            Component("transformer", "ConsisIDTransformer3DModel", 6.162e9, "BestWishYsh/ConsisID-preview transformer/config.json"),
            Component("vae", "AutoencoderKLCogVideoX", 215.6e6, "THUDM/CogVideoX-2b vae/config.json"),
        ),
        fixed_resolution=True,
        sp_split="height",
        sp_needs_guidance=True,
        decoding_ranks="last",
    ),
    ModelInfo(
        id="wan2.1-t2v-1.3b",
        family=Family.WAN,
        description="Wan 2.1 1.3B text-to-video",
        config_source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json",
        hub_id="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        tasks=("t2v",),
        native_width=832,
        native_height=480,
        native_frames=81,
        native_fps=16,
        frames=_WAN_FRAMES,
        size_multiple=16,
        attention_heads=12,
        default_steps=50,
        default_guidance=5.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=30, head_dim=128, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=16, text_tokens=512, text_encoder="umt5-xxl"),
        components=(
            Component("text_encoder", "UMT5EncoderModel", 5.681e9, "google/umt5-xxl encoder, as Wan-AI/Wan2.1-T2V-1.3B-Diffusers text_encoder/config.json"),
            Component("transformer", "WanTransformer3DModel", 1.419e9, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json"),
            Component("vae", "AutoencoderKLWan", 126.9e6, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json"),
        ),
        cfg_parallel=False,
        cfg_batched=False,
    ),
    ModelInfo(
        id="wan2.1-t2v-14b",
        family=Family.WAN,
        description="Wan 2.1 14B text-to-video",
        config_source="Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json",
        hub_id="Wan-AI/Wan2.1-T2V-14B-Diffusers",
        tasks=("t2v",),
        native_width=1280,
        native_height=720,
        native_frames=81,
        native_fps=16,
        frames=_WAN_FRAMES,
        size_multiple=16,
        attention_heads=40,
        default_steps=50,
        default_guidance=5.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=40, head_dim=128, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=16, text_tokens=512, text_encoder="umt5-xxl"),
        components=(
            Component("text_encoder", "UMT5EncoderModel", 5.681e9, "google/umt5-xxl encoder, as Wan-AI/Wan2.1-T2V-1.3B-Diffusers text_encoder/config.json"),
            Component("transformer", "WanTransformer3DModel", 14.29e9, "Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json"),
            Component("vae", "AutoencoderKLWan", 126.9e6, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json"),
        ),
        cfg_parallel=False,
        cfg_batched=False,
    ),
    ModelInfo(
        id="i2vgen-xl",
        family=Family.I2VGEN_XL,
        description="I2VGen-XL image-to-video (UNet)",
        config_source="ali-vilab/i2vgen-xl unet/config.json",
        hub_id="ali-vilab/i2vgen-xl",
        tasks=("i2v",),
        native_width=1280,
        native_height=704,
        native_frames=16,
        native_fps=16,
        frames=_UNET_FRAMES,
        size_multiple=8,
        attention_heads=64,
        default_steps=50,
        default_guidance=9.0,
        caches=_UNET_CACHES,
        arch=Arch(kind="unet", layers=4, head_dim=64, patch_t=1, patch_hw=1, vae_spatial=8, vae_temporal=1, latent_channels=4, text_tokens=77, text_encoder="clip-h"),
        components=(
            Component("text_encoder", "CLIPTextModel", 340.4e6, "ali-vilab/i2vgen-xl text_encoder/config.json"),
            Component("image_encoder", "CLIPVisionModelWithProjection", 632.1e6, "ali-vilab/i2vgen-xl image_encoder/config.json"),
            Component("unet", "I2VGenXLUNet", 1.427e9, "ali-vilab/i2vgen-xl unet/config.json"),
            Component("vae", "AutoencoderKL", 83.65e6, "stable-diffusion-v1-5 vae/config.json"),
        ),
        sequence_parallel=False,
    ),
    ModelInfo(
        id="animatediff",
        family=Family.ANIMATEDIFF,
        description="AnimateDiff: Stable Diffusion 1.5 with motion adapter v1-5-2",
        config_source=(
            "stable-diffusion-v1-5 unet/config.json + "
            "guoyww/animatediff-motion-adapter-v1-5-2 config.json"
        ),
        hub_id="guoyww/animatediff-motion-adapter-v1-5-2",
        base_hub_id="stable-diffusion-v1-5/stable-diffusion-v1-5",
        tasks=("t2v",),
        native_width=512,
        native_height=512,
        native_frames=16,
        native_fps=8,
        frames=_UNET_FRAMES,
        size_multiple=8,
        attention_heads=8,
        default_steps=25,
        default_guidance=7.5,
        caches=_UNET_CACHES,
        arch=Arch(kind="unet", layers=4, head_dim=40, patch_t=1, patch_hw=1, vae_spatial=8, vae_temporal=1, latent_channels=4, text_tokens=77, text_encoder="clip-l"),
        components=(
            Component("text_encoder", "CLIPTextModel", 123.1e6, "stable-diffusion-v1-5 text_encoder/config.json"),
            Component("unet", "UNetMotionModel", 1.313e9, "stable-diffusion-v1-5 unet + guoyww/animatediff-motion-adapter-v1-5-2"),
            Component("vae", "AutoencoderKL", 83.65e6, "stable-diffusion-v1-5 vae/config.json"),
        ),
        sequence_parallel=False,
    ),
    # Tiny random-weight models for tests and the CPU demo: built from
    # configs in the runtime, no downloads. Same rules as their families.
    ModelInfo(
        id="tiny-cogvideox",
        family=Family.COGVIDEOX,
        description="Tiny random-weight CogVideoX for tests and the CPU demo",
        config_source="videojob runtime tiny config (CogVideoX layout)",
        tasks=("t2v",),
        native_width=64,
        native_height=64,
        native_frames=9,
        native_fps=8,
        frames=_COGVIDEOX_FRAMES,
        size_multiple=16,
        attention_heads=4,
        default_steps=4,
        default_guidance=6.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=2, head_dim=16, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=4, text_tokens=16, text_encoder="tiny-t5"),
        components=(),
        min_size=16,
        max_size=256,
        tiny=True,
        sp_split="height",
        sp_needs_guidance=True,
        decoding_ranks="last",
    ),
    ModelInfo(
        id="tiny-cogvideox-i2v",
        family=Family.COGVIDEOX,
        description="Tiny random-weight CogVideoX image-to-video for tests",
        config_source="videojob runtime tiny config (CogVideoX I2V layout)",
        tasks=("i2v",),
        native_width=64,
        native_height=64,
        native_frames=9,
        native_fps=8,
        frames=_COGVIDEOX_FRAMES,
        size_multiple=16,
        attention_heads=4,
        default_steps=4,
        default_guidance=6.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=2, head_dim=16, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=4, text_tokens=16, text_encoder="tiny-t5"),
        components=(),
        min_size=16,
        max_size=256,
        tiny=True,
        sp_split="height",
        sp_needs_guidance=True,
        decoding_ranks="last",
        # xfuser 0.7.0 has no image-to-video CogVideoX wrapper: one rank.
        sequence_parallel=False,
    ),
    ModelInfo(
        id="tiny-consisid",
        family=Family.CONSISID,
        description="Tiny random-weight ConsisID for tests",
        config_source="videojob runtime tiny config (ConsisID layout)",
        tasks=("identity",),
        native_width=64,
        native_height=64,
        native_frames=9,
        native_fps=8,
        frames=_COGVIDEOX_FRAMES,
        size_multiple=16,
        attention_heads=4,
        default_steps=4,
        default_guidance=6.0,
        caches=_CONSISID_CACHES,
        arch=Arch(kind="dit", layers=2, head_dim=16, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=4, text_tokens=16, text_encoder="tiny-t5"),
        components=(),
        min_size=16,
        max_size=256,
        tiny=True,
        sp_split="height",
        sp_needs_guidance=True,
        decoding_ranks="last",
    ),
    ModelInfo(
        id="tiny-wan",
        family=Family.WAN,
        description="Tiny random-weight Wan 2.1 for tests",
        config_source="videojob runtime tiny config (Wan 2.1 layout)",
        tasks=("t2v",),
        native_width=64,
        native_height=64,
        native_frames=9,
        native_fps=16,
        frames=_WAN_FRAMES,
        size_multiple=16,
        attention_heads=4,
        default_steps=4,
        default_guidance=5.0,
        caches=_DIT_CACHES,
        arch=Arch(kind="dit", layers=2, head_dim=16, patch_t=1, patch_hw=2, vae_spatial=8, vae_temporal=4, latent_channels=4, text_tokens=16, text_encoder="tiny-t5"),
        components=(),
        min_size=16,
        max_size=256,
        tiny=True,
        cfg_parallel=False,
        cfg_batched=False,
    ),
    ModelInfo(
        id="tiny-i2vgen-xl",
        family=Family.I2VGEN_XL,
        description="Tiny random-weight I2VGen-XL image-to-video (UNet) for tests",
        config_source="videojob runtime tiny config (I2VGen-XL UNet layout)",
        tasks=("i2v",),
        native_width=64,
        native_height=64,
        native_frames=8,
        native_fps=16,
        frames=_UNET_FRAMES,
        size_multiple=8,
        attention_heads=4,
        default_steps=4,
        default_guidance=9.0,
        caches=_UNET_CACHES,
        arch=Arch(kind="unet", layers=2, head_dim=8, patch_t=1, patch_hw=1, vae_spatial=8, vae_temporal=1, latent_channels=4, text_tokens=16, text_encoder="tiny-clip"),
        components=(),
        min_size=16,
        max_size=256,
        sequence_parallel=False,
        tiny=True,
    ),
    ModelInfo(
        id="tiny-animatediff",
        family=Family.ANIMATEDIFF,
        description="Tiny random-weight AnimateDiff (UNet with motion modules) for tests",
        config_source="videojob runtime tiny config (SD 1.5 UNet + motion adapter layout)",
        tasks=("t2v",),
        native_width=64,
        native_height=64,
        native_frames=8,
        native_fps=8,
        frames=_UNET_FRAMES,
        size_multiple=8,
        attention_heads=4,
        default_steps=4,
        default_guidance=7.5,
        caches=_UNET_CACHES,
        arch=Arch(kind="unet", layers=2, head_dim=8, patch_t=1, patch_hw=1, vae_spatial=8, vae_temporal=1, latent_channels=4, text_tokens=16, text_encoder="tiny-clip"),
        components=(),
        min_size=16,
        max_size=256,
        sequence_parallel=False,
        tiny=True,
    ),
)

CATALOG: dict[str, ModelInfo] = {m.id: m for m in _MODELS}
MODEL_IDS: tuple[str, ...] = tuple(CATALOG)
TASKS: tuple[str, ...] = ("t2v", "i2v", "identity")
CACHE_POLICIES: tuple[str, ...] = ("off", "auto", "teacache", "fbcache", "dbcache")


def get_model(model_id: str) -> ModelInfo:
    """Look a model up, with an error that lists the valid ids."""
    try:
        return CATALOG[model_id]
    except KeyError:
        raise KeyError(
            f"unknown model {model_id!r}; known models: {', '.join(MODEL_IDS)}"
        ) from None
