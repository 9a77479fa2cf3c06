"""Peak GPU memory per rank, and host RAM, for a job under a layout.

Peak per rank = max over stages (encode, denoise, decode) of
  resident weights (by offload mode) + that stage's activations
  + step-cache state (denoise) + conv workspace (untiled decode).
Activations come from the calibration fits; weights from the measured
bytes of the real modules. Under USP every rank holds all weights; more
ranks cut activations (tokens / SP degree; CFG parallel halves the batch).
Capacity checks add the CUDA context and allocator fragmentation, which
``max_memory_allocated`` (what published figures quote) does not see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..catalog import ModelInfo
from .calibration import DTYPE_BYTES, ModelCal

GiB = 1024**3
OFFLOAD_MODES = ("none", "model", "group", "sequential")

# CUDA context per process: seen by nvidia-smi and OOMs, not by the allocator.
CUDA_CONTEXT_BYTES = int(0.5 * GiB)
# Reserved above allocated (caching allocator fragmentation): plan with a margin.
FRAGMENTATION = 0.05
# Untiled 3D-VAE decodes run full-frame convolutions whose cuDNN workspace no
# tensor shows: DESIGN.md measured a ~3.9 GiB gap at 720x480 (CogVideoX-2b,
# diffusers docs vs tracked bytes) only when the decode set the peak, and
# none with tiling. Modelled per decoded pixel until a GPU measures it.
CONV_WORKSPACE_PER_PIXEL = 3.9 * GiB / (720 * 480)
# fp8 layerwise casting stores Linear/Conv weights in 1 byte; norms and
# embeddings stay in the compute dtype (about 4% of a DiT's bytes).
FP8_WEIGHT_FACTOR = 0.52
# Step caches keep residuals of the hidden states between steps: FBCache and
# DBCache keep the first block's residual and the cached output residual for
# video and text streams; TeaCache one residual.
CACHE_RESIDUALS = {"off": 0, "teacache": 1, "fbcache": 3, "dbcache": 3}
# Host RAM a runtime process needs besides weights (torch, Ray worker, CUDA libs).
PROCESS_HOST_BYTES = 3 * GiB
# Group offload with CUDA streams keeps pinned copies: about 2x the weights.
GROUP_OFFLOAD_HOST_FACTOR = 2.0


@dataclass(frozen=True)
class Layout:
    """How one job runs: xDiT degrees, memory strategies, step cache."""

    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    offload: str = "none"
    vae_tiling: bool = False
    vae_slicing: bool = False
    fp8_weights: bool = False
    cache: str = "off"
    # Our runtime frees the text encoder after encoding when nothing is
    # offloaded; diffusers' default pipeline keeps it (the published anchors).
    free_text_encoder: bool = True

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def gpus(self) -> int:
        return self.sp * self.cfg

    def summary(self) -> str:
        parts = [f"{k}{v}" for k, v in (("ulysses", self.ulysses), ("ring", self.ring), ("cfg", self.cfg)) if v > 1]
        text = " x ".join(parts) if parts else "1 GPU"
        text += ", no offload" if self.offload == "none" else f", {self.offload} offload"
        if self.vae_tiling:
            text += ", VAE tiling"
        if self.vae_slicing:
            text += ", VAE slicing"
        if self.fp8_weights:
            text += ", fp8 weights"
        if self.cache != "off":
            text += f", {self.cache}"
        return text


@dataclass(frozen=True)
class Job:
    """The numbers of a resolved spec that memory and latency depend on."""

    model: ModelInfo
    width: int
    height: int
    frames: int
    steps: int
    guidance: float
    dtype: str = "bfloat16"

    @property
    def tokens(self) -> int:
        return self.model.arch.tokens(self.width, self.height, self.frames)

    @property
    def cfg_batch(self) -> int:
        """Sequences per denoiser call without CFG parallel: 2 with guidance."""
        return 2 if self.guidance > 1.0 else 1


@dataclass
class MemoryEstimate:
    """Bytes per rank by stage and part; ``peak`` is what max_memory_allocated would show."""

    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    host_bytes_per_rank: float = 0.0
    ranks: int = 1

    def stage_total(self, stage: str) -> float:
        return sum(self.stages[stage].values())

    @property
    def peak(self) -> float:
        return max(self.stage_total(s) for s in self.stages)

    @property
    def peak_stage(self) -> str:
        return max(self.stages, key=self.stage_total)

    @property
    def need(self) -> float:
        """GPU bytes a rank must have free: peak plus context and fragmentation."""
        return self.peak * (1 + FRAGMENTATION) + CUDA_CONTEXT_BYTES

    @property
    def host_bytes(self) -> float:
        return self.host_bytes_per_rank * self.ranks


class MemoryModel:
    """Memory of one job under any layout; per-job parts computed once.

    ``estimate`` gives the full breakdown; ``need`` and ``host`` give the same
    totals without building it (the planner scores hundreds of layouts).
    """

    def __init__(self, cal: ModelCal, job: Job):
        self.cal, self.job = cal, job
        arch = job.model.arch
        self.elt = DTYPE_BYTES[job.dtype]
        self.hidden = job.model.attention_heads * arch.head_dim
        self.tokens = job.tokens
        self.text_tokens = arch.text_tokens
        self.encode_act = cal.encode_bytes.get(job.dtype) or max(cal.encode_bytes.values())
        self.decode_act = {
            t: cal.decode.bytes(job.width, job.height, job.frames, t, job.dtype) for t in (False, True)
        }
        self.workspace = (
            CONV_WORKSPACE_PER_PIXEL * job.width * job.height if arch.vae_temporal > 1 else 0.0
        )
        self.latents = 2 * arch.latent_channels * (self.tokens * arch.patch_t * arch.patch_hw**2) * 4
        self._resident_cache: dict[tuple, dict[str, float]] = {}
        self._resident_sum: dict[tuple, float] = {}
        self._host_per_rank: dict[tuple, float] = {}

    def weights(self, fp8: bool) -> dict[str, float]:
        out = {}
        for name, comp in self.cal.components.items():
            w = float(comp.weights(self.job.dtype))
            if fp8 and name == self.cal.denoiser:
                w *= FP8_WEIGHT_FACTOR
            out[name] = w
        return out

    def resident(self, layout: Layout, active: str) -> dict[str, float]:
        """Weights on the GPU while ``active`` runs, by offload mode."""
        key = (layout.offload, layout.free_text_encoder, layout.fp8_weights, active)
        if key not in self._resident_cache:
            self._resident_cache[key] = self._resident(layout, active)
        return self._resident_cache[key]

    def resident_bytes(self, layout: Layout, active: str) -> float:
        key = (layout.offload, layout.free_text_encoder, layout.fp8_weights, active)
        total = self._resident_sum.get(key)
        if total is None:
            total = self._resident_sum[key] = sum(self.resident(layout, active).values())
        return total

    def _resident(self, layout: Layout, active: str) -> dict[str, float]:
        weights = self.weights(layout.fp8_weights)
        mode = layout.offload
        if mode == "none":
            if layout.free_text_encoder and active not in ("text_encoder", "image_encoder"):
                # Our runtime frees the encoders once the prompt and image are encoded.
                weights.pop("text_encoder", None)
                weights.pop("image_encoder", None)
            return weights
        if mode == "model":
            return {active: weights[active]}
        comp = self.cal.components[active]
        if mode == "group":
            # Block-level groups: one group resident and the next prefetched on
            # a stream; the rest of the module (embeddings, heads) is a group too.
            if comp.num_blocks == 0:
                return {active: weights[active]}
            scale = weights[active] / comp.weights(self.job.dtype)  # fp8 storage shrinks all groups alike
            block = comp.block(self.job.dtype) * scale
            if comp.unmatched_bytes is not None:
                rest = comp.unmatched_bytes[self.job.dtype] * scale
            else:
                rest = max(weights[active] - comp.num_blocks * block, 0.0)
            return {active: min(2 * block + rest, weights[active])}
        return {active: float(comp.leaf(self.job.dtype))}  # sequential: one leaf at a time

    def _denoise_parts(self, layout: Layout) -> tuple[float, float, float, float]:
        """(activations, ring buffers, step cache, latents) per rank."""
        batch = 1 if layout.cfg == 2 else self.job.cfg_batch
        per_rank = self.tokens / layout.sp
        act = self.cal.denoise.bytes(per_rank, batch, self.job.dtype)
        # Ring attention holds a peer's K and V block while computing its own.
        ring = 2 * per_rank * self.hidden * self.elt * batch if layout.ring > 1 else 0.0
        residuals = CACHE_RESIDUALS.get(layout.cache, 0)
        cache = residuals * (per_rank + self.text_tokens) * self.hidden * self.elt * batch
        return act, ring, cache, self.latents * batch

    def stage_totals(self, layout: Layout) -> tuple[float, ...]:
        """Bytes per rank of each stage (encode, [image], denoise, decode), without the breakdown."""
        encode = self.resident_bytes(layout, "text_encoder") + self.encode_act
        image = ()
        if self.cal.image_encode_bytes is not None:
            image = (self.resident_bytes(layout, self.cal.image_encoder) + self.cal.image_encode_bytes,)
        denoise = self.resident_bytes(layout, self.cal.denoiser) + sum(self._denoise_parts(layout))
        decode = self.resident_bytes(layout, "vae") + self.decode_act[layout.vae_tiling]
        if not layout.vae_tiling:
            decode += self.workspace
        return (encode, *image, denoise, decode)

    def need(self, layout: Layout) -> float:
        return max(self.stage_totals(layout)) * (1 + FRAGMENTATION) + CUDA_CONTEXT_BYTES

    def host(self, layout: Layout) -> float:
        """Host RAM for all ranks of the pod."""
        key = (layout.offload, layout.fp8_weights)
        per_rank = self._host_per_rank.get(key)
        if per_rank is None:
            weights = self.weights(layout.fp8_weights)
            if layout.offload == "none":
                per_rank = PROCESS_HOST_BYTES + max(weights.values())  # loading streams one component at a time
            elif layout.offload == "group":
                per_rank = PROCESS_HOST_BYTES + GROUP_OFFLOAD_HOST_FACTOR * sum(weights.values())
            else:
                per_rank = PROCESS_HOST_BYTES + sum(weights.values())
            self._host_per_rank[key] = per_rank
        return per_rank * layout.gpus

    def estimate(self, layout: Layout) -> MemoryEstimate:
        est = MemoryEstimate(ranks=layout.gpus)
        est.stages["encode"] = {**self.resident(layout, "text_encoder"), "activations": self.encode_act}
        if self.cal.image_encode_bytes is not None:
            est.stages["image"] = {
                **self.resident(layout, self.cal.image_encoder),
                "activations": self.cal.image_encode_bytes,
            }
        act, ring, cache, latents = self._denoise_parts(layout)
        denoise = {**self.resident(layout, self.cal.denoiser), "activations": act}
        if ring:
            denoise["ring buffers"] = ring
        if cache:
            denoise["step cache"] = cache
        denoise["latents"] = latents
        est.stages["denoise"] = denoise
        decode = {**self.resident(layout, "vae"), "activations": self.decode_act[layout.vae_tiling]}
        if not layout.vae_tiling and self.workspace:
            decode["conv workspace"] = self.workspace
        est.stages["decode"] = decode
        est.host_bytes_per_rank = self.host(layout) / layout.gpus
        return est


def estimate_memory(model_cal: ModelCal, job: Job, layout: Layout) -> MemoryEstimate:
    return MemoryModel(model_cal, job).estimate(layout)
