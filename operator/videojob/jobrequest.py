"""A job's request to the runtime, from its spec and chosen layout: one place for both drivers.

``videojob run`` (runtime/local.py) and the operator's driver requests
(controller) build the runtime's ``JobRequest`` fields here, so the two
cannot map a spec field differently. No torch: the operator imports it.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

from .api import VideoJob
from .catalog import get_model

SEED_LIMIT = 2**32

# JobRequest fields that change the frames a job produces: a checkpoint's
# fingerprint (runtime checkpoint.py) and its directory's key. The layout
# (ulysses, ring, cfg), the output location and the memory strategies that
# are exact (offload, VAE tiling/slicing, decode offload) are left out on
# purpose: a checkpoint resumes on any layout and GPU class.
FINGERPRINT_FIELDS = ("model_id", "task", "source", "size", "dtype", "prompt", "negative_prompt", "width",
                      "height", "frames", "steps", "guidance", "seed", "fp8_weights", "cache", "cache_threshold",
                      "image", "face_image")
CHECKPOINTS_DIR = ".videojob-checkpoints"
# Jobs planned to take less than this have no checkpoints unless the spec asks.
CHECKPOINT_MIN_PLANNED_S = 60.0


def checkpoint_key(fields: dict[str, Any]) -> str:
    """16 hex digits naming a job's checkpoint directory: the result-changing fields' digest."""
    import json

    text = json.dumps({k: fields.get(k) for k in FINGERPRINT_FIELDS}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def checkpoint_interval(steps: int, every_steps: int | None, every_seconds: float | None, denoise_s: float,
                        planned_s: float) -> int:
    """Save every N steps (0: never): ``everySteps`` as asked; ``everySeconds`` turned into
    steps with the planned denoise time per step; unset: off for jobs planned under a
    minute (``planned_s``), else about every 10% of the steps. The planner (which counts
    the checkpoints' cost) and the driver requests both decide here."""
    if every_steps is not None:
        return min(every_steps, steps)
    if every_seconds is not None:
        per_step = denoise_s / steps if denoise_s > 0 and steps > 0 else 0.0
        return min(steps, max(1, math.ceil(every_seconds / per_step))) if per_step > 0 \
            else max(1, round(steps / 10))
    if planned_s < CHECKPOINT_MIN_PLANNED_S:
        return 0
    return max(1, round(steps / 10))


def checkpoints_written(steps: int, every: int) -> int:
    """How many checkpoints a run of ``steps`` saves every ``every`` steps (the runtime saves
    at each multiple of ``every`` before the last step: resume.py)."""
    return (steps - 1) // every if every > 0 and steps > 0 else 0


def checkpoint_every_steps(job: VideoJob, layout: dict[str, Any]) -> int:
    """How often the job saves a checkpoint (0: never), from spec.checkpoint and its plan
    (``checkpoint_interval``)."""
    spec = job.spec.resolved()
    asked = spec.checkpoint
    # The plan's denoise seconds (a planner choice has them; a status.plan has only the
    # whole estimate, an upper bound that makes the interval a little shorter).
    denoise = float((layout.get("seconds") or {}).get("denoise") or layout.get("estimatedSeconds") or 0.0)
    # The planned time without the checkpoints' own cost decides the default (as the planner did).
    planned = float(layout.get("estimatedSeconds") or 0.0) - float((layout.get("seconds") or {}).get("checkpoint")
                                                                   or 0.0)
    return checkpoint_interval(spec.sampling.steps, asked.every_steps if asked else None,
                               asked.every_seconds if asked else None, denoise, planned)


def seed_for(job: VideoJob, drawn: int | None = None) -> int:
    """The spec's seed; unset: ``drawn`` (videojob run draws one at random), else
    a value derived from the job's uid, so every attempt of the job uses the same."""
    if job.spec.seed is not None:
        return job.spec.seed
    if drawn is not None:
        return drawn
    uid = str(job.metadata.get("uid") or job.name)
    return int.from_bytes(hashlib.sha256(uid.encode()).digest()[:4], "big") % SEED_LIMIT


def job_fields(job: VideoJob, layout: dict[str, Any], job_id: str, output_name: str, seed: int) -> dict[str, Any]:
    """The runtime JobRequest fields (all but output_dir, which is resolved where the files are written)."""
    spec = job.spec.resolved()
    model = get_model(spec.model.name)
    return dict(
        job_id=job_id,
        model_id=model.id,
        task=spec.effective_task,
        prompt=spec.prompt,
        negative_prompt=spec.negative_prompt,
        image=spec.image,
        face_image=spec.face_image,
        width=spec.video.width,
        height=spec.video.height,
        frames=spec.video.frames,
        fps=spec.video.fps,
        steps=spec.sampling.steps,
        guidance=spec.sampling.guidance_scale,
        seed=seed,
        dtype=spec.model.dtype,
        source=spec.model.source,
        offload=layout["offload"],
        vae_tiling=layout["vaeTiling"],
        vae_slicing=layout["vaeSlicing"],
        fp8_weights=layout["fp8Weights"],
        decode_offload=layout["decodeOffload"],
        cache=layout["cache"],
        cache_threshold=spec.cache.threshold,
        output_name=output_name,
        checkpoint_every_steps=checkpoint_every_steps(job, layout),
        result_extra={"plan": layout, "spec": job.spec.to_wire(), "seedDrawn": job.spec.seed is None},
    )
