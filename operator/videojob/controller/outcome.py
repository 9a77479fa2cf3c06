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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..driver_protocol import PROTOCOL, UPGRADE_HINT
from ..raycluster.client import RayJob

# Reasons a retry of the same plan may cure: something outside the job went away.
LOST_REASONS = {"ActorDied", "RayError", "DriverLost", "GroupStartFailed", "Stopped", "RayUnavailable",
                "NodeDied", "WorkerCrashed"}


@dataclass
class Outcome:
    kind: str  # succeeded, oom, lost, failed
    reason: str
    message: str
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def attempt_result(self) -> str:
        return {"succeeded": "Succeeded", "oom": "OutOfMemory", "lost": "Lost", "requeue": "Requeued"}.get(
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


def outcome_of(ray_job: RayJob, result: dict[str, Any] | None) -> Outcome:
    if result and result.get("ok") and ray_job.status == "SUCCEEDED":
        return Outcome("succeeded", "Succeeded", "", result)
    if result is None:  # the driver died before its result record (killed, its node lost)
        message = ray_job.message or f"Ray job {ray_job.status} without a result"
        return Outcome("lost", "DriverLost", f"the driver ended ({ray_job.status}) without a result: {message}"[:1000],
                       {})
    if _refused_by_old_driver(result):
        return Outcome("failed", "ProtocolIncompatible",
                       f"this runtime speaks protocol 1.0 (it refuses request fields it does not know); the operator "
                       f"needs {PROTOCOL}: {UPGRADE_HINT}", result)
    error = result.get("error") or {"reason": "DriverFailed", "stage": "run",
                                    "message": ray_job.message or f"Ray job {ray_job.status}"}
    reason = error.get("reason") or "Failed"
    if reason == "ProtocolIncompatible":
        return Outcome("failed", reason, str(error.get("message", ""))[:1000], result)
    where = error.get("summary") or f"failed in {error.get('stage') or 'run'}"
    message = f"{where}: {reason}: {error.get('message', '')}"[:1000]
    if reason == "OutOfMemory":
        kind = "oom"
    elif reason == "NoPlacement":
        kind = "requeue"
    elif reason in LOST_REASONS:
        kind = "lost"
    else:
        kind = "failed"
    return Outcome(kind, reason, message, result)


def success_changes(status: dict[str, Any], result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(status changes, measured) for a job whose attempt succeeded."""
    measured = {k: v for k, v in (result.get("measured") or {}).items() if v is not None}
    cache = result.get("cache") or None
    if cache and cache.get("evaluations") is not None:
        total = cache.get("evaluations", 0) + cache.get("skipped", 0)
        if total:
            measured["cacheSkipRatio"] = round(cache.get("skipped", 0) / total, 4)
    output = result.get("output") or {}
    estimated = (status.get("plan") or {}).get("estimatedPeakGiBPerGPU")
    message = (f"wrote {output.get('uri') or output.get('video')} ({output.get('bytes')} bytes); "
               f"peak {measured.get('peakGiB')} GiB per rank, planned {estimated}")
    steps = (status.get("progress") or {}).get("steps") or result.get("steps") or 0
    changes = {"measured": measured, "message": message,
               "progress": {"step": steps, "steps": steps, "percent": 100},
               "output": {"uri": output.get("uri") or output.get("video"), "bytes": output.get("bytes"),
                          "framesDigest": result.get("framesDigest")}}
    return changes, measured


def story(attempts: list[dict[str, Any]]) -> str:
    """Every attempt in one line: what it ran with and how it ended."""
    parts = []
    for a in attempts:
        summary = ((a.get("plan") or {}).get("summary") or "?")
        klass = (a.get("plan") or {}).get("gpuClass")
        where = f"{summary} on {klass}" if klass else summary
        parts.append(f"attempt {a.get('number')} ({where}): {a.get('result')} {a.get('reason') or ''}".strip())
    return "; ".join(parts)


__all__ = ["LOST_REASONS", "Outcome", "outcome_of", "story", "success_changes"]
