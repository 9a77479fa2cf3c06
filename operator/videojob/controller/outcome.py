"""How an attempt ended, read from its driver's result record: a pure function.

``Outcome.kind`` drives what the lifecycle does next:
- ``succeeded``: the video is written; the job is done.
- ``oom``: out of memory: re-plan stricter and try again (while attempts last).
- ``lost``: an actor, the driver or a pod went away (or Ray failed): the same
  plan again after a backoff.
- ``requeue``: nothing could place the group (``NoPlacement``: no room, and no
  node of its class being launched): back to the queue without using up an
  attempt, within the requeue limit.
- ``failed``: anything else (bad input, a bug, a runtime that cannot speak the
  operator's protocol): retrying would fail the same way.

A driver that ended without a result record is told apart by what Ray says of
its Ray job (``status``, ``error_type``, ``driver_exit_code``) and by its log:

- it exited on its own with an error before printing any record (its Python
  could not import the runtime, the interpreter is missing: Ray's
  ``JOB_ENTRYPOINT_COMMAND_ERROR`` with an exit code from 1 to 127):
  ``failed``, reason ``DriverStartFailed``: every retry would end the same way;
- anything else (stopped, killed by a signal: exit code 128+N or negative, its
  job supervisor or node gone, or it died after it had started): ``lost``,
  reason ``DriverLost``, retried.

A message that quotes the driver's log quotes its end (``log_tail``): the last
lines, where a traceback says what went wrong; never Ray's own preamble, which
repeats the entrypoint with its base64 request.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..driver_protocol import PROTOCOL, UPGRADE_HINT, records
from ..raycluster.client import RayJob

# Reasons a retry of the same plan may cure: something outside the job went away.
LOST_REASONS = {"ActorDied", "RayError", "DriverLost", "GroupStartFailed", "Stopped", "RayUnavailable",
                "NodeDied", "WorkerCrashed", "GroupBusy"}
# A warm group the books said was idle runs another job: not this attempt's to remove.
NOT_OURS = {"GroupBusy"}
DRIVER_START_FAILED = "DriverStartFailed"
# Ray's error_type for an entrypoint that ran and exited non-zero (Ray 2.x's JobErrorType).
ENTRYPOINT_EXITED = "JOB_ENTRYPOINT_COMMAND_ERROR"
# Ray's own lines in a job's log, before the entrypoint's output: the runtime env
# setup, and the entrypoint itself (our base64 request in it).
_RAY_PREAMBLE = re.compile(r"^(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+\w+ job_manager\.py:\d+ -- .*"
                           r"|Running entrypoint for job \S+: .*)$")
_REQUEST_ARG = re.compile(r"(--request\s+)\S+")
_LONG_TOKEN = re.compile(r"[A-Za-z0-9+/=_-]{200,}")  # a base64 blob anywhere else
_RAY_LOGS_HEADER = re.compile(r",? last available logs \(truncated to [\d,]+ chars\):\s*$")
_EXIT_CODE = re.compile(r"failed with exit code (-?\d+)")
TAIL_LINES = 6
TAIL_CHARS = 600


@dataclass
class Outcome:
    kind: str  # succeeded, oom, lost, failed
    reason: str
    message: str
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def attempt_result(self) -> str:
        return {"succeeded": "Succeeded", "oom": "OutOfMemory", "lost": "Lost", "requeue": "Requeued",
                "preempted": "Preempted"}.get(
            self.kind, "Cancelled" if self.reason == "Cancelled" else "Failed")

    @property
    def driver_protocol(self) -> str | None:
        """The protocol the driver said it speaks (records before 1.1 carry none: "1.0")."""
        if not self.result:
            return None
        return str(self.result.get("protocol") or "1.0")


def _refused_by_old_driver(result: dict[str, Any]) -> bool:
    """A 1.0 driver's answer to a request with a field it does not know: it refused to decode it."""
    error = result.get("error") or {}
    return (not result.get("protocol") and error.get("reason") == "BadRequest"
            and "does not decode" in str(error.get("message")) and "Extra inputs are not permitted"
            in str(error.get("message")))


def clip(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, keeping its start and its end (a
    quoted log's last line is what says what went wrong)."""
    if len(text) <= limit:
        return text
    head = max(0, limit // 3 - 2)
    return f"{text[:head]} ... {text[len(text) - (limit - head - 5):]}"


def log_tail(logs: str, lines: int = TAIL_LINES, chars: int = TAIL_CHARS) -> str:
    """The end of a driver's log as a message quotes it: its last ``lines`` non-blank
    lines, in at most ``chars`` characters (the start cut, not the end), without
    Ray's preamble and with any base64 request elided."""
    kept = []
    for line in logs.splitlines():
        line = line.rstrip()
        if not line.strip() or _RAY_PREAMBLE.match(line):
            continue
        line = _REQUEST_ARG.sub(r"\1<request>", line)
        kept.append(_LONG_TOKEN.sub(lambda m: f"<{len(m.group())} chars>", line))
    text = "\n".join(kept[-lines:])
    return text if len(text) <= chars else "..." + text[len(text) - chars + 3:]


def _ray_log(ray_job: RayJob) -> tuple[str, str]:
    """Ray's message split into (its headline, the log tail Ray quoted after it)."""
    headline, _, quoted = (ray_job.message or "").partition("\n")
    match = _RAY_LOGS_HEADER.search(headline)
    if match is None:
        return (ray_job.message or "").strip(), ""
    return headline[:match.start()], quoted


def exit_code(ray_job: RayJob) -> int | None:
    """The entrypoint's exit status (Ray's driver_exit_code, or the one its message names)."""
    if ray_job.driver_exit_code is not None:
        return ray_job.driver_exit_code
    match = _EXIT_CODE.search(ray_job.message or "")
    return int(match.group(1)) if match else None


def failed_to_start(ray_job: RayJob, logs: str) -> bool:
    """The driver exited on its own, with an error, before printing any record: the
    entrypoint could not start the driver (an import error, a missing interpreter).
    A driver killed by a signal (exit 128+N through the shell, or negative), stopped,
    or whose job supervisor or node died is not this: it is lost."""
    code = exit_code(ray_job)
    return (ray_job.status == "FAILED" and (ray_job.error_type or ENTRYPOINT_EXITED) == ENTRYPOINT_EXITED
            and code is not None and 0 < code < 128 and next(records(logs), None) is None)


def _interpreter(ray_job: RayJob) -> str | None:
    try:
        words = shlex.split(ray_job.entrypoint)
    except ValueError:
        return None
    return words[0] if words else None


def _quoted(headline: str, tail: str) -> str:
    """Ray's headline (clipped) and the end of the driver's log."""
    text = clip(headline, 200) if headline else ""
    if tail:
        text += ("; " if text else "") + f"its log ends:\n{tail}"
    return text


def _no_result(ray_job: RayJob, logs: str) -> Outcome:
    """A driver that ended without a result record: it never started (failed), or it went away (lost)."""
    headline, quoted = _ray_log(ray_job)
    tail = log_tail(logs or quoted)
    code = exit_code(ray_job)
    if failed_to_start(ray_job, logs or quoted):
        python = clip(_interpreter(ray_job) or "python", 120)
        problem = {126: f"{python} is not executable", 127: f"{python} was not found"}.get(
            code, f"its Python, {python}, must import videojob_runtime")
        message = (f"the driver exited with code {code} before it printed anything, so it is not retried ({problem}: "
                   "VIDEOJOB_DRIVER_PYTHON names the drivers' Python; unset in embedded mode: the operator's own; "
                   "in a cluster: the runtime image's `python`); "
                   + (f"its log ends:\n{tail}" if tail else "its log is empty"))
        return Outcome("failed", DRIVER_START_FAILED, message, {})
    how = f"{ray_job.status}" + (f", {ray_job.error_type}" if ray_job.error_type else "") + (
        f", exit code {code}" if code is not None else "")
    message = f"the driver ended ({how}) without a result"
    said = _quoted(headline, tail)
    return Outcome("lost", "DriverLost", f"{message}: {said}" if said else message, {})


def outcome_of(ray_job: RayJob, result: dict[str, Any] | None, logs: str = "") -> Outcome:
    """How the attempt ended: its driver's Ray job, its result record (None: none
    printed) and its log (what a message quotes when there is no result)."""
    if result and result.get("ok") and ray_job.status == "SUCCEEDED":
        return Outcome("succeeded", "Succeeded", "", result)
    if result and result.get("ok") and ray_job.terminal:
        # Its outputs were written and renamed into place before the result record was
        # printed: the work is done, whatever stopped the driver after that (a SIGKILL
        # during its teardown). Its group is in an unknown state: not kept (the sweeper
        # removes what is left of it).
        return Outcome("succeeded", "Succeeded", "", {**result, "groupKept": False})
    if result is None:  # the driver ended before its result record: never started, or killed, or its node lost
        return _no_result(ray_job, logs)
    if _refused_by_old_driver(result):
        return Outcome("failed", "ProtocolIncompatible",
                       f"this runtime speaks protocol 1.0 (it refuses request fields it does not know); the operator "
                       f"needs {PROTOCOL}: {UPGRADE_HINT}", result)
    error = result.get("error")
    if not error:  # a result record without an error: what Ray says, and the end of the driver's log
        headline, quoted = _ray_log(ray_job)
        error = {"reason": "DriverFailed", "stage": "run",
                 "message": _quoted(headline, log_tail(logs or quoted)) or f"Ray job {ray_job.status}"}
    reason = error.get("reason") or "Failed"
    if reason == "ProtocolIncompatible":
        return Outcome("failed", reason, clip(str(error.get("message", "")), 1000), result)
    where = error.get("summary") or f"failed in {error.get('stage') or 'run'}"
    message = clip(f"{where}: {reason}: {error.get('message', '')}", 1000)
    if reason == "OutOfMemory":
        kind = "oom"
    elif reason == "NoPlacement":
        kind = "requeue"
    elif reason == "Preempted":
        kind = "preempted"
    elif reason in LOST_REASONS:
        kind = "lost"
    else:
        kind = "failed"
    return Outcome(kind, reason, message, result)


def attempt_steps(record: dict[str, Any], status: dict[str, Any]) -> dict[str, int]:
    """An ended attempt's ``resumedFromStep`` and ``stepsComputed``, from its driver's
    record: a success computed the steps after its checkpoint; a failure, up to the
    step it failed after (else the last progress the operator saw)."""
    steps = int((status.get("progress") or {}).get("steps") or 0)
    if record.get("ok"):
        resumed = int((record.get("checkpoints") or {}).get("resumedFromStep") or 0)
        return {"resumedFromStep": resumed, "stepsComputed": max(steps - resumed, 0)} if steps else \
            {"resumedFromStep": resumed}
    error = record.get("error") or {}
    resumed = int(error.get("resumedFromStep") or 0)
    reached = int(error.get("step") or (status.get("progress") or {}).get("step") or 0)
    return {"resumedFromStep": resumed, "stepsComputed": max(reached - resumed, 0)}


def success_changes(status: dict[str, Any], result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(status changes, measured) for a job whose attempt succeeded."""
    measured = {k: v for k, v in (result.get("measured") or {}).items() if v is not None}
    cache = result.get("cache") or None
    if cache and cache.get("evaluations") is not None:
        total = cache.get("evaluations", 0) + cache.get("skipped", 0)
        if total:
            measured["cacheSkipRatio"] = round(cache.get("skipped", 0) / total, 4)
    checkpoints = result.get("checkpoints") or {}
    if checkpoints.get("written"):
        measured["checkpointSeconds"] = round(float(checkpoints.get("seconds") or 0.0), 3)
        measured["checkpointBytes"] = int(checkpoints.get("bytes") or 0)
    output = result.get("output") or {}
    if output.get("uploadSeconds") is not None:
        measured["uploadSeconds"] = round(float(output["uploadSeconds"]), 3)
    estimated = (status.get("plan") or {}).get("estimatedPeakGiBPerGPU")
    message = (f"wrote {output.get('uri') or output.get('video')} ({output.get('bytes')} bytes); "
               f"peak {measured.get('peakGiB')} GiB per rank, planned {estimated}")
    steps = (status.get("progress") or {}).get("steps") or result.get("steps") or 0
    changes = {"measured": measured, "message": message,
               "progress": {"step": steps, "steps": steps, "percent": 100},
               "output": output_status(output, result.get("framesDigest"))}
    return changes, measured


def output_status(output: dict[str, Any], digest: str | None) -> dict[str, Any]:
    """status.output from the driver's output record: where the files are (an s3:// output's object
    uris and, when the admin turns them on, a presigned URL and its expiry)."""
    status = {"uri": output.get("uri") or output.get("video"), "video": output.get("video"),
              "result": output.get("result"), "videoUrl": output.get("videoUrl"),
              "videoUrlExpires": output.get("videoUrlExpires"), "bytes": output.get("bytes"),
              "framesDigest": digest}
    return {k: v for k, v in status.items() if v is not None}


def story(attempts: list[dict[str, Any]]) -> str:
    """Every attempt in one line: what it ran with and how it ended."""
    parts = []
    for a in attempts:
        summary = ((a.get("plan") or {}).get("summary") or "?")
        klass = (a.get("plan") or {}).get("gpuClass")
        where = f"{summary} on {klass}" if klass else summary
        parts.append(f"attempt {a.get('number')} ({where}): {a.get('result')} {a.get('reason') or ''}".strip())
    return "; ".join(parts)


__all__ = ["DRIVER_START_FAILED", "LOST_REASONS", "NOT_OURS", "Outcome", "clip", "exit_code", "failed_to_start",
           "log_tail", "outcome_of", "story", "success_changes"]
