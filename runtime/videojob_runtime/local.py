"""Run a VideoJob on this machine: embedded local Ray, one actor group, files out.

This is ``videojob run``: plan for this machine (GPUs if torch sees any, else
CPU ranks with gloo), start the group, run with a progress callback, write
NAME.mp4 / NAME.png / NAME.json where the spec's output uri points (or
``--out``), tear the group down.

Hermetic Ray: unless ``VIDEOJOB_RAY_ADDRESS`` names a cluster, a new local
Ray starts with its own temp dir (``address="local"``), so neither a stale
Ray state file, nor ``RAY_ADDRESS``, nor a Ray cluster already running on the
machine is ever used; it gets its own auth token in the environment, so
nothing is written to ``~/.ray``. Everything is removed when the run ends.

Failures outside the job (no placement, an actor that died, a timeout) come
back as the same structured error as failures inside it, with the stage.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from videojob.api import VideoJob
from videojob.catalog import get_model
from videojob.planner import GiB, Inventory, plan_spec
from videojob.settings import RunSettings

from .request import JobRequest

NAMESPACE = "videojob"
SEED_LIMIT = 2**32
log = logging.getLogger("videojob.runtime.local")


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
    return Inventory(gpu_memory=host // ranks, gpus_per_node=ranks, host_memory=host, gpu_type="generic",
                     unit="CPU rank"), "cpu"


@contextlib.contextmanager
def embedded_ray(settings: RunSettings | None = None, num_cpus: int | None = None) -> Iterator[dict[str, Any]]:
    """Ray for this process: the configured cluster, or a fresh local one (module docstring).
    An already initialised Ray (a test's) is used as it is and left running."""
    import ray

    settings = settings or RunSettings()
    if ray.is_initialized():
        yield {"embedded": False, "address": ray.get_runtime_context().gcs_address}
        return
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if settings.ray_address:
        ray.init(address=settings.ray_address, namespace=NAMESPACE, log_to_driver=False)
        try:
            yield {"embedded": False, "address": settings.ray_address}
        finally:
            ray.shutdown()
        return
    temp_dir = tempfile.mkdtemp(prefix="vj-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    # Ray turns token auth on for a new local cluster and, without a token,
    # writes one to ~/.ray/auth_token (shared by every Ray on the machine).
    # A token in the environment is used instead; Ray caches it per process,
    # so it is set once and kept.
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    try:
        context = ray.init(address="local", _temp_dir=temp_dir, num_cpus=num_cpus or os.cpu_count(),
                           include_dashboard=False, log_to_driver=False, namespace=NAMESPACE,
                           runtime_env={"env_vars": env})
        try:
            yield {"embedded": True, "address": context.address_info.get("gcs_address"), "tempDir": temp_dir}
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


def output_location(job: VideoJob, out_dir: Path | None, settings: RunSettings) -> tuple[Path, str]:
    """Where the files go, and a line saying why (``--out`` overrides ``spec.output.uri``)."""
    spec_uri = job.spec.output.uri if job.spec.output else None
    if out_dir is not None:
        note = f"--out {out_dir} overrides spec.output.uri {spec_uri}" if spec_uri else f"--out {out_dir}"
        return out_dir, note
    if spec_uri is None:
        return Path(settings.output_root), f"spec.output is unset: {settings.output_root}"
    from .locations import resolve

    # local:// under VIDEOJOB_OUTPUT_ROOT (default ./out for `videojob run`), pvc:// under the claim's mount;
    # contained there, links followed (a JobFailure naming spec.output.uri otherwise).
    path = resolve(spec_uri, "output", "spec.output.uri", root=settings.output_root)
    return path, f"spec.output.uri {spec_uri} -> {path}"


def output_name(job: VideoJob) -> str:
    """The job's file-name stem: its name, refused unless a DNS-1123 subdomain
    (the API server's rule; checked again here, where it becomes a file name)."""
    from videojob.api.uris import name_problem

    from .errors import JobFailure

    if not job.name:
        return "video"
    problem = name_problem(job.name)
    if problem is not None:
        raise JobFailure(f"metadata.name {problem}", stage="request", field="metadata.name")
    return job.name


def job_request(job: VideoJob, layout_json: dict[str, Any], out_dir: Path | None) -> JobRequest:
    """The request every rank gets; an unset seed is drawn here, once for all ranks."""
    from videojob.jobrequest import job_fields, seed_for

    name = output_name(job)
    fields = job_fields(job, layout_json, job_id=name if job.name else uuid.uuid4().hex[:8], output_name=name,
                        seed=seed_for(job, drawn=secrets.randbelow(SEED_LIMIT)))
    return JobRequest(**fields, output_dir=str(out_dir) if out_dir else None)


def _error(reason: str, stage: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "error": {"reason": reason, "stage": stage, "message": message, **extra}}


def run_local(job: VideoJob, out_dir: Path | None = None, on_progress: Callable[[dict], None] | None = None,
              settings: RunSettings | None = None) -> dict[str, Any]:
    """Plan, run and write one job; always returns a dict (``ok``, or ``error`` with reason and stage).
    https inputs are fetched here, once for all ranks, and removed when the job ends (``staged_inputs``)."""
    from .errors import JobFailure
    from .group import ActorGroup, GroupSpec, GroupStartError, group_name
    from .inputs import staged_inputs
    from .worker import short_traceback

    settings = settings or RunSettings()
    inventory, device = machine_inventory()
    plan = plan_spec(job.spec, inventory, exhaustive=False)
    if plan.chosen is None:
        return {**_error("DoesNotFit", "plan", plan.reason), "exit": 3}
    layout = plan.chosen.to_json()
    try:
        directory, where = output_location(job, out_dir, settings)
        request = job_request(job, layout, directory.resolve())
    except JobFailure as exc:  # a name or output uri that would leave its root: bad input, nothing written
        return {"ok": False, "error": exc.to_dict(), "exit": 1, "plan": layout}
    started = time.perf_counter()
    stage = "inputs"
    wall: dict[str, float] = {}
    try:
        with staged_inputs(request, settings) as staged:
            wall["inputs"] = time.perf_counter() - started
            stage = "ray"
            with embedded_ray(settings) as ray_info:
                wall["ray"] = time.perf_counter() - started - wall["inputs"]
                stage = "start"
                # The run owns its group: named after a fresh uid, as an operator's job names its own.
                spec = GroupSpec(name=group_name(str(uuid.uuid4())), ulysses=layout["ulysses"],
                                 ring=layout["ring"], cfg=layout["cfg"], device=device)
                group = ActorGroup.start(spec, timeout_s=settings.placement_timeout_s,
                                         cpus_per_rank=settings.cpus_per_rank,
                                         start_timeout_s=settings.group_start_timeout_s)
                try:
                    wall["group"] = time.perf_counter() - started - wall["inputs"] - wall["ray"]
                    stage = "run"
                    result = group.run(staged, timeout_s=settings.job_timeout_s, on_progress=on_progress)
                finally:
                    group.teardown()
    except JobFailure as exc:  # fetching an https input failed: nothing ran
        log.error("job failed in %s: %s", exc.stage or stage, exc.message)
        result = {"ok": False, "error": exc.to_dict()}
    except GroupStartError as exc:
        log.error("group start failed: %s", exc.message, exc_info=True)
        result = {"ok": False, "error": exc.to_dict()}
    except Exception as exc:  # noqa: BLE001 - a failure outside the job is still data, never a traceback exit
        log.error("run failed in %s", stage, exc_info=True)
        result = _error(type(exc).__name__, stage, str(exc) or type(exc).__name__, traceback=short_traceback(exc))
    wall["total"] = time.perf_counter() - started
    out = {**result, "plan": layout, "reason": plan.reason, "device": device, "wall": wall,
           "output_dir": str(directory), "output_note": where, "seed": request.seed,
           "ray": locals().get("ray_info"), "estimatedPeakGiB": layout["peakGiBPerGPU"],
           "measuredPeakGiB": result.get("peak_bytes", 0) / GiB}
    if not result.get("ok"):
        from .output import write_failure

        document = {"job": request.job_id, "ok": False, "error": result["error"], "plan": layout,
                    "seed": request.seed, "spec": job.spec.to_wire()}
        try:
            out["output"] = {"result": str(write_failure(directory, request.output_name, document))}
        except OSError as exc:
            log.error("could not write the failure record: %s", exc)
    return out
