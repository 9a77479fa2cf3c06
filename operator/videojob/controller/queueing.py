"""Waiting for GPUs: a job's place in the scheduler's queue, shown in its status.

Mixed into ``JobLifecycle``: ``_admit`` asks the scheduler (``Admissions``)
until it admits the job (on its own class, or spilled to another), writing
``Queued`` with the place and what the job waits for at most every
``queue_status_interval_s``; ``_evict`` tears down the idle warm groups an
admission takes the GPUs of. Run parked (the operator's job runner), a job
not admitted at its first look raises ``Parked`` instead of polling: its
thread is free while it waits, and the runner calls it again when the
scheduler's admission loop admitted it or its place moved.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..api import VideoJob
from ..api.status import ConditionType, Phase, Reason
from ..planner.classes import class_rank
from ..planner.memory import OFFLOAD_MODES
from ..raycluster.client import RayUnavailable
from ..scheduling import Admission, Ask, Fallback
from .context import Parked, Stopped, epoch
from .groups import teardown_groups

log = logging.getLogger("videojob.controller")


class Queueing:
    """``JobLifecycle``'s admission (see the module)."""

    def _admit(self, stopped, job: VideoJob, plan: dict[str, Any]) -> tuple[Admission, dict[str, Any]]:
        """Wait for GPUs; returns the admission and the plan it runs with (another
        class's layout when the scheduler let the job spill there). In kueue mode Kueue admits it."""
        if self.ctx.kueue is not None:
            return self._admit_kueue(stopped, job, plan)
        klass = plan.get("gpuClass") or self.ctx.inventory.classes[0].name
        if self._waiting_ask is None:
            # The job as the scheduler sees it, and its plan on each other class it could
            # spill to: kept while it waits parked (re-planned only after an admission). Not
            # the planner's whole choice: that was ~10 KiB a queued job, 100 MB at 10,000.
            choice, self._last_choice = self._last_choice or self._choice(job), None
            spills: dict[str, dict[str, Any]] = {}
            fallbacks = []
            for name, (k, a) in {k.name: (k, a) for k, a in choice.options}.items():
                if name != klass:
                    spills[name] = alt = self._plan_status(None, (k, a))
                    fallbacks.append(Fallback(name, a.layout.gpus, a.seconds, self._pool_key(job, alt),
                                              class_rank(k, a)[0]))
            self._waiting_ask = (self._ask(job, plan, tuple(fallbacks)), spills)
        ask, spills = self._waiting_ask
        # Kept on the job across parked calls: a place is rewritten only when it moved.
        last_write, last_place = self._queue_shown
        while True:
            try:
                admission, position, why = self.ctx.admissions.request(ask, pass_now=not self.parking)
            except ValueError as exc:  # more GPUs than one pod of the class: never
                self._waiting_ask = None
                self._fail(Reason.DOES_NOT_FIT, f"{exc}: it can never run here", ConditionType.ADMITTED)
                raise Stopped from None
            if self.deleting.is_set():
                # Deleted while this thread was on its way here: the finalizer cancelled the
                # job's place before this request made it again (a ghost the next pass grants).
                self.ctx.admissions.cancel(self.key)
                raise Stopped
            self._capacity_metrics()
            if admission is not None:
                self._waiting_ask, self._queue_shown = None, (float("-inf"), None)
                if admission.evict:
                    self._evict(admission.evict, "needed by " + self.key)
                if admission.spilled and admission.klass in spills:
                    spilled = spills[admission.klass]
                    self._unwritten_plan = (spilled, f"spilled from {klass}, where it would have waited, to "
                                                     f"{admission.klass}, where it ends sooner")
                    return admission, spilled
                return admission, plan
            if position is None:  # parked, and not placed by a pass yet: shown once it is
                self._park_job(job)
                raise Parked
            clock = time.monotonic()
            if last_place is None or (position != last_place
                                      and clock - last_write >= self.ctx.settings.queue_status_interval_s):
                changes, event = self._with_plan(
                    {"phase": Phase.QUEUED.value, "queue": {"position": position, "waitingFor": why},
                     "message": f"waiting for {why}"},
                    (ConditionType.ADMITTED, "False", Reason.WAITING_FOR_GPUS, f"waiting for {why}"))
                if self.book.update(changes, event_message=event):
                    last_write = clock
                self._unwritten_plan = None
                last_place = position
                self._queue_shown = (last_write, last_place)
            if self.parking:  # the job runner waits for the admission without a thread
                self._park_job(job)
                raise Parked
            self._wait(stopped, self.ctx.settings.poll_interval_s)

    def _ask(self, job: VideoJob, plan: dict[str, Any], fallbacks: tuple[Fallback, ...] = ()) -> Ask:
        """The job as the scheduler sees it: its class, GPUs, priority and age (the
        creation time: a preempted job waits again in its old place), and whether a
        job of higher priority may preempt it (it resumes from the checkpoint it saves
        then, so it loses about a restart: the plan's load and encode, at least 30 s)."""
        klass = plan.get("gpuClass") or self.ctx.inventory.classes[0].name
        seconds = plan.get("seconds") or {}
        restart = max(30.0, float(seconds.get("load") or 0.0) + float(seconds.get("encode") or 0.0))
        return Ask(self.key, klass, plan["gpus"], job.spec.resources.priority,
                   epoch(str(job.metadata.get("creationTimestamp", ""))),
                   float(plan.get("estimatedSeconds") or 60.0), self._pool_key(job, plan),
                   offload_rank=OFFLOAD_MODES.index(plan.get("offload") or "none"), fallbacks=fallbacks,
                   preemptible=job.spec.resources.preemptible, restart_s=restart,
                   resumable=(job.spec.resolved().sampling.steps or 0) >= 2)

    def _evict(self, groups: tuple[str, ...], why: str) -> None:
        """Tear down idle warm groups whose GPUs this job needs (and wait, bounded, for them to go)."""
        self.ctx.metrics.evictions.labels(why="needed").inc(len(groups))
        try:
            left = teardown_groups(self.ctx.ray, groups, self.ctx.launch, why, wait_s=60.0)
        except RayUnavailable as exc:
            log.warning("%s: could not evict %s (%s); the placement waits for them", self.key, groups, exc)
            return
        if left:
            log.warning("%s: evicted groups %s still present after 60 s; the placement waits for them",
                        self.key, left)
