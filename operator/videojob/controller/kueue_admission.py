"""kueue admission mode: an attempt waits for Kueue to admit its Workload.

Mixed into ``JobLifecycle`` (``settings.admission == "kueue"``; the module
``videojob.kueue`` builds and reads the Workloads). ``_admit_kueue`` creates
(or, after a restart, finds) the attempt's Workload and shows Kueue's reason
while it is pending; admitted on a flavor of another class, the job is
re-planned for that class. ``_kueue_eviction`` is how a running attempt
learns that Kueue evicted or preempted it (it then stops as a preempted
attempt does: a checkpoint first). ``_kueue_release`` marks the job's
Workloads Finished once an attempt has ended, so Kueue frees their quota.
Run parked (the job runner), a job whose Workload waits raises ``Parked``:
it holds no thread until the Workload watch sees that Workload change.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..api import VideoJob
from ..api.status import ConditionType, Phase, Reason
from ..kueue import LABEL_ATTEMPT, class_of_flavor, read_workload, workload_for
from ..scheduling import Admission
from .context import Parked
from .kube import with_retries

log = logging.getLogger("videojob.controller")


class KueueQueueing:
    """``JobLifecycle``'s admission through Kueue (see the module)."""

    def _admit_kueue(self, stopped, job: VideoJob, plan: dict[str, Any]) -> tuple[Admission, dict[str, Any]]:
        kueue, settings = self.ctx.kueue, self.ctx.settings
        choice, self._last_choice = self._last_choice or self._choice(job), None
        options = {k.name: (k, a) for k, a in choice.options}
        number = len(self.book.status.get("attempts") or []) + 1
        queue = job.spec.queue_name or settings.kueue_default_queue
        priority = job.spec.resources.priority
        # Back from a park: the Workload it waits for is there, and so is its priority class.
        parked, self._kueue_parked = self._kueue_parked, None
        if parked is None:
            self._kueue_call(stopped, lambda: kueue.ensure_priority_class(priority), "WorkloadPriorityClass")
        shown, self._kueue_shown = self._kueue_shown, None
        paused = parked is None and self._kueue_paused(stopped)
        while True:
            body = workload_for(namespace=self.namespace, name=self.name, uid=self.uid, attempt=number, plan=plan,
                                queue=queue, priority=priority, inventory=self.ctx.inventory,
                                cpus_per_rank=settings.cpus_per_rank, active=not paused)
            name = body["metadata"]["name"]
            wl = None
            if parked is not None and parked[0] == name:  # read from the watch's cache, not made again
                wl = self._kueue_call(stopped, lambda: kueue.get(self.namespace, name), f"Workload {name}")
            parked = None
            if wl is None:
                wl = self._kueue_call(stopped, lambda: kueue.create(body), f"Workload {name}")
            state = read_workload(wl)
            while not state.admitted or state.evicted is not None:
                if state.finished:  # finished before it ran (by hand): it goes, and one is made again
                    log.warning("%s: Workload %s was finished before its attempt ran; replacing it", self.key, name)
                    self._kueue_call(stopped, lambda: kueue.delete(self.namespace, name), f"Workload {name}")
                    self._wait(stopped, settings.kueue_poll_interval_s)
                    wl = None
                    break
                if state.admitted and state.evicted is not None:
                    # Admitted, then evicted before this attempt started: nothing to stop;
                    # give the quota back so Kueue can queue the Workload again.
                    log.info("%s: Workload %s evicted before its attempt started (%s); requeued", self.key,
                             name, state.evicted[0])
                    self._kueue_call(stopped, lambda: kueue.requeue(self.namespace, name), f"Workload {name}")
                message = f"waiting for Kueue (LocalQueue {queue}, Workload {name}): {state.waiting}"
                reason = Reason.KUEUE_PENDING
                if state.deactivated:
                    message, reason = deactivated_message(self.namespace, name), Reason.KUEUE_DEACTIVATED
                if message != shown:
                    changes, event = self._with_plan(
                        {"phase": Phase.QUEUED.value, "queue": None, "message": message[:1000]},
                        (ConditionType.ADMITTED, "False", reason, message))
                    self.book.update(changes, event_message=event)
                    self._unwritten_plan = None
                    shown = message
                if self.parking:  # the job runner wakes it when the Workload changes (its watch)
                    version = (wl.get("metadata") or {}).get("resourceVersion")
                    self._kueue_parked, self._kueue_shown, self._last_choice = (name, version), shown, choice
                    self._park_job(job)
                    raise Parked
                self._wait(stopped, settings.kueue_poll_interval_s)
                wl = self._kueue_call(stopped, lambda: kueue.get(self.namespace, name), f"Workload {name}")
                if wl is None:  # deleted under us (by hand): a new one
                    break
                state = read_workload(wl)
            if wl is None:
                continue
            klass = class_of_flavor(state.flavor, self._kueue_flavors(stopped, state.flavor), self.ctx.inventory)
            planned = plan.get("gpuClass") or self.ctx.inventory.classes[0].name
            if klass and klass != planned and klass in options:
                other = self._plan_status(None, options[klass])
                why = (f"Kueue admitted Workload {name} on flavor {state.flavor}, class {klass}, not the planned "
                       f"{planned}: re-planned for {klass}")
                log.info("%s: %s", self.key, why)
                self._unwritten_plan = (other, why)
                if int(other["gpus"]) > int(plan["gpus"]):  # more than Kueue reserved: ask for that much
                    # Deleted, not finished: a restart before the new one exists makes this one again.
                    self._kueue_call(stopped, lambda: kueue.delete(self.namespace, name), f"Workload {name}")
                    plan = other
                    continue
                plan = other
            elif klass and klass != planned:
                log.warning("%s: Kueue admitted Workload %s on flavor %s (class %s), for which the job has no "
                            "layout; it runs its planned class %s", self.key, name, state.flavor, klass, planned)
            klass_name = plan.get("gpuClass") or planned
            self.ctx.admissions.running(self.key, klass_name, int(plan["gpus"]),
                                        float(plan.get("estimatedSeconds") or 60.0), None, self._pool_key(job, plan))
            self._capacity_metrics()
            return Admission(self.key, klass_name, 0, int(plan["gpus"]), workload=name), plan

    def _kueue_paused(self, stopped) -> bool:
        """Whether the job waits for someone to activate it again: the newest of its Workloads
        (by attempt) is deactivated (spec.active false), so its next one is made inactive too.
        Read from Kueue's objects, not from the job's status: a restart or another condition
        written meanwhile loses nothing."""
        if not self.book.status.get("attempts"):
            return False
        mine = self._kueue_call(stopped, lambda: self.ctx.kueue.of_job(self.namespace, self.uid),
                                "Workloads of the job")
        newest = max(mine, key=lambda wl: int((wl["metadata"].get("labels") or {}).get(LABEL_ATTEMPT) or 0),
                     default=None)
        return newest is not None and read_workload(newest).deactivated

    def parked_workload(self) -> tuple[str, str, str | None] | None:
        """(namespace, name, the resourceVersion it last read) of the Workload the job
        parked on waiting for Kueue; None when it did not park on one."""
        parked = self._kueue_parked
        return (self.namespace, parked[0], parked[1]) if parked is not None else None

    def _kueue_flavors(self, stopped, flavor: str | None) -> dict[str, dict[str, str]]:
        if not flavor or any(c.name == flavor for c in self.ctx.inventory.classes):
            return {}
        return self._kueue_call(stopped, self.ctx.kueue.flavors, "ResourceFlavors")

    def _kueue_call(self, stopped, call, what: str):
        """``call()`` until the API server answers (retrying 429/5xx, then every poll interval)."""
        while True:
            try:
                return with_retries(call, what)
            except Exception as exc:  # noqa: BLE001 - an API server away must not fail the job
                status = getattr(exc, "status", None)
                if status is not None and status not in (429, 500, 502, 503, 504):
                    raise
                log.warning("%s: %s: %s; again in %g s", self.key, what, exc, self.ctx.settings.kueue_poll_interval_s)
                self._wait(stopped, self.ctx.settings.kueue_poll_interval_s)

    def _kueue_eviction(self, attempt: dict[str, Any]) -> tuple[str, str] | None:
        """(Kueue's reason, its message) once the attempt's Workload is evicted or
        preempted (or gone); None while it holds its admission. Looked at every
        ``kueue_poll_interval_s`` at most."""
        name = attempt.get("workload")
        if self.ctx.kueue is None or not name:
            return None
        clock = time.monotonic()
        if clock - getattr(self, "_kueue_looked", float("-inf")) < self.ctx.settings.kueue_poll_interval_s:
            return None
        self._kueue_looked = clock
        try:
            wl = with_retries(lambda: self.ctx.kueue.get(self.namespace, name), f"Workload {name}")
        except Exception as exc:  # noqa: BLE001 - looked at again next time
            log.warning("%s: Workload %s not read (%s)", self.key, name, exc)
            return None
        if wl is None:
            return ("WorkloadDeleted", f"its Workload {name} was deleted")
        state = read_workload(wl)
        if state.evicted is not None:
            return state.evicted
        if state.deactivated:  # Kueue evicts it next: the pause starts now
            return ("Deactivated", f"its Workload {name} was deactivated (spec.active: false)")
        if not state.admitted:
            return ("AdmissionRemoved", state.waiting or "Kueue no longer admits its Workload")
        return None

    def _kueue_release(self, why: str) -> None:
        """Every Workload of the job not yet Finished is marked so (its quota freed):
        after an attempt's end, and at the job's end."""
        kueue = self.ctx.kueue
        if kueue is None:
            return
        try:
            for wl in with_retries(lambda: kueue.of_job(self.namespace, self.uid), "Workloads of the job"):
                if not read_workload(wl).finished:
                    kueue.finish(self.namespace, wl["metadata"]["name"], "VideoJobAttemptEnded", why)
        except Exception:  # noqa: BLE001 - the next end, or the deletion (owner references), releases them
            log.warning("%s: Workloads not marked Finished", self.key, exc_info=True)

    def _kueue_delete(self) -> None:
        """At deletion: the job's Workloads go with it (owner references would, later)."""
        kueue = self.ctx.kueue
        if kueue is None:
            return
        try:
            for wl in with_retries(lambda: kueue.of_job(self.namespace, self.uid), "Workloads of the job"):
                kueue.delete(self.namespace, wl["metadata"]["name"])
        except Exception:  # noqa: BLE001 - the garbage collector deletes them (owner references)
            log.warning("%s: Workloads not deleted; the garbage collector will", self.key, exc_info=True)


def deactivated_message(namespace: str, workload: str) -> str:
    """What a job paused by a deactivated Workload says: why it waits, and the command that ends the wait."""
    return (f"Workload {workload} is deactivated (its spec.active is false), so Kueue does not admit it; the job "
            f"waits and resumes from its checkpoint once it is active: kubectl patch workloads.kueue.x-k8s.io "
            f"{workload} -n {namespace} --type merge -p '{{\"spec\":{{\"active\":true}}}}'")


__all__ = ["KueueQueueing", "deactivated_message"]
