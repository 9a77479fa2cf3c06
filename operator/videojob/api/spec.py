"""VideoJob spec: what the user asks for.

Field-level bounds live on the fields; rules that need the model or several
fields live in ``rules.py`` so the CRD can carry them as CEL too. Sizes,
frames, steps and guidance may be left out: ``resolved()`` fills them from
the catalog entry of the chosen model.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Optional

from pydantic import Field

from ..catalog import CACHE_POLICIES, MODEL_IDS, TASKS, get_model
from .common import Cel, WireModel
from .uris import InputUri, OutputUri, SourceUri

ModelId = Literal[MODEL_IDS]  # type: ignore[valid-type]
Task = Literal[TASKS]  # type: ignore[valid-type]
CachePolicy = Literal[CACHE_POLICIES]  # type: ignore[valid-type]
DType = Literal["bfloat16", "float16", "float32"]

MAX_GPUS_PER_JOB = 8
SEED_MAX = 2**32 - 1

# A Kubernetes memory quantity (the syntax of a container's memory limit): a
# plain or decimal number with an optional binary (Ki..Ei) or decimal (k..E)
# suffix. Exponents and milli are left out: they make no sense for bytes.
_QUANTITY = r"^[0-9]+([.][0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
_ZERO = r"^[0.]+[A-Za-z]*$"
_UNITS = {
    "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    # Accepted by the CLI's --gpu-memory only (not a Kubernetes spelling):
    "K": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}  # fmt: skip


def parse_bytes(quantity: str) -> int:
    """Bytes in a memory quantity ("24Gi", "80G"; the CLI also takes "24GiB", "80GB")."""
    match = re.match(r"^([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)$", quantity.strip())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(
            f"{quantity!r} is not a memory size; write e.g. 24Gi or 80G"
        )
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"{quantity!r} is zero; a memory size must be positive")
    return value


MemoryQuantity = Annotated[
    str,
    Field(max_length=32),
    Cel(
        rule=f"self.matches('{_QUANTITY}')",
        message="must be a Kubernetes memory quantity such as 24Gi or 80G (suffixes Ki Mi Gi Ti Pi Ei or k M G T P E)",
        check=lambda v: re.match(_QUANTITY, v) is not None,
    ),
    Cel(
        rule=f"!self.matches('{_ZERO}')",
        message="must be more than zero",
        check=lambda v: re.match(_ZERO, v) is None,
    ),
]


class ModelSpec(WireModel):
    """Which model runs, from where, in which precision."""

    name: ModelId = Field(description="Catalog id of the model, e.g. cogvideox-5b (README: Models).")
    source: Optional[SourceUri] = Field(
        default=None,
        description="Where the weights live: hf://ORG/NAME[@REVISION] (from the offline hub cache), "
                    "pvc://CLAIM/path, local://path or s3://BUCKET/prefix (a diffusers model directory; "
                    "s3:// is downloaded once per pod into the cache volume). "
                    "Default: the catalog's hub id.",
    )
    dtype: DType = Field(default="bfloat16", description="Compute dtype of the weights: bfloat16 (default), "
                                                         "float16 or float32.")


class VideoSpec(WireModel):
    """Output geometry; unset values take the model's native ones."""

    width: Optional[int] = Field(default=None, ge=16, le=4096,
                                 description="Width in pixels, a multiple of the model's size step. "
                                             "Default: the model's native width (e.g. 720).")
    height: Optional[int] = Field(default=None, ge=16, le=4096,
                                  description="Height in pixels, a multiple of the model's size step. "
                                              "Default: the model's native height (e.g. 480).")
    frames: Optional[int] = Field(default=None, ge=1, le=1024,
                                  description="Number of frames, of the form the model needs (CogVideoX 8k+1, "
                                              "Wan 4k+1). Default: the model's native count (e.g. 49).")
    fps: Optional[int] = Field(default=None, ge=1, le=60,
                               description="Frames per second of the mp4 (1-60). Default: the model's own (e.g. 8).")


class SamplingSpec(WireModel):
    """Denoising loop settings; unset values take the model's defaults."""

    steps: Optional[int] = Field(default=None, ge=1, le=200,
                                 description="Denoising steps (1-200). Default: the model's (e.g. 50).")
    guidance_scale: Optional[float] = Field(default=None, ge=0.0, le=30.0,
                                            description="Classifier-free guidance scale (0-30); 1 or less turns "
                                                        "guidance off. Default: the model's (e.g. 6.0).")


class CacheSpec(WireModel):
    """Step-cache reuse: skip transformer evaluations that barely change."""

    policy: CachePolicy = Field(
        default="auto", description="off, auto (default: the best cache the model supports), teacache, "
                                    "fbcache or dbcache. Quote \"off\" in YAML."
    )
    threshold: Optional[float] = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Relative change (0-1, unitless) below which a step's transformer work is reused; "
                    "higher skips more and changes the video more. Default: the cache's own.",
    )


class ResourcesSpec(WireModel):
    """Limits and preferences the planner and scheduler honour."""

    max_gpus: int = Field(default=MAX_GPUS_PER_JOB, ge=1, le=MAX_GPUS_PER_JOB, alias="maxGPUs",
                          description="Most GPUs the job may use, all in one pod (1-8, default 8).")
    priority: int = Field(default=0, ge=-1000, le=1000,
                          description="Queue priority (-1000..1000, default 0); higher runs first.")
    preemptible: bool = Field(default=True, description="Whether a job of higher priority may stop this one at a "
                                                         "step boundary (it checkpoints first, then waits in the "
                                                         "queue with its priority and age; default true).")
    allow_offload: bool = Field(default=True, description="Whether the planner may keep weights on the host "
                                                          "(CPU offload) when nothing fits without (default true).")
    gpu_memory: Optional[MemoryQuantity] = Field(
        default=None, description="GPU memory the planner assumes per GPU, a Kubernetes quantity such as 24Gi "
                                  "(default: the inventory's)."
    )
    gpu_class: Optional[str] = Field(
        default=None, alias="gpuClass", min_length=1, max_length=40, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Pin the job to one GPU class of the operator's inventory (a DNS-1123 label such as a100-80; "
                    "default: the planner picks the class).")


class ParallelSpec(WireModel):
    """Override the planner's parallel layout (xDiT USP degrees)."""

    ulysses: int = Field(default=1, ge=1, le=MAX_GPUS_PER_JOB,
                         description="Ulysses sequence-parallel degree (splits attention heads; default 1).")
    ring: int = Field(default=1, ge=1, le=MAX_GPUS_PER_JOB,
                      description="Ring-attention sequence-parallel degree (default 1).")
    cfg: int = Field(default=1, ge=1, le=2,
                     description="CFG-parallel degree: 2 runs the conditional and unconditional passes on "
                                 "two GPUs (default 1).")

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg


OffloadMode = Literal["none", "model", "group", "sequential"]


class MemorySpec(WireModel):
    """Override the planner's memory strategies (unset fields stay the planner's choice).

    For a known-good setting: the planner still checks it, and refuses a job
    whose forced layout does not fit, with the reason."""

    offload: Optional[OffloadMode] = Field(
        default=None,
        description="Where weights live while the job runs: none (all on the GPU), model (whole components "
                    "swap in), group (block groups stream in), sequential (one layer at a time; least "
                    "memory, slowest). Offload runs on one GPU only.",
    )
    vae_tiling: Optional[bool] = Field(
        default=None, description="Decode the video in overlapping tiles (less memory, seams blended).")
    vae_slicing: Optional[bool] = Field(
        default=None, description="Decode one video of a batch at a time (no change to the output).")
    decode_offload: Optional[bool] = Field(
        default=None, description="Move the denoiser's weights to the host while the VAE decodes (back for "
                                  "the next job): less GPU memory in decode, a copy each way. Needs offload none.")


class OutputSpec(WireModel):
    """Where the mp4, poster and result JSON go."""

    uri: OutputUri = Field(description="Directory for NAME.mp4, NAME.png and NAME.json: pvc://CLAIM/path "
                                       "local://path or s3://BUCKET/prefix (uploaded, NAME.json last), never outside its "
                                       "root or the namespace's prefix.")


class CheckpointSpec(WireModel):
    """Denoising checkpoints: where a new attempt (a lost rank, pod or driver, an
    out-of-memory re-plan) resumes instead of starting from step 0."""

    every_steps: Optional[int] = Field(
        default=None, ge=0, le=200,
        description="Save after every N denoising steps (0 turns checkpoints off). Default: off for jobs planned "
                    "to take under a minute, else about every 10% of the steps.")
    every_seconds: Optional[float] = Field(
        default=None, ge=5.0, le=3600.0,
        description="Save about every N seconds of denoising (5-3600), turned into steps with the plan's step "
                    "time. Set everySteps or everySeconds, not both.")


class VideoJobSpec(WireModel):
    """The whole request. See ``rules.py`` for the cross-field rules."""

    model: ModelSpec = Field(description="Which model runs, from where, in which precision.")
    task: Optional[Task] = Field(default=None, description="t2v, i2v or identity; default: the model's task.")
    prompt: str = Field(min_length=1, max_length=2000, description="What the video shows (1-2000 characters).")
    negative_prompt: str = Field(default="", max_length=2000, description="What the video should avoid (default none).")
    seed: Optional[int] = Field(default=None, ge=0, le=SEED_MAX,
                                description="Random seed (0 to 2^32-1); the same seed and spec give the same "
                                            "frames. Default: drawn at random and recorded in the result.")
    image: Optional[InputUri] = Field(default=None, description="Conditioning image for i2v: pvc://, local://, "
                                                                "https:// or s3:// (PNG or JPEG).")
    face_image: Optional[InputUri] = Field(default=None, description="Face image for identity (ConsisID), with "
                                                                     "its embeddings at <uri>.npz.")
    video: VideoSpec = Field(default_factory=VideoSpec, description="Size, length and frame rate of the video.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Denoising steps and guidance.")
    cache: CacheSpec = Field(default_factory=CacheSpec, description="Step-cache reuse (default auto).")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec,
                                     description="GPU limits, priority and offload permission.")
    queue_name: Optional[str] = Field(
        default=None, alias="queueName", min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="kueue admission mode: the LocalQueue (in the job's namespace) its Workloads go to "
                    "(default: the operator's kueueDefaultQueue, `default`). Ignored by the built-in scheduler.")
    ttl_seconds_after_finished: Optional[int] = Field(
        default=None, alias="ttlSecondsAfterFinished", ge=0, le=10 * 365 * 86400,
        description="Seconds after the job finished (Succeeded, Failed or Cancelled) before the operator deletes "
                    "the VideoJob, as batch Jobs have it; its outputs stay. 0: at once. Default: the operator's "
                    "ttlSecondsAfterFinished (7 days unless the cluster admin changed it).")
    parallel: Optional[ParallelSpec] = Field(default=None, description="Force the parallel layout (default: the "
                                                                       "planner's choice).")
    memory: Optional[MemorySpec] = Field(default=None, description="Force memory strategies (default: the "
                                                                   "planner's choice).")
    output: Optional[OutputSpec] = Field(default=None, description="Where the video goes.")
    checkpoint: Optional[CheckpointSpec] = Field(
        default=None, description="Denoising checkpoints beside the output (default: on for jobs planned to take "
                                  "a minute or more).")

    @property
    def effective_task(self) -> str:
        return self.task or get_model(self.model.name).tasks[0]

    def resolved(self) -> "VideoJobSpec":
        """A copy with every model-dependent default filled in."""
        info = get_model(self.model.name)
        video = VideoSpec(
            width=self.video.width or info.native_width,
            height=self.video.height or info.native_height,
            frames=self.video.frames or info.native_frames,
            fps=self.video.fps or info.native_fps,
        )
        guidance = self.sampling.guidance_scale
        sampling = SamplingSpec(
            steps=self.sampling.steps or info.default_steps,
            guidance_scale=info.default_guidance if guidance is None else guidance,
        )
        return self.model_copy(
            update={"task": self.effective_task, "video": video, "sampling": sampling}
        )
