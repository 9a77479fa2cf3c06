"""The per-attempt Ray driver: ``python -m videojob_runtime.driver``.

The operator submits one Ray job per VideoJob attempt (Jobs HTTP API) whose
entrypoint is ``DriverRequest.entrypoint()``; this module is that entrypoint.
It runs inside the Ray cluster (``ray.init(address="auto")``: Ray's job
supervisor sets ``RAY_ADDRESS``; it never starts a cluster) and:

1. decodes the request (``--request <base64 JSON of DriverRequest>``, which
   ``hide_request`` first moves from the command line, which Ray's GCS keeps,
   to the environment, which it does not; a sealed one is opened with the
   runtime key: ``request_env``;
   ``driver_protocol``: a request of another major version, or one that
   requires a feature this driver lacks, is refused with a
   ``ProtocolIncompatible`` result; fields it does not know are ignored and
   listed), builds the rank's ``JobRequest`` and resolves the output uri on
   this side of the volumes (a bad one fails the job naming
   ``spec.output.uri``), before anything is created in Ray;
2. fetches https inputs once, into this attempt's own directory under
   VIDEOJOB_INPUT_STAGING_ROOT (``inputs.staged_inputs``);
3. finds the actor group by name and reuses it when it is whole and healthy
   (same layout, no rank broken or busy), else removes what is left of it
   and starts a new one (``ActorGroup.start``: nothing is left behind when
   that fails; while its placement waits for a node the autoscaler is
   launching, ``placement`` progress records say so);
4. runs the job, printing progress records when (step, stage, state)
   changes, at most every ``progress_interval_s``, and exactly one result
   record at the end; exit 0 when the job succeeded, else 1;
5. tears the group down unless ``group.keep`` (a warm pipeline for the next
   job of the same name).

Records go to stdout as ``@@videojob {json}`` lines (``driver_protocol``),
flushed one by one; logs go to stderr. Besides ``progress`` and ``result``
the driver prints one ``group`` record when the group is ready (its name,
whether it was reused, its world size). The stop (SIGTERM from
``POST /api/jobs/{id}/stop``) is ``stopping``'s.

``--teardown GROUP --world N``: attach to a group by name and remove it
(the operator's cleanup after a driver that was SIGKILLed before it could);
prints a result record with what was removed.

``--preempt GROUP --job JOB_ID --world N``: attach to a running group by name
and ask each rank to stop the job at its next boundary, saving the step's
checkpoint first (``gate.py``); the job's own driver then prints a result
with reason ``Preempted`` and ``checkpointStep``. This one prints a result
record with the ranks it asked (exit 0), or ``GroupNotFound`` (exit 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from videojob.driver_protocol import (GROUP_PREFIX, PROTOCOL, REQUEST_ENV, DriverRequest, ProtocolIncompatible,
                                     decode_request)
from videojob.runtimekey import RuntimeKeyError

from .printers import PlacementPrinter, ProgressPrinter  # noqa: F401 - tests import them from here
from .request_env import hide_request, received_request
from .stopping import NAMESPACE, OUT, STATE, finish, group_present, install_stop_handling, remove_group

log = logging.getLogger("videojob.driver")

GiB = 1024**3
_GROUP_NAME = re.compile(re.escape(GROUP_PREFIX) + r"[A-Za-z0-9-]+")


# -- the job -----------------------------------------------------------------------


def _fail(reason: str, stage: str, message: str, **fields: Any) -> dict[str, Any]:
    return {"ok": False, "error": {"reason": reason, "stage": stage, "message": message}, **fields}


def _check_writable(output_dir: Path, root: Path, uri: str) -> None:
    """Fail before any GPU is taken if the job's files could not be written there (opened from
    ``root`` the way the ranks will, ``beneath``: a link on the way fails here already)."""
    from .beneath import Beneath
    from .errors import JobFailure

    try:
        with Beneath.at(output_dir, root, create=True) as where:
            where.unlink(where.write_new(".videojob-probe", b""))
    except OSError as exc:
        raise JobFailure(f"spec.output.uri: {uri} resolves to {output_dir}, which cannot be written "
                         f"({exc.strerror or exc}): check that the volume is mounted read-write and that the "
                         "path is a directory", stage="write", field="spec.output.uri") from None


def unknown_job_fields(request: DriverRequest) -> list[str]:
    """``job.<key>`` for each key of the request's job this runtime's JobRequest lacks."""
    import dataclasses

    from .request import JobRequest

    known = {f.name for f in dataclasses.fields(JobRequest)}
    return [f"job.{k}" for k in sorted(set(request.job) - known)]


def job_request(request: DriverRequest):
    """The ranks' JobRequest (``videojob_runtime.request``) and its output directory.
    Raises JobFailure (a bad output uri, naming spec.output.uri) or ValueError (a bad job)."""
    from .locations import resolve_in_root
    from .request import JobRequest

    unknown = unknown_job_fields(request)
    if unknown:  # a newer operator's optional fields: ignored, and said so (driver_protocol)
        log.warning("ignoring job field(s) this runtime does not know: %s", ", ".join(unknown))
    job = {k: v for k, v in request.job.items() if f"job.{k}" not in unknown}
    if job.get("output_dir") is not None:
        raise ValueError("job.output_dir is the driver's to set: send output_uri instead")
    if job.get("size", "full") != "full":
        raise ValueError("job.size is the benchmarks' (a medium-size model with random weights): "
                         "no VideoJob runs at it")
    if job.get("namespace") not in (None, request.namespace):
        raise ValueError("job.namespace is the driver's to set, from the request's namespace")
    job["namespace"] = request.namespace  # every rank resolves the job's locations in its namespace's directory
    # The default: <output root>/<namespace>/<name> (where it was before locations were per namespace).
    uri = request.output_uri or f"local://{request.name}"
    if job.get("output_object") is not None:
        raise ValueError("job.output_object is the driver's to set, from the request's output_uri")
    if uri.startswith("s3://"):  # staged on the pod's volume, uploaded there (s3outputs); the bucket asked now
        from .s3outputs import check_bucket, staging_dir

        where = check_bucket(uri, request.namespace)
        output_dir = staging_dir(uri, request.namespace, job.get("output_name") or request.name)
        output_root = output_dir.parent  # the pod's staging root (no tenant writes there)
        job["output_object"] = uri
        uri = where.object_uri.rstrip("/")  # what status names: the objects' prefix, the namespace's part in it
    else:
        output_dir, output_root = resolve_in_root(uri, "output", "spec.output.uri", namespace=request.namespace)
    if job.get("output_root") is not None:
        raise ValueError("job.output_root is the driver's to set, with job.output_dir")
    _check_writable(output_dir, output_root, uri)
    job["output_dir"], job["output_root"] = str(output_dir), str(output_root)
    job.setdefault("output_name", request.name)
    if job.get("checkpoint_dir") is not None:
        raise ValueError("job.checkpoint_dir is the driver's to set, beside the output")
    from .checkpoint import job_directory

    job["checkpoint_dir"] = str(job_directory(output_dir, job))
    job.setdefault("job_id", f"{request.name}-a{request.attempt}")
    try:
        return JobRequest.from_dict(job), output_dir, uri
    except TypeError as exc:  # a required field missing
        raise ValueError(f"JobRequest: {exc}") from None


def find_group(request: DriverRequest, on_wait=None):
    """(group, reused): the running group of this name when it is whole and
    healthy, else a new one (what was left of the old one removed first);
    ``on_wait`` gets the placement's waiting records (``placement.wait_placed``)."""
    from videojob.settings import RunSettings

    from .group import ActorGroup, GroupSpec, GroupStartError

    g = request.group
    fault = request.job.get("inject_fault")  # test hook: a fault in the group's rendezvous
    spec = GroupSpec(name=g.name, ulysses=g.ulysses, ring=g.ring, cfg=g.cfg, device=g.device,
                     bundle_resources=dict(g.bundle_resources),
                     rendezvous_fault=fault if fault and fault.get("stage") == "rendezvous" else None)
    if group_present(spec.name):
        group, problem = _check(spec)
        if problem is None:
            log.info("group=%s reused=true world=%d", spec.name, spec.world_size)
            return group, True
        if problem.startswith("busy"):
            raise GroupStartError("GroupBusy", "start", f"group {spec.name} is running another job ({problem}); "
                                                        "one job at a time per group")
        log.warning("group=%s is not reusable (%s): removing it and starting a new one", spec.name, problem)
        removed = remove_group(spec.name, spec.world_size, settle_s=30)
        if not removed.get("gone"):
            raise GroupStartError("GroupStartFailed", "start",
                                  f"what is left of group {spec.name} ({problem}) was not removed within 30s")
    log.info("group=%s reused=false world=%d starting", spec.name, spec.world_size)
    group = ActorGroup.start(spec, timeout_s=request.placement_timeout_s, cpus_per_rank=g.cpus_per_rank,
                             node_type=g.node_type, max_wait_s=request.placement_max_wait_s,
                             on_wait=on_wait, start_timeout_s=RunSettings().group_start_timeout_s,
                             stopping=lambda: OUT.stopping)
    return group, False


def _check(spec):
    """(the attached group, None) when the group named by ``spec`` can run this
    job, else (None, why not); "busy: ..." when a rank is running a job."""
    import ray

    from .group import ActorGroup

    try:
        group = ActorGroup.attach(spec)
    except Exception as exc:  # noqa: BLE001 - ValueError: missing; a dying actor can fail other ways
        return None, f"a rank is missing ({type(exc).__name__}: {exc})"
    if group.pg is None:
        return None, "its placement group is missing"
    bundles = len(ray.util.placement_group_table(group.pg).get("bundles") or {})
    if bundles != spec.world_size:
        return None, f"its placement group has {bundles} bundles, this job needs {spec.world_size}"
    if any(re.fullmatch(re.escape(spec.name) + r"-rank(\d+)", n) and int(n.rsplit("rank", 1)[1]) >= spec.world_size
           for n in ray.util.list_named_actors()):
        return None, f"it has more than {spec.world_size} ranks"
    try:
        health = group.health(timeout_s=10)
        layouts = ray.get([a.__ray_call__.remote(_layout) for a in group.actors], timeout=10)
    except Exception as exc:  # noqa: BLE001 - a dead or hung rank: not reusable
        first = (str(exc).strip().splitlines() or [""])[0]
        return None, f"a rank does not answer ({type(exc).__name__}: {first})"
    wanted = (spec.world_size, spec.ulysses, spec.ring, spec.cfg, spec.device)
    for rank, (h, layout) in enumerate(zip(health, layouts)):
        if h.get("broken"):
            return None, f"rank {rank} is broken: {h['broken']}"
        if h.get("rank") != rank or tuple(layout) != wanted:
            return None, (f"rank {rank} runs layout {tuple(layout)} (world, ulysses, ring, cfg, device), "
                          f"this job needs {wanted}")
        if spec.world_size > 1 and not h.get("distributed"):
            return None, f"rank {rank} has no process group"
    busy = [h["rank"] for h in health if h.get("busy")]
    if busy:
        return None, f"busy: ranks {busy} are running a job"
    return group, None


def _layout(actor) -> tuple:  # runs inside a RankActor (__ray_call__)
    w = actor.worker
    return (w.world_size, w.ulysses, w.ring, w.cfg, w.device)


def _summary(result: dict[str, Any], uri: str, output_dir: Path) -> dict[str, Any]:
    """The result record's fields for a finished group.run."""
    out: dict[str, Any] = {"ok": bool(result.get("ok")), "error": result.get("error")}
    if not out["ok"]:
        return out
    output = result.get("output")
    if output:
        output = {**output, "uri": uri, "dir": str(output_dir)}
    timings = result.get("timings") or {}
    out.update(
        output=output,
        measured={"peakGiB": round(result.get("peak_bytes", 0) / GiB, 4),
                  **{f"{k}Seconds": round(v, 3) for k, v in timings.items()}},
        cache=result.get("cache"),
        seed=result.get("seed"),
        framesDigest=result.get("frames_digest"),
        framesShape=result.get("frames_shape"),
        reused=result.get("reused_all"),
        loads=result.get("loads"),
        collectivesPerRank=result.get("collectives_per_rank"),
        decodeOffload=result.get("decode_offload"),
        checkpoints=result.get("checkpoints"),
    )
    return out


def run(request: DriverRequest, ignored: list[str] | None = None) -> int:
    """One attempt: request, Ray, inputs, group, job, teardown; prints the result record.
    ``ignored``: the request's fields this driver does not know (said in its records)."""
    import ray

    from .errors import JobFailure
    from .group import GroupStartError
    from .inputs import staged_inputs
    from .worker import short_traceback
    from videojob.settings import RunSettings

    STATE.stage = "request"
    base: dict[str, Any] = {"jobId": None, "attempt": request.attempt, "groupName": request.group.name}
    ignored = list(ignored or []) + unknown_job_fields(request)
    if ignored:
        base["ignored"] = ignored
    if not _GROUP_NAME.fullmatch(request.group.name):
        return _result(_fail("BadRequest", "request", f"group name {request.group.name!r} must be 'vj-' followed "
                                                      "by letters, digits and '-'"), base)
    try:
        job, output_dir, uri = job_request(request)
    except JobFailure as exc:
        return _result({"ok": False, "error": exc.to_dict()}, base)
    except ValueError as exc:
        return _result(_fail("BadRequest", "request", str(exc)), base)
    STATE.job_id = base["jobId"] = job.job_id
    base.update(seed=job.seed, steps=job.steps)
    log.info("job=%s attempt=%d group=%s output=%s", job.job_id, request.attempt, request.group.name, output_dir)

    STATE.stage = "init"
    try:
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001 - no cluster to run in: data, not a traceback exit
        log.error("ray.init failed", exc_info=True)
        return _result(_fail("RayUnavailable", "init", f"cannot connect to the Ray cluster: {exc}"), base)
    STATE.ray_ready = True

    group = None
    reused_group = False
    started = time.monotonic()
    wall: dict[str, float] = {}
    try:
        STATE.stage = "inputs"
        tag = f"{request.namespace}-{request.name}-{request.uid.split('-')[0][:8]}-a{request.attempt}"
        with staged_inputs(job, RunSettings(), tag=tag, on_directory=_staging_dir) as staged:
            STATE.stage = "start"
            OUT.emit("progress", step=0, steps=job.steps, percent=0, stage="start", state="starting",
                     job_id=job.job_id)
            g = request.group
            STATE.group_name, STATE.world = g.name, g.ulysses * g.ring * g.cfg
            group, reused_group = find_group(request, on_wait=PlacementPrinter(job.job_id, job.steps, g))
            wall["groupSeconds"] = round(time.monotonic() - started, 3)
            OUT.emit("group", name=group.spec.name, reused=reused_group, world=group.spec.world_size,
                     seconds=wall["groupSeconds"], placement=group.placement or None)
            STATE.stage = "run"
            result = group.run(staged, timeout_s=request.job_timeout_s,
                               on_progress=ProgressPrinter(request.progress_interval_s, job.job_id))
            wall["runSeconds"] = round(time.monotonic() - started - wall["groupSeconds"], 3)
        summary = _summary(result, uri, output_dir)
    except JobFailure as exc:  # an https input that could not be fetched: nothing ran
        log.error("job failed in %s: %s", exc.stage or STATE.stage, exc.message)
        summary = {"ok": False, "error": exc.to_dict()}
    except GroupStartError as exc:  # start leaves nothing behind; a busy group is not ours to remove
        log.error("group start failed: %s", exc.message)
        summary = {"ok": False, "error": {**exc.to_dict(), "groupTornDown": exc.reason != "GroupBusy"}}
    except Exception as exc:  # noqa: BLE001 - a failure outside the job is still a result record
        log.error("driver failed in %s", STATE.stage, exc_info=True)
        summary = _fail(type(exc).__name__, STATE.stage, str(exc) or type(exc).__name__,
                        traceback=short_traceback(exc))
        if STATE.group_name is not None:  # whatever exists of the group is in an unknown state: it goes
            STATE.stage = "teardown"
            _teardown(group, STATE.group_name, STATE.world)
            summary["error"]["groupTornDown"] = True
        group = None
    if group is not None and not group.torn_down and not request.group.keep:
        STATE.stage = "teardown"
        _teardown(group, group.spec.name, group.spec.world_size)
    kept = group is not None and not group.torn_down
    return _result(summary, {**base, "groupReused": reused_group, "groupKept": kept, "wall": wall})


def _staging_dir(path: str | None) -> None:
    """Where this attempt's inputs are staged (the stopper removes it on SIGTERM)."""
    STATE.staging_dir = path


def _teardown(group, name: str | None, world: int) -> None:
    started = time.monotonic()
    try:
        if group is not None:
            group.teardown()
        if name:
            remove_group(name, world)  # by name too: whatever a half-built or broken group left
    except Exception:  # noqa: BLE001 - the operator sweeps what a failed teardown left
        log.error("teardown of group %s failed", name, exc_info=True)
    log.info("group=%s torn down in %.2fs", name, time.monotonic() - started)


def _result(summary: dict[str, Any], extra: dict[str, Any]) -> int:
    fields = {**extra, **summary}
    if OUT.stopping:  # the stopper reports this attempt (Cancelled); what the main thread saw since is moot
        return 1
    if not fields["ok"]:
        error = fields.get("error") or {}
        log.error("result ok=false reason=%s stage=%s: %s", error.get("reason"), error.get("stage"),
                  error.get("message"))
    else:
        log.info("result ok=true video=%s", (fields.get("output") or {}).get("video"))
    OUT.emit("result", **fields)
    return 0 if fields["ok"] else 1


def teardown(name: str, world: int) -> int:
    """``--teardown``: remove group ``name`` (its ranks and placement group) by name."""
    import ray

    STATE.stage = "teardown"
    if not _GROUP_NAME.fullmatch(name):
        return _result(_fail("BadRequest", "request", f"group name {name!r} must be 'vj-' followed by letters, "
                                                      "digits and '-'"), {"groupName": name})
    try:
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001
        return _result(_fail("RayUnavailable", "init", f"cannot connect to the Ray cluster: {exc}"),
                       {"groupName": name})
    STATE.ray_ready = True
    STATE.group_name, STATE.world = name, world
    removed = remove_group(name, world, settle_s=30)
    gone = removed.pop("gone", False)
    log.info("teardown group=%s removed=%s gone=%s", name, removed, gone)
    if not gone:
        return _result(_fail("TeardownIncomplete", "teardown", f"group {name} was still present 30s after "
                                                               "its actors were killed"),
                       {"groupName": name, "removed": removed})
    return _result({"ok": True, "error": None}, {"groupName": name, "removed": removed, "teardown": True})


def preempt(name: str, world: int, job_id: str) -> int:
    """``--preempt``: ask every rank of group ``name`` to stop job ``job_id`` at its next
    boundary, saving the step's checkpoint first (the job's own driver then reports it
    ``Preempted``); prints a result record naming the ranks asked. The group is not ours:
    nothing is removed, also when this driver is stopped (``STATE.group_name`` stays unset)."""
    import ray

    STATE.stage = "preempt"
    extra: dict[str, Any] = {"groupName": name, "jobId": job_id, "preempt": True}
    if not _GROUP_NAME.fullmatch(name):
        return _result(_fail("BadRequest", "request", f"group name {name!r} must be 'vj-' followed by letters, "
                                                      "digits and '-'"), extra)
    if world < 1 or not job_id:
        return _result(_fail("BadRequest", "request", "--preempt needs --job JOB_ID and --world N (N >= 1)"), extra)
    try:
        ray.init(address="auto", namespace=NAMESPACE, log_to_driver=False)
    except Exception as exc:  # noqa: BLE001
        return _result(_fail("RayUnavailable", "init", f"cannot connect to the Ray cluster: {exc}"), extra)
    STATE.ray_ready = True
    from .group import ActorGroup, GroupSpec

    try:
        group = ActorGroup.attach(GroupSpec(name=name, ulysses=world))
    except Exception as exc:  # noqa: BLE001 - ValueError: a rank is not there
        return _result(_fail("GroupNotFound", "preempt", f"group {name} (world {world}) is not running: "
                                                         f"{(str(exc).strip().splitlines() or [''])[0]}"), extra)
    ranks = group.cancel(job_id, checkpoint=True)
    asked = [r["rank"] for r in ranks if r["asked"]]
    log.info("preempt group=%s job=%s asked=%s", name, job_id, asked)
    if not asked:
        return _result(_fail("PreemptFailed", "preempt", f"no rank of group {name} could be asked"),
                       {**extra, "ranks": ranks})
    return _result({"ok": True, "error": None}, {**extra, "asked": asked, "ranks": ranks})


# -- entry point -------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m videojob_runtime.driver",
                                     description="Run one VideoJob attempt on the Ray cluster this runs in.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--request", help="base64 JSON of a DriverRequest (videojob.driver_protocol)")
    mode.add_argument("--request-env", action="store_true",
                      help=f"the request is in ${REQUEST_ENV} (what --request becomes: see hide_request)")
    mode.add_argument("--teardown", metavar="GROUP", help="remove this group (its actors and placement group)")
    mode.add_argument("--preempt", metavar="GROUP",
                      help="ask this group's ranks to checkpoint and stop the job --job at its next step boundary")
    parser.add_argument("--world", type=int, default=0,
                        help="with --teardown: the group's world size (ranks 0..N-1; any other rank alive "
                             "under the group's name is removed too); with --preempt: its ranks 0..N-1")
    parser.add_argument("--job", default="", help="with --preempt: the job id to preempt")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    install_stop_handling()  # first: before Ray creates its threads, so they inherit the blocked signals
    logging.basicConfig(stream=sys.stderr, level=os.environ.get("VIDEOJOB_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.teardown:
        return finish(teardown(args.teardown, args.world))
    if args.preempt:
        return finish(preempt(args.preempt, args.world, args.job))
    try:
        encoded = received_request(args.request)
    except RuntimeKeyError as exc:
        return finish(_result(_fail("RuntimeKeyMismatch", "request", str(exc)), {}))
    try:
        request, ignored = decode_request(encoded)
    except ProtocolIncompatible as exc:
        return finish(_result(_fail("ProtocolIncompatible", "request", str(exc)), {}))
    except Exception as exc:  # noqa: BLE001 - a request that does not decode still gets a result record
        return finish(_result(_fail("BadRequest", "request", f"the driver request does not decode: {exc}"), {}))
    if ignored:
        log.warning("protocol %s: ignoring request field(s) this runtime does not know: %s", PROTOCOL,
                    ", ".join(ignored))
    return finish(run(request, ignored))


if __name__ == "__main__":
    hide_request()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
