"""Published figures the planner is checked against, each with its source.

Every figure is one of two kinds:

* in-sample: it was used to fit a calibrated constant (``fits`` names the
  constant, ``fit.py`` does the fitting when ``videojob profile`` writes
  calibration.json). Its error says how well the fit reproduces the very
  figures it was fitted to, nothing more.
* held-out: no constant was fitted to it. Its error is the planner's error.

``benchmarks/planner_bench.py`` reports the two groups separately. A figure
says how it was measured: ``max_memory_allocated`` (the caching allocator's
peak, what the planner's ``peak`` is, GB as torch's /1024**3: GiB), or
``unstated`` (the source gives a number, not how it got it: nvidia-smi would
add the CUDA context and the allocator's reserve). Bounds: ``about`` (the
figure), ``below`` ("under 4 GB"), ``from`` ("starting from 5 GB": the
smallest the source saw).

Searched (diffusers docs, model cards, the models' GitHub READMEs, xDiT
docs): CogVideoX-2b, CogVideoX-5b, CogVideoX1.5-5B, ConsisID, Wan2.1. No
memory figure with a stated configuration was found for I2VGen-XL,
AnimateDiff, CogVideoX-5b-I2V or Wan2.1-14B; none is invented for them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .memory import Layout

DIFFUSERS_COGVIDEOX = ("diffusers docs, CogVideoX pipeline, 'Memory optimization' "
                       "(https://huggingface.co/docs/diffusers/api/pipelines/cogvideox; "
                       "huggingface/diffusers docs/source/en/api/pipelines/cogvideox.md)")
DIFFUSERS_CONSISID = ("diffusers docs, ConsisID pipeline, 'Memory optimization' table, column Max Memory "
                      "Allocated (https://huggingface.co/docs/diffusers/api/pipelines/consisid; "
                      "huggingface/diffusers docs/source/en/api/pipelines/consisid.md; the same table in "
                      "PKU-YuanGroup/ConsisID README)")
COGVIDEO_README = ("THUDM/CogVideo README and the THUDM/CogVideoX-5b model card, 'Single GPU Memory Usage' "
                   "(https://github.com/THUDM/CogVideo; https://huggingface.co/THUDM/CogVideoX-5b): "
                   "'diffusers ... with all optimizations enabled' = enable_sequential_cpu_offload, "
                   "vae.enable_slicing, vae.enable_tiling, on A100/H100")
WAN_README = ("Wan-Video/Wan2.1 README (https://github.com/Wan-Video/Wan2.1): 'The T2V-1.3B model requires "
              "only 8.19 GB VRAM'; its RTX 4090 example runs generate.py --task t2v-1.3B --size 832*480 "
              "--offload_model True --t5_cpu")
XDIT_COGVIDEOX = ("xDiT docs, 'CogVideoX performance' (https://github.com/xdit-project/xDiT, "
                  "docs/performance/cogvideo.md): CogVideoX-5b, 49x720x480, 50 steps")


@dataclass(frozen=True)
class MemoryAnchor:
    """A published peak for one model, size and memory setup."""

    label: str
    model: str
    width: int
    height: int
    frames: int
    dtype: str
    # The setup as the source ran it: diffusers as shipped keeps the text
    # encoder on the GPU and the VAE's unread conv cache (our runtime does not).
    layout: Layout
    published_gb: float
    measure: str  # "max_memory_allocated" or "unstated"
    bound: str  # "about", "below" or "from"
    source: str
    fits: str | None = None  # the calibrated constant fitted to it (in-sample); None: held-out
    # Stages that run on the GPU in the source's setup (None: all of them).
    gpu_stages: tuple[str, ...] | None = None
    note: str = ""

    @property
    def in_sample(self) -> bool:
        return self.fits is not None


@dataclass(frozen=True)
class LatencyAnchor:
    """A published seconds-per-step for CogVideoX-5b on some GPUs and degrees."""

    gpu: str
    ulysses: int
    ring: int
    cfg: int
    published_s_per_step: float
    source: str = XDIT_COGVIDEOX
    fits: str | None = None

    @property
    def in_sample(self) -> bool:
        return self.fits is not None


_AS_SHIPPED = dict(free_text_encoder=False, skip_unread_conv_cache=False)
_FACE_MODELS = ("the source's script also keeps ConsisID's face models (insightface, EVA-CLIP, facexlib) on the "
                "GPU, outside the pipeline's offload; the planner does not count them")

MEMORY_ANCHORS: tuple[MemoryAnchor, ...] = (
    # CogVideoX-2b, fp16, 49 x 720x480 (the doc's own setup): the conv
    # workspace is fitted to the two untiled figures; the tiled ones fix nothing
    # but were seen while choosing that term, so they are in-sample too.
    MemoryAnchor("CogVideoX-2b none (text encoder kept)", "cogvideox-2b", 720, 480, 49, "float16",
                 Layout(**_AS_SHIPPED), 33.0, "max_memory_allocated", "about", DIFFUSERS_COGVIDEOX,
                 fits="conv_workspace_bytes_per_pixel"),
    MemoryAnchor("CogVideoX-2b model offload", "cogvideox-2b", 720, 480, 49, "float16",
                 Layout(offload="model", **_AS_SHIPPED), 19.0, "max_memory_allocated", "about",
                 DIFFUSERS_COGVIDEOX, fits="conv_workspace_bytes_per_pixel"),
    MemoryAnchor("CogVideoX-2b model offload + VAE tiling", "cogvideox-2b", 720, 480, 49, "float16",
                 Layout(offload="model", vae_tiling=True, **_AS_SHIPPED), 11.0, "max_memory_allocated",
                 "about", DIFFUSERS_COGVIDEOX, fits="conv_workspace_bytes_per_pixel",
                 note="tiled: no workspace term; it showed the term appears only untiled"),
    MemoryAnchor("CogVideoX-2b sequential offload + VAE tiling", "cogvideox-2b", 720, 480, 49, "float16",
                 Layout(offload="sequential", vae_tiling=True, **_AS_SHIPPED), 4.0, "max_memory_allocated",
                 "below", DIFFUSERS_COGVIDEOX, fits="conv_workspace_bytes_per_pixel",
                 note="the doc gives 'under 4 GB' for sequential offload; DESIGN.md reads it with tiling"),
    # ConsisID, bf16, 49 x 720x480; each row adds to the previous one
    # ("overlay the previous"): model offload then sequential means sequential.
    MemoryAnchor("ConsisID none (text encoder kept)", "consisid", 720, 480, 49, "bfloat16",
                 Layout(**_AS_SHIPPED), 37.0, "max_memory_allocated", "about", DIFFUSERS_CONSISID,
                 note=_FACE_MODELS),
    MemoryAnchor("ConsisID model offload", "consisid", 720, 480, 49, "bfloat16",
                 Layout(offload="model", **_AS_SHIPPED), 22.0, "max_memory_allocated", "about",
                 DIFFUSERS_CONSISID, note=_FACE_MODELS),
    MemoryAnchor("ConsisID sequential offload", "consisid", 720, 480, 49, "bfloat16",
                 Layout(offload="sequential", **_AS_SHIPPED), 16.0, "max_memory_allocated", "about",
                 DIFFUSERS_CONSISID, note=_FACE_MODELS),
    MemoryAnchor("ConsisID sequential offload + VAE slicing", "consisid", 720, 480, 49, "bfloat16",
                 Layout(offload="sequential", vae_slicing=True, **_AS_SHIPPED), 16.0, "max_memory_allocated",
                 "about", DIFFUSERS_CONSISID, note="slicing splits the batch; one video: no change. " + _FACE_MODELS),
    MemoryAnchor("ConsisID sequential offload + VAE slicing + tiling", "consisid", 720, 480, 49, "bfloat16",
                 Layout(offload="sequential", vae_slicing=True, vae_tiling=True, **_AS_SHIPPED), 5.0,
                 "max_memory_allocated", "about", DIFFUSERS_CONSISID, note=_FACE_MODELS),
    MemoryAnchor("CogVideoX-5b sequential offload + VAE slicing + tiling", "cogvideox-5b", 720, 480, 49,
                 "bfloat16", Layout(offload="sequential", vae_slicing=True, vae_tiling=True, **_AS_SHIPPED),
                 5.0, "unstated", "from", COGVIDEO_README),
    MemoryAnchor("CogVideoX1.5-5B sequential offload + VAE slicing + tiling", "cogvideox1.5-5b", 1360, 768, 81,
                 "bfloat16", Layout(offload="sequential", vae_slicing=True, vae_tiling=True, **_AS_SHIPPED),
                 10.0, "unstated", "from", COGVIDEO_README),
    MemoryAnchor("Wan2.1-1.3B T5 on the CPU, model offloaded before decode", "wan2.1-t2v-1.3b", 832, 480, 81,
                 "bfloat16", Layout(offload="model", free_text_encoder=True), 8.19, "unstated", "about",
                 WAN_README, gpu_stages=("denoise", "decode"),
                 note="Wan's own code, not diffusers (its VAE runs in float32, the planner counts the job "
                      "dtype); --t5_cpu keeps the encode stage off the GPU"),
)

# xDiT's CogVideoX-5b s/step. The 1-GPU figures fix the effective FLOP/s per
# GPU kind and the L40 2-GPU figures fix the per-doubling overheads; the rest
# is predicted from them.
LATENCY_ANCHORS: tuple[LatencyAnchor, ...] = (
    LatencyAnchor("l40", 1, 1, 1, 6.28, fits="gpu_speed.l40"),
    LatencyAnchor("l40", 2, 1, 1, 3.63, fits="ulysses_overhead"),
    LatencyAnchor("l40", 1, 2, 1, 3.65, fits="ring_overhead"),
    LatencyAnchor("l40", 1, 1, 2, 3.05, fits="cfg_overhead"),
    LatencyAnchor("l40", 2, 1, 2, 1.80),
    LatencyAnchor("l40", 3, 2, 2, 0.82),
    LatencyAnchor("a100", 1, 1, 1, 4.07, fits="a100_flops_per_s"),
    LatencyAnchor("a100", 1, 1, 2, 2.12),
    LatencyAnchor("a100", 2, 1, 2, 1.27),
)
LATENCY_JOB = ("cogvideox-5b", 720, 480, 49)


def memory_anchor(fits: str) -> list[MemoryAnchor]:
    return [a for a in MEMORY_ANCHORS if a.fits == fits]


def latency_anchor(fits: str) -> LatencyAnchor:
    return next(a for a in LATENCY_ANCHORS if a.fits == fits)
