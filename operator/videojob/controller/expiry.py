"""Finished VideoJobs expire: ``spec.ttlSecondsAfterFinished`` (as batch Jobs have it), or
the operator's default (``VIDEOJOB_TTL_SECONDS_AFTER_FINISHED``), after the job ended.

Why: a finished job's status holds its whole story (plan, attempts, result), and the
operator lists every VideoJob at each sweep and at a restart; kept for ever, tens of
thousands of them made both slow and the API server's storage grow without end. The
outputs are written before a job is Succeeded, so expiry never takes a video with it.

The sweeper calls ``due`` on what it listed anyway, and deletes what is due with the
job's uid as a precondition (a job of the same name made since is not touched); the
deletion runs the finalizer like any other (drivers, Workloads and groups go with it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

from .context import TERMINAL, parse_time

KEEP = -1  # the operator setting's "never": finished jobs stay until someone deletes them


@dataclass(frozen=True)
class Expired:
    namespace: str
    name: str
    uid: str
    phase: str
    finished_s_ago: float


def finished_at(status: dict[str, Any]) -> float | None:
    """When the job ended: its completionTime, else its Completed condition's change."""
    if status.get("completionTime"):
        return parse_time(status["completionTime"])
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Completed" and condition.get("lastTransitionTime"):
            return parse_time(condition["lastTransitionTime"])
    return None


def ttl_of(obj: dict[str, Any], default_ttl_s: int) -> int | None:
    """The job's TTL in seconds, or None when it is kept."""
    ttl = (obj.get("spec") or {}).get("ttlSecondsAfterFinished")
    if isinstance(ttl, int) and not isinstance(ttl, bool) and ttl >= 0:
        return ttl
    return None if default_ttl_s == KEEP else default_ttl_s


def due(objs: Iterable[dict[str, Any]], default_ttl_s: int, clock: float | None = None) -> list[Expired]:
    """The finished jobs among ``objs`` whose TTL has passed, oldest first."""
    clock = time.time() if clock is None else clock
    out = []
    for obj in objs:
        status = obj.get("status") or {}
        phase = status.get("phase")
        meta = obj.get("metadata") or {}
        if phase not in TERMINAL or meta.get("deletionTimestamp"):
            continue
        ttl, ended = ttl_of(obj, default_ttl_s), finished_at(status)
        if ttl is None or ended is None or clock < ended + ttl:
            continue
        out.append(Expired(meta["namespace"], meta["name"], meta["uid"], phase, clock - ended))
    return sorted(out, key=lambda e: -e.finished_s_ago)
