"""Seconds a job takes under a layout: a FLOP model anchored on xDiT's figures.

One denoiser call costs 2 x params x tokens (matmuls) plus 4 x layers x
tokens^2 x hidden (attention), per sequence in the batch. Effective
throughput per GPU kind comes from xDiT's published CogVideoX-5b numbers
(49x720x480, 50 steps, s/step: A100 4.07, L40 6.28; xDiT docs, "CogVideoX
performance"). Parallel overheads are fitted to the same tables:
ulysses2 3.63, ring2 3.65, cfg2 3.05, ulysses2 x cfg2 1.80 (L40) give
~16% per doubling of ulysses or ring and ~0% for CFG parallel;
u3 x r2 x cfg2 0.82 is predicted 0.76 (-8%). Offload and VAE costs are
rougher (documented per constant) and meant for ranking layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .calibration import ModelCal
from .memory import OFFLOAD_MODES, Job, Layout

# Effective dense bf16 FLOP/s for video DiT inference, anchored on CogVideoX-5b
# s/step above (A100, L40). H100/H200: 2.2x A100, an estimate from the
# vendors' dense bf16 ratio (989 vs 312 TFLOPS) at a lower efficiency.
GPU_FLOPS = {"a100": 1.0, "l40": 4.07 / 6.28, "h100": 2.2, "h200": 2.3, "generic": 1.0}
ULYSSES_OVERHEAD = 0.156  # per doubling; L40: 3.63 s vs 6.28/2
RING_OVERHEAD = 0.162  # per doubling; L40: 3.65 s vs 6.28/2
CFG_OVERHEAD = 0.0  # L40: cfg2 3.05 s vs 3.14: no measurable overhead
PCIE_BYTES_PER_S = 20e9  # host<->GPU, pinned, effective
# Model offload moves whole components with .to() from pageable memory, on
# and off the GPU: about half the pinned bandwidth, each way.
MODEL_OFFLOAD_BYTES_PER_S = 10e9
SEQUENTIAL_EFFICIENCY = 0.4  # leaf-level offload: synchronous, unpinned copies
GROUP_OFFLOAD_OVERHEAD = 0.08  # block-level with streams: copies mostly overlap
DISK_BYTES_PER_S = 1.5e9  # weight loading from a local volume
# VAE decode, text encode: per-pixel and per-token costs, rough, A100 scale:
# a CogVideoX decode of 49x720x480 takes on the order of 10 s.
DECODE_S_PER_PIXEL_FRAME = 10.0 / (49 * 720 * 480)
TILING_SLOWDOWN = 1.15
ENCODE_SECONDS = 0.5
# Step caches skip a share of denoiser calls at their default thresholds:
# TeaCache on Wan2.1-1.3B 175 -> 88 s, ConsisID 110 -> 70 s at 0.1 (DESIGN.md).
CACHE_EVALUATED_FRACTION = {"off": 1.0, "teacache": 0.6, "fbcache": 0.65, "dbcache": 0.65}

_ANCHOR_FLOPS_PER_S: float | None = None


@dataclass(frozen=True)
class LatencyEstimate:
    load: float
    encode: float
    denoise: float
    decode: float

    @property
    def total(self) -> float:
        return self.load + self.encode + self.denoise + self.decode

    @property
    def per_step(self) -> float:
        return self.denoise


def call_flops(params: float, tokens: float, layers: int, hidden: int) -> float:
    """FLOPs of one denoiser call on one sequence of ``tokens``."""
    return 2 * params * tokens + 4 * layers * tokens * tokens * hidden


def _a100_flops_per_s() -> float:
    """Effective A100 FLOP/s from CogVideoX-5b: 4.07 s/step at batch 2 (CFG)."""
    global _ANCHOR_FLOPS_PER_S
    if _ANCHOR_FLOPS_PER_S is None:
        tokens = 17550 + 226  # 13 x 30 x 45 patches + text
        flops = 2 * call_flops(5.57e9, tokens, 42, 48 * 64)
        _ANCHOR_FLOPS_PER_S = flops / 4.07
    return _ANCHOR_FLOPS_PER_S


def parallel_factor(layout: Layout) -> float:
    """Time on layout.gpus GPUs relative to one GPU."""
    overhead = (1 + ULYSSES_OVERHEAD * math.log2(layout.ulysses)) * (1 + RING_OVERHEAD * math.log2(layout.ring))
    overhead *= 1 + CFG_OVERHEAD * (layout.cfg - 1)
    return overhead / layout.gpus


class LatencyModel:
    """Seconds of one job under any layout; per-job parts computed once."""

    def __init__(self, cal: ModelCal, job: Job, gpu: str = "a100"):
        arch = job.model.arch
        speed = GPU_FLOPS.get(gpu, 1.0)
        denoiser = cal.components[cal.denoiser]
        hidden = job.model.attention_heads * arch.head_dim
        tokens = job.tokens + (arch.text_tokens if arch.kind == "dit" else 0)
        layers = arch.layers if arch.kind == "dit" else 0  # UNets: attention folded into params
        self.job = job
        self.step_one_gpu = job.cfg_batch * call_flops(denoiser.params, tokens, layers, hidden) / (
            _a100_flops_per_s() * speed
        )
        weights = {n: c.weights(job.dtype) for n, c in cal.components.items()}
        self.total_weights = sum(weights.values())
        self.denoiser_weights = weights[cal.denoiser]
        self.vae_weights = weights["vae"]
        self.text_weights = weights["text_encoder"]
        self.decode_base = DECODE_S_PER_PIXEL_FRAME * job.width * job.height * job.frames / speed
        self.load = self.total_weights / DISK_BYTES_PER_S

    def _raw(self, layout: Layout, offload: str) -> LatencyEstimate:
        slow_copy = PCIE_BYTES_PER_S * SEQUENTIAL_EFFICIENCY
        step = self.step_one_gpu * parallel_factor(layout)
        if offload == "group":
            step *= 1 + GROUP_OFFLOAD_OVERHEAD
        elif offload == "sequential":
            step += self.denoiser_weights / slow_copy
        swap = 0.0
        if offload == "model":
            swap = 2 * self.total_weights / MODEL_OFFLOAD_BYTES_PER_S
        elif offload != "none":
            swap = self.total_weights / PCIE_BYTES_PER_S
        denoise = self.job.steps * step * CACHE_EVALUATED_FRACTION.get(layout.cache, 1.0)
        decode = self.decode_base * (TILING_SLOWDOWN if layout.vae_tiling else 1.0)
        encode = ENCODE_SECONDS + swap
        if offload == "sequential":
            decode += self.vae_weights / slow_copy
            encode += self.text_weights / slow_copy
        return LatencyEstimate(load=self.load, encode=encode, denoise=denoise, decode=decode)

    def estimate(self, layout: Layout) -> LatencyEstimate:
        """Seconds under ``layout``. A stronger offload mode is never estimated
        faster than a lighter one on the same degrees: the per-mode constants
        are rough, and the planner ranks lighter offload first."""
        rank = OFFLOAD_MODES.index(layout.offload)
        return max((self._raw(layout, mode) for mode in OFFLOAD_MODES[: rank + 1]), key=lambda e: e.total)


def estimate_latency(cal: ModelCal, job: Job, layout: Layout, gpu: str = "a100") -> LatencyEstimate:
    return LatencyModel(cal, job, gpu).estimate(layout)
