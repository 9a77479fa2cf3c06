"""Run a VideoJob on this machine: embedded local Ray, one actor group, files out.

This is ``videojob run``: plan for this machine (GPUs if torch sees any, else
CPU ranks with gloo), start the group, run with a progress callback, write
NAME.mp4 / NAME.png / NAME.json, tear the group down.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from videojob.api import VideoJob
from videojob.catalog import get_model
from videojob.planner import GiB, Inventory, plan_spec

from .worker import JobRequest


def machine_inventory() -> tuple[Inventory, str]:
    """GPUs torch can see, else the CPU (each rank a process; memory = host RAM)."""
    import torch

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name = props.name.lower()
        kind = next((k for k in ("h200", "h100", "a100", "l40") if k in name), "generic")
        return Inventory(gpu_memory=props.total_memory, gpus_per_node=torch.cuda.device_count(),
                         host_memory=host, gpu_type=kind), "cuda"
    ranks = max(1, min(8, os.cpu_count() or 1))
    return Inventory(gpu_memory=host // ranks, gpus_per_node=ranks, host_memory=host, gpu_type="generic"), "cpu"


def job_request(job: VideoJob, layout_json: dict[str, Any], out_dir: Path | None) -> JobRequest:
    spec = job.spec.resolved()
    model = get_model(spec.model.name)
    return JobRequest(
        job_id=job.name or uuid.uuid4().hex[:8],
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
        seed=spec.seed if spec.seed is not None else 0,
        dtype=spec.model.dtype,
        source=spec.model.source,
        offload=layout_json["offload"],
        vae_tiling=layout_json["vaeTiling"],
        vae_slicing=layout_json["vaeSlicing"],
        fp8_weights=layout_json["fp8Weights"],
        cache=layout_json["cache"],
        cache_threshold=spec.cache.threshold,
        output_dir=str(out_dir) if out_dir else None,
        output_name=job.name or "video",
        result_extra={"plan": layout_json, "spec": job.spec.to_wire()},
    )


def run_local(job: VideoJob, out_dir: Path, on_progress: Callable[[dict], None] | None = None,
              timeout_s: float = 3600.0) -> dict[str, Any]:
    """Plan, run and write one job; returns the plan, the rank result and wall times."""
    import ray

    from .group import ActorGroup, GroupSpec

    inventory, device = machine_inventory()
    plan = plan_spec(job.spec, inventory, exhaustive=False)
    if plan.chosen is None:
        return {"ok": False, "error": {"reason": "DoesNotFit", "stage": "plan", "message": plan.reason}}
    layout = plan.chosen.to_json()
    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 namespace="videojob", runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    ray_seconds = time.perf_counter() - started
    spec = GroupSpec(name=f"run-{uuid.uuid4().hex[:8]}", ulysses=layout["ulysses"], ring=layout["ring"],
                     cfg=layout["cfg"], device=device)
    group = ActorGroup.start(spec)
    try:
        group_seconds = time.perf_counter() - started - ray_seconds
        result = group.run(job_request(job, layout, out_dir), timeout_s=timeout_s, on_progress=on_progress)
    finally:
        group.teardown()
    return {**result, "plan": layout, "reason": plan.reason, "device": device,
            "wall": {"ray": ray_seconds, "group": group_seconds, "total": time.perf_counter() - started},
            "estimatedPeakGiB": layout["peakGiBPerGPU"], "measuredPeakGiB": result.get("peak_bytes", 0) / GiB}
