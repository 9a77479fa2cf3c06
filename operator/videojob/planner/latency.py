"""Seconds a job takes under a layout: a FLOP model anchored on xDiT's figures.

One denoiser call costs 2 x params x tokens (matmuls) plus 4 x layers x
tokens^2 x hidden (attention), per sequence in the batch. Effective
throughput per GPU kind and the parallel overheads are calibrated constants
(``cal.constants``): fitted by ``fit.py`` to xDiT's published CogVideoX-5b
s/step (``anchors.LATENCY_ANCHORS``: the A100 and L40 1-GPU figures and the
L40 ulysses2 / ring2 / cfg2 figures fit them; the others are held out and
predicted). Offload, decode and encode costs are assumed constants
(documented in calibration.json), meant for ranking layouts.

Denoising checkpoints (spec.checkpoint, default every ~10% of the steps for
jobs planned over a minute) add their writes: each one copies the whole
latents plus the solver's history (at most two more latent-sized tensors:
DPM/UniPC multistep, CogVideoX's DPM ``old_pred_original_sample``) to the host
over PCIe and writes it at the assumed disk bandwidth of weight loads. This
is an upper bound; benchmarks/checkpoint_bench.py measures the real cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..jobrequest import checkpoint_interval, checkpoints_written
from .calibration import DTYPE_BYTES, Constants, ModelCal
from .memory import OFFLOAD_MODES, Job, Layout


@dataclass(frozen=True)
class LatencyEstimate:
    load: float
    encode: float
    denoise: float
    decode: float
    checkpoint: float = 0.0  # all the checkpoints' writes
    checkpoints: int = 0  # how many the run saves

    @property
    def total(self) -> float:
        return self.load + self.encode + self.denoise + self.decode + self.checkpoint

    @property
    def per_step(self) -> float:
        return self.denoise


def call_flops(params: float, tokens: float, layers: int, hidden: int) -> float:
    """FLOPs of one denoiser call on one sequence of ``tokens``."""
    return 2 * params * tokens + 4 * layers * tokens * tokens * hidden


def parallel_factor(layout: Layout, c: Constants) -> float:
    """Time on layout.gpus GPUs relative to one GPU."""
    overhead = (1 + c.ulysses_overhead * math.log2(layout.ulysses)) * (1 + c.ring_overhead * math.log2(layout.ring))
    overhead *= 1 + c.cfg_overhead * (layout.cfg - 1)
    return overhead / layout.gpus


class LatencyModel:
    """Seconds of one job under any layout; per-job parts computed once."""

    def __init__(self, cal: ModelCal, job: Job, gpu: str = "a100"):
        if cal.constants is None:
            raise ValueError("LatencyModel needs a calibration with constants (parse_calibration)")
        c = self.c = cal.constants
        arch = job.model.arch
        speed = c.gpu_speed.get(gpu, c.gpu_speed["generic"])
        denoiser = cal.components[cal.denoiser]
        hidden = job.model.attention_heads * arch.head_dim
        tokens = job.tokens + (arch.text_tokens if arch.kind == "dit" else 0)
        layers = arch.layers if arch.kind == "dit" else 0  # UNets: attention folded into params
        self.job = job
        self.step_one_gpu = job.cfg_batch * call_flops(denoiser.params, tokens, layers, hidden) / (
            c.a100_flops_per_s * speed
        )
        weights = {n: comp.weights(job.dtype) for n, comp in cal.components.items()}
        self.total_weights = sum(weights.values())
        self.denoiser_weights = weights[cal.denoiser]
        self.vae_weights = weights["vae"]
        self.text_weights = weights["text_encoder"]
        self.fp8_denoiser_weights = denoiser.weights(job.dtype, fp8=True)
        self.decode_base = c.decode_s_per_pixel_frame * job.width * job.height * job.frames / speed
        self.load = self.total_weights / c.disk_bytes_per_s
        self.checkpoint_bytes = (c.checkpoint_latent_copies * arch.latent_channels * job.latent_positions
                                 * DTYPE_BYTES[job.dtype])
        self.checkpoint_one = self.checkpoint_bytes / c.pcie_bytes_per_s + self.checkpoint_bytes / c.disk_bytes_per_s

    def decode_offload_seconds(self, layout: Layout) -> float:
        """One move of the denoiser's weights between GPU and host (``.to()``, pageable)."""
        weights = self.fp8_denoiser_weights if layout.fp8_weights else self.denoiser_weights
        return weights / self.c.model_offload_bytes_per_s

    def _raw(self, layout: Layout, offload: str) -> LatencyEstimate:
        c = self.c
        slow_copy = c.pcie_bytes_per_s * c.sequential_efficiency
        step = self.step_one_gpu * parallel_factor(layout, c)
        if offload == "group":
            step *= 1 + c.group_offload_overhead
        elif offload == "sequential":
            step += self.denoiser_weights / slow_copy
        swap = 0.0
        if offload == "model":
            swap = 2 * self.total_weights / c.model_offload_bytes_per_s
        elif offload != "none":
            swap = self.total_weights / c.pcie_bytes_per_s
        denoise = self.job.steps * step * c.cache_evaluated_fraction.get(layout.cache, 1.0)
        decode = self.decode_base * (c.tiling_slowdown if layout.vae_tiling else 1.0)
        encode = c.encode_seconds + swap
        if offload == "sequential":
            decode += self.vae_weights / slow_copy
            encode += self.text_weights / slow_copy
        if layout.decode_offload and offload == "none":
            # To the host before the decode; back before the next job's denoise
            # (a warm group's next job pays it: counted here, once per job).
            decode += self.decode_offload_seconds(layout)
            encode += self.decode_offload_seconds(layout)
        every = checkpoint_interval(self.job.steps, self.job.checkpoint_every_steps,
                                    self.job.checkpoint_every_seconds, denoise,
                                    self.load + encode + denoise + decode)
        count = checkpoints_written(self.job.steps, every)
        return LatencyEstimate(load=self.load, encode=encode, denoise=denoise, decode=decode,
                               checkpoint=count * self.checkpoint_one, checkpoints=count)

    def estimate(self, layout: Layout) -> LatencyEstimate:
        """Seconds under ``layout``. A stronger offload mode is never estimated
        faster than a lighter one on the same degrees: the per-mode constants
        are rough, and the planner ranks lighter offload first."""
        rank = OFFLOAD_MODES.index(layout.offload)
        return max((self._raw(layout, mode) for mode in OFFLOAD_MODES[: rank + 1]), key=lambda e: e.total)


def estimate_latency(cal: ModelCal, job: Job, layout: Layout, gpu: str = "a100") -> LatencyEstimate:
    return LatencyModel(cal, job, gpu).estimate(layout)
