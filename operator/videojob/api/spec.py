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

_QUANTITY = r"^[0-9]+([.][0-9]+)?(Ki|Mi|Gi|Ti|KiB|MiB|GiB|TiB|K|M|G|T|KB|MB|GB|TB)?$"
_UNITS = {
    "": 1,
    "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}  # fmt: skip


def parse_bytes(quantity: str) -> int:
    """Bytes in a Kubernetes-style quantity ("24Gi", "80GB", "24GiB")."""
    match = re.match(r"^([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)$", quantity.strip())
    if not match or match.group(2) not in _UNITS:
        raise ValueError(
            f"{quantity!r} is not a memory size; write e.g. 24Gi, 24GiB or 80GB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


MemoryQuantity = Annotated[
    str,
    Field(max_length=32),
    Cel(
        rule=f"self.matches('{_QUANTITY}')",
        message="must be a memory size such as 24Gi, 24GiB or 80GB",
        check=lambda v: re.match(_QUANTITY, v) is not None,
    ),
]


class ModelSpec(WireModel):
    """Which model runs, from where, in which precision."""

    name: ModelId = Field(description="Catalog id of the model (see `videojob plan --help`).")
    source: Optional[SourceUri] = Field(
        default=None,
        description="Where the weights live; default: the catalog's hub id from the offline cache.",
    )
    dtype: DType = Field(default="bfloat16", description="Compute dtype of the weights.")


class VideoSpec(WireModel):
    """Output geometry; unset values take the model's native ones."""

    width: Optional[int] = Field(default=None, ge=16, le=4096)
    height: Optional[int] = Field(default=None, ge=16, le=4096)
    frames: Optional[int] = Field(default=None, ge=1, le=1024)
    fps: Optional[int] = Field(default=None, ge=1, le=60)


class SamplingSpec(WireModel):
    """Denoising loop settings; unset values take the model's defaults."""

    steps: Optional[int] = Field(default=None, ge=1, le=200)
    guidance_scale: Optional[float] = Field(default=None, ge=0.0, le=30.0)


class CacheSpec(WireModel):
    """Step-cache reuse: skip transformer evaluations that barely change."""

    policy: CachePolicy = Field(
        default="auto", description="off, auto (the best cache the model supports), or a named cache."
    )
    threshold: Optional[float] = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Relative-change threshold below which a step is reused; higher skips more.",
    )


class ResourcesSpec(WireModel):
    """Limits and preferences the planner and scheduler honour."""

    max_gpus: int = Field(default=MAX_GPUS_PER_JOB, ge=1, le=MAX_GPUS_PER_JOB, alias="maxGPUs")
    priority: int = Field(default=0, ge=-1000, le=1000)
    allow_offload: bool = Field(default=True)
    gpu_memory: Optional[MemoryQuantity] = Field(
        default=None, description="Override the GPU memory the planner assumes per GPU."
    )


class ParallelSpec(WireModel):
    """Override the planner's parallel layout (xDiT USP degrees)."""

    ulysses: int = Field(default=1, ge=1, le=MAX_GPUS_PER_JOB)
    ring: int = Field(default=1, ge=1, le=MAX_GPUS_PER_JOB)
    cfg: int = Field(default=1, ge=1, le=2)

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


class OutputSpec(WireModel):
    """Where the mp4, poster and result JSON go."""

    uri: OutputUri


class VideoJobSpec(WireModel):
    """The whole request. See ``rules.py`` for the cross-field rules."""

    model: ModelSpec
    task: Optional[Task] = Field(default=None, description="t2v, i2v or identity; default: the model's task.")
    prompt: str = Field(min_length=1, max_length=2000)
    negative_prompt: str = Field(default="", max_length=2000)
    seed: Optional[int] = Field(default=None, ge=0, le=SEED_MAX)
    image: Optional[InputUri] = Field(default=None, description="Conditioning image (i2v).")
    face_image: Optional[InputUri] = Field(default=None, description="Face image (identity).")
    video: VideoSpec = Field(default_factory=VideoSpec)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    cache: CacheSpec = Field(default_factory=CacheSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    parallel: Optional[ParallelSpec] = None
    memory: Optional[MemorySpec] = None
    output: Optional[OutputSpec] = None

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
