"""A VideoJob's deletion: the finalizer's work, bounded.

Mixed into ``JobLifecycle``: stop the driver (``POST .../stop``: SIGTERM, it
removes its group), check through Ray's State API that no actor or placement
group of the job is left (else submit a teardown driver), forget a warm group
the job kept, and release the job's GPUs in the scheduler's books.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..driver_protocol import group_name
from ..raycluster.client import RayUnavailable
from .groups import present, teardown_groups
from .hygiene import forget_drivers

log = logging.getLogger("videojob.controller")


class Deletion:
    """``JobLifecycle``'s deletion (see the module)."""

    def delete(self, status: dict[str, Any], deadline_s: float = 8.0) -> None:
        """The finalizer's work: stop the driver, make sure its group is gone,
        release the GPUs. Bounded by ``deadline_s``; a job that never started returns at once."""
        self.deleting.set()
        start = time.monotonic()
        with self.submit_lock:  # no submission can slip in after this point
            # What the API server holds now, not kopf's copy: that copy may predate an
            # attempt written (and its driver submitted) just before this lock was taken.
            status = self._current_status(status)
            attempts = status.get("attempts") or []
            active = next((a for a in reversed(attempts) if a.get("submissionId")), None)
        admissions = self.ctx.admissions
        try:
            if active is not None:
                self._stop_driver(active, start + deadline_s)
            kept = (status.get("actorGroup") or {})
            # Forgotten only if still idle, checked and forgotten at once: a group another
            # job was just admitted onto is that job's now, and is never torn down here.
            if kept.get("kept") and kept.get("name") and admissions.forget_group(kept["name"]):
                teardown_groups(self.ctx.ray, [kept["name"]], self.ctx.launch, f"{self.key} deleted")
                self.ctx.metrics.evictions.labels(why="owner-deleted").inc()
            forget_drivers(self.ctx.ray, attempts, self.uid, kept.get("name") if kept.get("kept") else None)
        except RayUnavailable as exc:
            log.warning("%s: deleted while Ray is unreachable (%s); what it left is for the sweeper", self.key, exc)
        finally:
            self._kueue_delete()
            admissions.cancel(self.key)
            self.ctx.metrics.set_phase(self.key, None)
            self._capacity_metrics()

    def _current_status(self, given: dict[str, Any]) -> dict[str, Any]:
        """The job's status as the API server holds it (``given``, kopf's copy, when it
        cannot be read: gone already, or the server away)."""
        try:
            obj = self.ctx.jobs.get(self.namespace, self.name)
        except Exception as exc:  # noqa: BLE001 - Gone, or the API server away: kopf's copy is all there is
            log.info("%s: status not re-read at deletion (%s); using the deletion event's", self.key, exc)
            return given
        if obj.get("metadata", {}).get("uid") not in (None, self.uid):
            return given  # a new object of the same name: not this job's status
        return obj.get("status") or {}

    def _stop_driver(self, attempt: dict[str, Any], deadline: float) -> None:
        ray, sid = self.ctx.ray, attempt["submissionId"]
        group = attempt.get("group") or group_name(self.uid)
        job = ray.job(sid)
        if job is not None and not job.terminal:
            ray.stop(sid)
            while time.monotonic() < deadline:
                job = ray.job(sid)
                if job is None or job.terminal:
                    break
                time.sleep(0.2)
        if attempt.get("result") != "Running" or group in self.ctx.admissions.idle_groups():
            return  # an attempt that ended left its group to the pool (or removed it)
        # The driver tears its group down on SIGTERM; if it was killed first, a
        # teardown driver removes what is left (Ray is reached over HTTP only).
        if present(ray, group):
            world = int((attempt.get("plan") or {}).get("gpus") or 8)
            teardown_groups(ray, [group], self.ctx.launch, f"{self.key} deleted",
                            wait_s=max(0.0, deadline - time.monotonic()), world=world)
