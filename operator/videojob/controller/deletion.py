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

log = logging.getLogger("videojob.controller")


class Deletion:
    """``JobLifecycle``'s deletion (see the module)."""

    def delete(self, status: dict[str, Any], deadline_s: float = 8.0) -> None:
        """The finalizer's work: stop the driver, make sure its group is gone,
        release the GPUs. Bounded by ``deadline_s``; a job that never started returns at once."""
        self.deleting.set()
        start = time.monotonic()
        with self.submit_lock:  # no submission can slip in after this point
            attempts = status.get("attempts") or []
            active = next((a for a in reversed(attempts) if a.get("submissionId")), None)
        admissions = self.ctx.admissions
        try:
            if active is not None:
                self._stop_driver(active, start + deadline_s)
            kept = (status.get("actorGroup") or {})
            if kept.get("kept") and kept.get("name") in admissions.idle_groups():
                admissions.forget_group(kept["name"])  # its owner is going: so does its warm group
                teardown_groups(self.ctx.ray, [kept["name"]], self.ctx.launch, f"{self.key} deleted")
                self.ctx.metrics.evictions.labels(why="owner-deleted").inc()
        except RayUnavailable as exc:
            log.warning("%s: deleted while Ray is unreachable (%s); what it left is for the sweeper", self.key, exc)
        finally:
            admissions.cancel(self.key)
            self.ctx.metrics.set_phase(self.key, None)
            self._capacity_metrics()

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
