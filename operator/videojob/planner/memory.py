"""Peak GPU memory per rank, and host RAM, for a job under a layout.

Peak per rank = max over stages (encode, denoise, decode) of
  resident weights (by offload mode) + that stage's activations
  + step-cache state (denoise) + conv workspace (untiled decode).
Activations come from the calibration fits; weights from the measured
bytes of the real modules. Under USP every rank holds all weights; more
ranks cut activations (tokens / SP degree; CFG parallel halves the batch).
A pipeline whose guidance is a second denoiser call (Wan) runs two calls at
batch 1 per step, the first call's output kept while the second runs.
Decode runs on the decoding ranks (``ModelInfo.decoding_ranks``); there the
idle denoiser can be moved to the host for the decode (``decode_offload``).
Capacity checks add the CUDA context and allocator fragmentation, which
``max_memory_allocated`` (what published figures quote) does not see.

Host RAM per rank: loading holds every component on the host
(``from_pretrained`` builds the pipeline there before placing it), then the
job holds what the layout parks there (the text encoder after encoding, the
denoiser during a decode offload, everything under offload).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..catalog import ModelInfo
from .calibration import DTYPE_BYTES, ModelCal

GiB = 1024**3
OFFLOAD_MODES = ("none", "model", "group", "sequential")
# Every other number here is a calibrated constant: ``cal.constants`` (values
# and provenance in calibration.json, written by ``videojob profile``).


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
    # Move the denoiser's weights to the host for the VAE decode (offload none
    # only; back before the next job's denoise): strategies/decode_offload.py.
    decode_offload: bool = False
    # Our runtime parks the text encoder on the host after encoding when
    # nothing is offloaded; diffusers' default pipeline keeps it on the GPU
    # (the published anchors).
    free_text_encoder: bool = True
    # Our runtime skips the CogVideoX VAE's never-read conv cache
    # (strategies/vae_conv_cache.py, bit-identical); diffusers as shipped does not.
    skip_unread_conv_cache: bool = True

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def gpus(self) -> int:
        return self.sp * self.cfg

    def summary(self, unit: str = "GPU") -> str:
        parts = [f"{k}{v}" for k, v in (("ulysses", self.ulysses), ("ring", self.ring), ("cfg", self.cfg)) if v > 1]
        text = " x ".join(parts) if parts else f"1 {unit}"
        text += ", no offload" if self.offload == "none" else f", {self.offload} offload"
        if self.vae_tiling:
            text += ", VAE tiling"
        if self.vae_slicing:
            text += ", VAE slicing"
        if self.fp8_weights:
            text += ", fp8 weights"
        if self.decode_offload:
            text += ", denoiser to host for decode"
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
    # spec.checkpoint (None, None: the default rule, jobrequest.checkpoint_interval)
    checkpoint_every_steps: int | None = None
    checkpoint_every_seconds: float | None = None

    @property
    def tokens(self) -> int:
        return self.model.arch.tokens(self.width, self.height, self.frames)

    @property
    def latent_positions(self) -> int:
        """Latent positions of the whole video (tokens before patching)."""
        arch = self.model.arch
        return self.tokens * arch.patch_t * arch.patch_hw**2

    @property
    def cfg_batch(self) -> int:
        """Sequences per step without CFG parallel: 2 with guidance."""
        return 2 if self.guidance > 1.0 else 1

    @property
    def calls_per_step(self) -> int:
        """Denoiser calls per step without CFG parallel (the catalog's fact)."""
        return self.model.denoiser_calls_per_step(self.guidance)


@dataclass
class MemoryEstimate:
    """Bytes per rank by stage and part (the decoding rank's, which holds the
    most); ``peak`` is what max_memory_allocated would show."""

    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    host_bytes_per_rank: float = 0.0
    ranks: int = 1
    # Host RAM per rank by phase: "load" (from_pretrained) and "job" (parked weights).
    host_phases: dict[str, float] = field(default_factory=dict)
    decoding_ranks: int = 1
    fragmentation: float = 0.0
    context_bytes: float = 0.0

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
        return self.peak * (1 + self.fragmentation) + self.context_bytes

    @property
    def host_bytes(self) -> float:
        return self.host_bytes_per_rank * self.ranks


class MemoryModel:
    """Memory of one job under any layout; per-job parts computed once.

    ``estimate`` gives the full breakdown; ``need`` and ``host`` give the same
    totals without building it (the planner scores hundreds of layouts).
    """

    def __init__(self, cal: ModelCal, job: Job):
        if cal.constants is None:
            raise ValueError("MemoryModel needs a calibration with constants (parse_calibration)")
        self.cal, self.job, self.c = cal, job, cal.constants
        arch = job.model.arch
        self.elt = DTYPE_BYTES[job.dtype]
        self.hidden = job.model.attention_heads * arch.head_dim
        self.tokens = job.tokens
        self.text_tokens = arch.text_tokens
        self.encode_act = cal.encode_bytes.get(job.dtype) or max(cal.encode_bytes.values())
        self.decode_act = {
            (tiling, skip): cal.decode_fit(skip).bytes(job.width, job.height, job.frames, tiling, job.dtype)
            for tiling in (False, True) for skip in (False, True)
        }
        self.workspace = (
            self.c.conv_workspace_bytes_per_pixel * job.width * job.height if arch.vae_temporal > 1 else 0.0
        )
        positions = job.latent_positions
        self.latents = 2 * arch.latent_channels * positions * 4
        # One denoiser output (the noise prediction), kept while the next call runs.
        self.call_output = arch.latent_channels * positions * self.elt
        self._resident_cache: dict[tuple, dict[str, float]] = {}
        self._resident_sum: dict[tuple, float] = {}
        self._host_per_rank: dict[tuple, dict[str, float]] = {}

    def weights(self, fp8: bool) -> dict[str, float]:
        """Weights per component; with ``fp8`` the denoiser's as fp8 storage keeps them (measured)."""
        return {name: float(comp.weights(self.job.dtype, fp8 and name == self.cal.denoiser))
                for name, comp in self.cal.components.items()}

    def decoding_ranks(self, layout: Layout) -> int:
        return layout.gpus if self.job.model.decoding_ranks == "all" else 1

    def resident(self, layout: Layout, active: str, decoding: bool = False) -> dict[str, float]:
        """Weights on the GPU while ``active`` runs, by offload mode (``decoding``:
        the VAE decode, where a decode offload has moved the denoiser away)."""
        key = (layout.offload, layout.free_text_encoder, layout.fp8_weights, active,
               decoding and layout.decode_offload)
        if key not in self._resident_cache:
            self._resident_cache[key] = self._resident(layout, active, key[-1])
        return self._resident_cache[key]

    def resident_bytes(self, layout: Layout, active: str, decoding: bool = False) -> float:
        key = (layout.offload, layout.free_text_encoder, layout.fp8_weights, active,
               decoding and layout.decode_offload)
        total = self._resident_sum.get(key)
        if total is None:
            total = self._resident_sum[key] = sum(self.resident(layout, active, decoding).values())
        return total

    def _resident(self, layout: Layout, active: str, decode_offload: bool) -> dict[str, float]:
        weights = self.weights(layout.fp8_weights)
        mode = layout.offload
        if mode == "none":
            if layout.free_text_encoder and active not in ("text_encoder", "image_encoder"):
                # Our runtime parks the encoders on the host once the prompt and image are encoded.
                weights.pop("text_encoder", None)
                weights.pop("image_encoder", None)
            if decode_offload:
                weights.pop(self.cal.denoiser, None)
            return weights
        if mode == "model":
            return {active: weights[active]}
        comp = self.cal.components[active]
        if mode == "group":
            # Block-level groups: one group resident and the next prefetched on
            # a stream; the rest of the module (embeddings, heads) is a group too.
            if comp.num_blocks == 0:
                return {active: weights[active]}
            scale = weights[active] / comp.weights(self.job.dtype)  # fp8 storage: groups shrink alike (approx.)
            block = comp.block(self.job.dtype) * scale
            if comp.unmatched_bytes is not None:
                rest = comp.unmatched_bytes[self.job.dtype] * scale
            else:
                rest = max(weights[active] - comp.num_blocks * block, 0.0)
            return {active: min(2 * block + rest, weights[active])}
        return {active: float(comp.leaf(self.job.dtype))}  # sequential: one leaf at a time

    def _denoise_parts(self, layout: Layout) -> tuple[float, float, float, float]:
        """(activations, ring buffers, step cache, latents) per rank.

        Without CFG parallel a step runs ``cfg_batch`` sequences in
        ``calls_per_step`` calls (CogVideoX: one call at batch 2; Wan: two at
        batch 1, the first call's output kept while the second runs); CFG
        parallel gives each rank one sequence in one call."""
        seqs = 1 if layout.cfg == 2 else self.job.cfg_batch
        calls = 1 if layout.cfg == 2 else self.job.calls_per_step
        batch = seqs // calls
        per_rank = self.tokens / layout.sp
        act = self.cal.denoise.bytes(per_rank, batch, self.job.dtype) + (calls - 1) * self.call_output * batch
        # Ring attention holds a peer's K and V block while computing its own.
        ring = 2 * per_rank * self.hidden * self.elt * batch if layout.ring > 1 else 0.0
        # Step caches keep their residuals for every sequence of the step.
        residuals = self.c.cache_residuals.get(layout.cache, 0)
        cache = residuals * (per_rank + self.text_tokens) * self.hidden * self.elt * seqs
        return act, ring, cache, self.latents * seqs

    def _decode_act(self, layout: Layout) -> float:
        return self.decode_act[(layout.vae_tiling, layout.skip_unread_conv_cache)]

    def stage_totals(self, layout: Layout) -> tuple[float, ...]:
        """Bytes per rank of each stage (encode, [image], denoise, decode), without the breakdown."""
        encode = self.resident_bytes(layout, "text_encoder") + self.encode_act
        image = ()
        if self.cal.image_encode_bytes is not None:
            image = (self.resident_bytes(layout, self.cal.image_encoder) + self.cal.image_encode_bytes,)
        denoise = self.resident_bytes(layout, self.cal.denoiser) + sum(self._denoise_parts(layout))
        decode = self.resident_bytes(layout, "vae", decoding=True) + self._decode_act(layout)
        if not layout.vae_tiling:
            decode += self.workspace
        return (encode, *image, denoise, decode)

    def need(self, layout: Layout) -> float:
        return max(self.stage_totals(layout)) * (1 + self.c.fragmentation) + self.c.cuda_context_bytes

    def decode_sets_peak(self, layout: Layout) -> bool:
        totals = self.stage_totals(layout)
        return totals[-1] >= max(totals)

    def host_phases(self, layout: Layout) -> dict[str, float]:
        """Host RAM per rank (besides the process itself) while loading and during
        the job (on a decoding rank: the others do not park the denoiser)."""
        key = (layout.offload, layout.fp8_weights, layout.free_text_encoder, layout.decode_offload)
        phases = self._host_per_rank.get(key)
        if phases is None:
            loaded = self.weights(False)  # from_pretrained: every component, as loaded (fp8 comes after)
            placed = self.weights(layout.fp8_weights)
            if layout.offload == "none":
                job = 0.0
                if layout.free_text_encoder:  # parked on the host after encoding, for the rest of the job
                    job += placed.get("text_encoder", 0.0) + placed.get("image_encoder", 0.0)
                if layout.decode_offload:  # the denoiser during the decode, on a decoding rank
                    job += placed[self.cal.denoiser]
            elif layout.offload == "group":
                job = self.c.group_offload_host_factor * sum(placed.values())
            else:
                job = sum(placed.values())
            phases = self._host_per_rank[key] = {"load": sum(loaded.values()), "job": job}
        return phases

    def host(self, layout: Layout) -> float:
        """Host RAM for all ranks of the pod: each rank loads its own copy; a
        decode offload parks the denoiser on the decoding ranks only."""
        phases = self.host_phases(layout)
        decoding = self.decoding_ranks(layout)
        others = phases["job"]
        if layout.decode_offload and layout.offload == "none":
            others -= self.weights(layout.fp8_weights)[self.cal.denoiser]
        return (self.c.process_host_bytes * layout.gpus + decoding * max(phases["load"], phases["job"])
                + (layout.gpus - decoding) * max(phases["load"], others))

    def estimate(self, layout: Layout) -> MemoryEstimate:
        est = MemoryEstimate(ranks=layout.gpus, decoding_ranks=self.decoding_ranks(layout),
                             fragmentation=self.c.fragmentation, context_bytes=self.c.cuda_context_bytes)
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
        decode = {**self.resident(layout, "vae", decoding=True), "activations": self._decode_act(layout)}
        if not layout.vae_tiling and self.workspace:
            decode["conv workspace"] = self.workspace
        est.stages["decode"] = decode
        est.host_bytes_per_rank = self.host(layout) / layout.gpus
        est.host_phases = dict(self.host_phases(layout))
        return est


def estimate_memory(model_cal: ModelCal, job: Job, layout: Layout) -> MemoryEstimate:
    return MemoryModel(model_cal, job).estimate(layout)
