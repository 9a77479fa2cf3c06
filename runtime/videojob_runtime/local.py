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

Before Ray starts, the run is checked up front (``run_local``): the output
directory is created and a file written in it, and every input file the
ranks will read (``local://`` under the inputs root, ``pvc://`` under the
claim's mount) must exist; either failure is bad input (exit 1) naming the
flag or field, the path and what to set, and leaves nothing behind.
Ray's own log lines (its token-auth warning, "Started a local Ray instance")
go to the ``videojob.ray`` logger, not straight to the terminal: the caller
decides where they go (``videojob run``: the run's log, errors also on
stderr).

Failures outside the job (no placement, an actor that died, a timeout) come
back as the same structured error as failures inside it, with the stage.
"""

from __future__ import annotations

import contextlib
import errno
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

from .errors import JobFailure
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


class _ToLogger(logging.Handler):
    """Hands each record to another logger (its handlers decide where it goes)."""

    def __init__(self, target: logging.Logger):
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        self.target.handle(record)


@contextlib.contextmanager
def ray_logs_to(logger_name: str = "videojob.ray") -> Iterator[None]:
    """Ray's log records in this process go to ``logger_name`` instead of the
    stderr handler Ray installs on its ``ray`` logger when imported; put back after."""
    import ray  # noqa: F401 - importing Ray installs its handler, which is what is replaced here

    ray_logger = logging.getLogger("ray")
    saved = list(ray_logger.handlers)
    ray_logger.handlers = [_ToLogger(logging.getLogger(logger_name))]
    try:
        yield
    finally:
        ray_logger.handlers = saved


@contextlib.contextmanager
def embedded_ray(settings: RunSettings | None = None, num_cpus: int | None = None,
                 env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """Ray for this process: the configured cluster, or a fresh local one (module docstring).
    An already initialised Ray (a test's) is used as it is and left running. ``env``:
    variables every rank gets (the job's runtime_env), besides OMP_NUM_THREADS."""
    import ray

    settings = settings or RunSettings()
    if ray.is_initialized():
        yield {"embedded": False, "address": ray.get_runtime_context().gcs_address}
        return
    with ray_logs_to():
        with _ray_session(ray, settings, num_cpus, env or {}) as info:
            yield info


@contextlib.contextmanager
def _ray_session(ray, settings: RunSettings, num_cpus: int | None, extra_env: dict[str, str]):
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra_env}
    if settings.ray_address:
        ray.init(address=settings.ray_address, namespace=NAMESPACE, log_to_driver=False,
                 **({"runtime_env": {"env_vars": extra_env}} if extra_env else {}))
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
    if spec_uri.startswith("s3://"):  # staged on this machine, then uploaded (s3outputs); the bucket asked now
        from .s3outputs import check_bucket, staging_dir

        where = check_bucket(spec_uri, None)
        path = staging_dir(spec_uri, None, output_name(job))
        return path, f"spec.output.uri {spec_uri} -> {where.object_uri} (staged in {path})"
    from .locations import resolve

    # local:// under VIDEOJOB_OUTPUT_ROOT (default ./out for `videojob run`), pvc:// under the claim's mount;
    # contained there, links followed (a JobFailure naming spec.output.uri otherwise).
    path = resolve(spec_uri, "output", "spec.output.uri", root=settings.output_root)
    return path, f"spec.output.uri {spec_uri} -> {path}"


def output_field(job: VideoJob, out_dir: Path | None) -> str:
    """What chose the output directory, for messages: the flag, the field or the variable."""
    if out_dir is not None:
        return "--out"
    return "spec.output.uri" if job.spec.output and job.spec.output.uri else "VIDEOJOB_OUTPUT_ROOT"


def make_output_dir(directory: Path, field: str, head: str, hint: str = "") -> list[Path]:
    """Create ``directory`` (and its missing parents) and write a file in it, so
    a place the files cannot go is found before anything runs. The directories
    made, outermost first. Any failure is a JobFailure naming ``field`` (``head``
    starts its message: the flag or field and its value; ``hint`` ends it), after
    removing what was made: nothing is left behind."""
    target = Path(os.path.abspath(directory))
    missing: list[Path] = []
    probe = target
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    made: list[Path] = []
    try:
        if probe.exists() and not probe.is_dir():  # the directory itself, or a parent, is a file
            raise NotADirectoryError(errno.ENOTDIR, f"{probe} is there and is not a directory")
        for path in reversed(missing):
            path.mkdir()
            made.append(path)
        if not target.is_dir():  # a link to nowhere
            raise NotADirectoryError(errno.ENOTDIR, f"{target} is not a directory")
        try:
            fd, name = tempfile.mkstemp(prefix=".videojob-write-check-", dir=target)
        except OSError as exc:  # named after the directory, not the check's own file
            raise OSError(exc.errno, f"{target}: cannot write a file there: {exc.strerror or exc}") from None
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        remove_made_dirs(made)
        reason = exc.strerror or str(exc)
        if exc.filename:
            reason = f"{exc.filename}: {reason}"
        raise JobFailure(f"{head}: cannot write the output files there ({reason}): name a directory that "
                         f"can be created and written{f' ({hint})' if hint else ''}", stage="write", field=field,
                         directory=str(directory)) from None
    return made


def remove_made_dirs(made: list[Path]) -> None:
    """Remove the directories ``make_output_dir`` made, innermost first, while empty."""
    for path in reversed(made):
        try:
            path.rmdir()
        except OSError:
            return


def input_files(request: JobRequest) -> list[tuple[str, str]]:
    """(field, uri) of each file the ranks read for this task (``worker._conditioning``):
    i2v its image; identity its face and the face's embeddings at ``<faceImage>.npz``."""
    if request.task == "i2v" and request.image:
        return [("spec.image", request.image)]
    if request.task == "identity" and request.face_image:
        return [("spec.faceImage", request.face_image), ("spec.faceImage", f"{request.face_image}.npz")]
    return []


def check_inputs(request: JobRequest, inputs_root: Path, how_to_set: str = "VIDEOJOB_DATA_ROOT") -> None:
    """Every local:// and pvc:// file the ranks will read exists, checked before
    anything starts; a JobFailure naming the field, the path it resolves to and
    the setting that moves it otherwise (https inputs are fetched, and checked, later)."""
    from .locations import resolve, volumes_root

    for field, uri in input_files(request):
        if uri.startswith("https://"):
            continue
        if uri.startswith("s3://"):
            _check_s3_input(uri, field)
            continue
        path = resolve(uri, "input", field, root=inputs_root)
        if path.is_file():
            continue
        what = "ConsisID's face embeddings" if uri.endswith(".npz") and field == "spec.faceImage" else "the input"
        found = "is not a file" if path.exists() else "does not exist"
        if uri.startswith("local://"):
            where = f"local:// inputs are read under {inputs_root}: set {how_to_set}"
        else:
            where = f"pvc://CLAIM/path is read under VIDEOJOB_VOLUMES_ROOT/CLAIM, here {volumes_root()}"
        raise JobFailure(f"{field}: {what} {uri} {found}: it resolves to {path} ({where})",
                         stage="inputs", field=field, resolved=str(path))


def _check_s3_input(uri: str, field: str) -> None:
    """An s3:// input is there and within the size limit, asked before anything starts."""
    from videojob.settings import S3Settings

    from . import s3store

    settings = S3Settings()
    where = s3store.locate(uri, "input", field, None, settings)
    s3store.checked_head(s3store.client(settings), where, RunSettings().input_max_bytes, "VIDEOJOB_INPUT_MAX_BYTES")


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


def job_request(job: VideoJob, layout_json: dict[str, Any], out_dir: Path | None,
                output_object: str | None = None) -> JobRequest:
    """The request every rank gets; an unset seed is drawn here, once for all ranks.
    ``output_object``: an s3:// output, staged in ``out_dir`` and uploaded from there."""
    from videojob.jobrequest import job_fields, seed_for

    name = output_name(job)
    fields = job_fields(job, layout_json, job_id=name if job.name else uuid.uuid4().hex[:8], output_name=name,
                        seed=seed_for(job, drawn=secrets.randbelow(SEED_LIMIT)))
    if out_dir:
        from .checkpoint import job_directory

        fields["checkpoint_dir"] = str(job_directory(Path(out_dir), fields))
    return JobRequest(**fields, output_dir=str(out_dir) if out_dir else None, output_object=output_object)


def _error(reason: str, stage: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "error": {"reason": reason, "stage": stage, "message": message, **extra}}


def run_local(job: VideoJob, out_dir: Path | None = None, on_progress: Callable[[dict], None] | None = None,
              settings: RunSettings | None = None, inputs_dir: str | Path | None = None,
              on_ready: Callable[[dict], None] | None = None,
              inputs_setting: str = "VIDEOJOB_DATA_ROOT") -> dict[str, Any]:
    """Plan, run and write one job; always returns a dict (``ok``, or ``error`` with reason and stage).
    https inputs are fetched here, once for all ranks, and removed when the job ends (``staged_inputs``).

    Up front, before Ray starts (module docstring): the plan (exit 3 when
    nothing fits), the output directory (made and written to) and the input
    files; a failure there is ``exit`` 1 and writes nothing. ``inputs_dir``:
    where local:// inputs are read (default: VIDEOJOB_DATA_ROOT's directory),
    handed to the ranks; ``inputs_setting`` names what sets it, in messages.
    ``on_ready`` hears where the files go and the inputs come from, once the
    checks pass."""
    from .errors import JobFailure
    from .group import ActorGroup, GroupSpec, GroupStartError, group_name
    from .inputs import staged_inputs
    from .locations import local_root
    from .worker import short_traceback

    settings = settings or RunSettings()
    inventory, device = machine_inventory()
    plan = plan_spec(job.spec, inventory, exhaustive=False)
    if plan.chosen is None:
        return {**_error("DoesNotFit", "plan", plan.reason), "exit": 3}
    layout = plan.chosen.to_json()
    inputs_root = Path(os.path.abspath(inputs_dir if inputs_dir is not None else local_root("input")))
    try:
        directory, where = output_location(job, out_dir, settings)
        spec_uri = job.spec.output.uri if job.spec.output else None
        s3_output = spec_uri if out_dir is None and spec_uri and spec_uri.startswith("s3://") else None
        request = job_request(job, layout, directory.resolve(), s3_output)
        check_inputs(request, inputs_root, inputs_setting)
        field = output_field(job, out_dir)
        if field == "spec.output.uri":
            hint = ("pvc://CLAIM/path is under VIDEOJOB_VOLUMES_ROOT/CLAIM" if job.spec.output.uri.startswith("pvc://")
                    else "s3:// outputs are staged under VIDEOJOB_S3_STAGING_ROOT" if s3_output
                    else "local:// outputs go under VIDEOJOB_OUTPUT_ROOT") + "; --out overrides"
        else:
            hint = "" if field == "--out" else "VIDEOJOB_OUTPUT_ROOT names it; --out overrides"
        make_output_dir(directory, field, f"--out {out_dir}" if out_dir is not None else where, hint)
    except JobFailure as exc:  # a name, output place or input that is wrong: bad input, nothing written
        return {"ok": False, "error": exc.to_dict(), "exit": 1, "plan": layout}
    reads_local = any(uri.startswith("local://") for _, uri in input_files(request))
    if on_ready is not None:
        on_ready({"output": where, "directory": str(directory), "inputs": str(inputs_root) if reads_local else None})
    rank_env = {"VIDEOJOB_DATA_ROOT": str(inputs_root)} if reads_local else {}
    started = time.perf_counter()
    stage = "inputs"
    wall: dict[str, float] = {}
    try:
        with staged_inputs(request, settings) as staged:
            wall["inputs"] = time.perf_counter() - started
            stage = "ray"
            with embedded_ray(settings, env=rank_env) as ray_info:
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
            if request.output_object:
                from .s3outputs import upload_failure

                out["output"] = {"result": upload_failure(request.output_object, None, request.output_name,
                                                          document)}
            else:
                out["output"] = {"result": str(write_failure(directory, request.output_name, document))}
        except (OSError, JobFailure) as exc:
            log.error("could not write the failure record: %s", exc)
    return out
