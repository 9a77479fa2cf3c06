"""A job's request to the runtime, from its spec and chosen layout: one place for both drivers.

``videojob run`` (runtime/local.py) and the operator's driver requests
(controller) build the runtime's ``JobRequest`` fields here, so the two
cannot map a spec field differently. No torch: the operator imports it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .api import VideoJob
from .catalog import get_model

SEED_LIMIT = 2**32


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
        result_extra={"plan": layout, "spec": job.spec.to_wire(), "seedDrawn": job.spec.seed is None},
    )
