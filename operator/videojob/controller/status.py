"""A job's status as the operator last wrote it: change it, and it is written only if it changed.

``StatusBook`` keeps the status the server holds, merges changes into it
(JSON merge patch semantics: dicts merge, lists and values replace, None
removes), writes only when the result differs, keeps each condition's
lastTransitionTime unless its status flips, and calls ``on_phase`` once per
phase change (the controller turns that into a Kubernetes event).
"""

from __future__ import annotations

import copy
from datetime import datetime, timezone
from typing import Any, Callable

from ..api.status import ConditionType, Phase, Reason
from .kube import Conflict, Gone, VideoJobs
from .outcome import clip


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class StatusBook:
    def __init__(self, jobs: VideoJobs, namespace: str, name: str,
                 on_phase: Callable[[str, str, str], None] | None = None, uid: str | None = None):
        self.jobs, self.namespace, self.name = jobs, namespace, name
        self.uid = uid  # every write is to this object only (a job made again under the name is another)
        self.on_phase = on_phase
        self.status: dict[str, Any] = {}
        self.resource_version: str | None = None
        self.generation: int | None = None
        self.writes = 0

    def load(self) -> dict[str, Any]:
        obj = self.jobs.get(self.namespace, self.name)
        if self.uid is not None and obj["metadata"].get("uid") not in (None, self.uid):
            raise Gone(f"{self.namespace}/{self.name} (uid {self.uid}): another object of that name now")
        self.status = obj.get("status") or {}
        self.resource_version = obj["metadata"].get("resourceVersion")
        self.generation = obj["metadata"].get("generation")
        return obj

    @property
    def phase(self) -> str:
        return self.status.get("phase", Phase.PENDING.value)

    def condition(self, type_: ConditionType, status: str, reason: Reason, message: str = "",
                  base: list[dict] | None = None) -> list[dict]:
        """The conditions list (``base``, else the status's) with this one set (its
        transition time kept unless its status flips)."""
        conditions = [dict(c) for c in (self.status.get("conditions", []) if base is None else base)]
        old = next((c for c in conditions if c.get("type") == type_.value), None)
        entry = {"type": type_.value, "status": status, "reason": reason.value, "message": clip(message, 1024),
                 "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == status
                 and old.get("lastTransitionTime") else now(),
                 "observedGeneration": self.generation}
        if old is not None:
            conditions[conditions.index(old)] = entry
        else:
            conditions.append(entry)
        return conditions

    def update(self, changes: dict[str, Any], expect: bool = False, event_message: str = "") -> bool:
        """Write ``changes`` if they change anything. ``expect``: only if the object
        is unchanged since it was read (raises Conflict; the caller re-reads)."""
        changes = dict(changes)
        if self.generation is not None:
            changes.setdefault("observedGeneration", self.generation)
        target = merged(self.status, changes)
        if target == self.status:
            return False
        before = self.phase
        patch = {k: v for k, v in changes.items() if self.status.get(k) != v}
        try:
            obj = self.jobs.patch_status(self.namespace, self.name, patch,
                                         expect=self.resource_version if expect else None, uid=self.uid,
                                         known=self.status if self.resource_version is not None else None)
        except Conflict:
            raise
        self.status = obj.get("status") or target
        self.resource_version = obj["metadata"].get("resourceVersion")
        self.writes += 1
        after = self.phase
        if after != before and self.on_phase is not None:
            self.on_phase(before, after, event_message or self.status.get("message", ""))
        return True


__all__ = ["Conflict", "StatusBook", "merged", "now"]
