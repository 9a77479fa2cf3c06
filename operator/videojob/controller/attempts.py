"""An attempt: written to status with its submission id, then its driver submitted.

Mixed into ``JobLifecycle``. ``_start_attempt`` writes the attempt, its
group and its deterministic submission id (conditionally on the
resourceVersion it read) before anything exists in Ray; ``_ensure_submitted``
asks Ray for that id and submits the driver only if Ray does not know it (a
restarted operator adopts it; a duplicate POST is adopted too). Every driver
goes through ``DriverLaunch`` (0 CPUs, the driver resources). ``_request`` is
what the driver gets (``driver_protocol.DriverRequest``), including the node
type the placement may wait for (the class: KubeRay's worker group name).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..api import VideoJob
from ..api.status import ConditionType, Phase, Reason
from ..driver_protocol import DriverRequest, GroupRequest, group_name, submission_id
from ..jobrequest import job_fields, seed_for
from ..raycluster.client import RayRefused
from ..scheduling import Admission
from .context import Stopped
from .kube import Conflict
from .status import now

log = logging.getLogger("videojob.controller")
FAULT_ANNOTATION = "videojob.io/inject-fault"


class Attempts:
    """``JobLifecycle``'s attempts and their submission (see the module)."""

    def _active_attempt(self) -> dict[str, Any] | None:
        attempts = self.book.status.get("attempts") or []
        if attempts and attempts[-1].get("result") == "Running":
            return attempts[-1]
        return None

    def _start_attempt(self, stopped, job: VideoJob, plan: dict[str, Any], admission: Admission) -> dict[str, Any]:
        """Write the attempt, its group and its submission id before anything is submitted."""
        while True:
            attempts = list(self.book.status.get("attempts") or [])
            number = len(attempts) + 1
            group = admission.reuse or group_name(self.uid, f"a{number}")
            attempt = {"number": number, "plan": plan, "startedAt": now(), "result": "Running", "group": group,
                       "submissionId": submission_id(self.namespace, self.name, self.uid, number)}
            if admission.workload:
                attempt["workload"] = admission.workload
            what = f"warm group {group}" if admission.reuse else f"{plan['gpus']} rank(s) reserved"
            # Running from this write on (one write, not one before and one after
            # the submission): the submission id is durable before the driver exists,
            # and a restart finds the attempt and submits or adopts its driver.
            changes, event = self._with_plan(
                {"attempts": attempts + [attempt], "queue": None, "phase": Phase.RUNNING.value,
                 "message": f"attempt {number}: driver {attempt['submissionId']} on {admission.klass} "
                            f"pod {admission.pod}",
                 "actorGroup": {"name": group, "reused": bool(admission.reuse), "kept": False}},
                (ConditionType.ADMITTED, "True", Reason.REUSED_WARM_GROUP if admission.reuse else Reason.ADMITTED,
                 f"{what} on {admission.klass} pod {admission.pod}"
                 + (" (backfilled)" if admission.backfilled else "")))
            if not self.book.status.get("startTime"):
                changes["startTime"] = attempt["startedAt"]
            try:
                self.book.update(changes, expect=True, event_message=event)
                self._unwritten_plan = None
                # The group is this job's in the books before its driver can create it.
                self.ctx.admissions.attach(self.key, group)
                return attempt
            except Conflict:
                log.info("%s: status changed while starting an attempt; re-reading", self.key)
                self.book.load()
                active = self._active_attempt()
                if active is not None:  # someone (a previous life of this operator) already started one
                    self.ctx.admissions.attach(self.key, active.get("group") or group_name(self.uid))
                    return active

    def _fault(self, number: int) -> dict[str, Any] | None:
        """The test-only fault for attempt ``number`` (settings.allow_fault_injection)."""
        raw = self.annotations.get(FAULT_ANNOTATION)
        if not raw or not self.ctx.settings.allow_fault_injection:
            return None
        try:
            fault = json.loads(raw)
        except ValueError:
            log.warning("%s: %s is not JSON; ignored", self.key, FAULT_ANNOTATION)
            return None
        if number not in (fault.pop("attempts", None) or [1]):
            return None
        return fault

    def _job_id(self, attempt: dict[str, Any]) -> str:
        """The id the ranks know this attempt by (their cancel tokens are kept per id):
        one per attempt and per object, so a cancel or a preemption meant for it can
        never stop another attempt, or another namespace's job of the same name, that
        a warm group runs later."""
        return f"{self.name}-{self.uid[:8]}-a{attempt['number']}"

    def _request(self, job: VideoJob, plan: dict[str, Any], attempt: dict[str, Any]) -> DriverRequest:
        settings, inventory = self.ctx.settings, self.ctx.inventory
        fields = job_fields(job, plan, job_id=self._job_id(attempt), output_name=self.name, seed=seed_for(job))
        fault = self._fault(attempt["number"])
        if fault is not None:
            fields["inject_fault"] = fault
        klass = inventory.get(plan["gpuClass"]) if plan.get("gpuClass") else inventory.classes[0]
        bundle = {klass.resource: 1.0} if inventory.uses_class_resources else {}
        return DriverRequest(
            namespace=self.namespace, name=self.name, uid=self.uid, attempt=attempt["number"],
            group=GroupRequest(name=attempt.get("group") or group_name(self.uid), ulysses=plan["ulysses"],
                               ring=plan["ring"], cfg=plan["cfg"], device=inventory.device,
                               bundle_resources=bundle, keep=settings.warm_group_ttl_s > 0 and self.ctx.kueue is None, node_type=klass.name,
                               cpus_per_rank=settings.cpus_per_rank if inventory.device == "cpu" else None),
            job=fields, output_uri=job.spec.output.uri if job.spec.output else None,
            placement_timeout_s=settings.placement_timeout_s, placement_max_wait_s=settings.placement_max_wait_s,
            job_timeout_s=settings.job_timeout_s, progress_interval_s=min(settings.progress_interval_s, 1.0),
        )

    def _refused(self, attempt: dict[str, Any], exc: RayRefused) -> None:
        """Ray refused the driver for good: the attempt and the job fail at once,
        saying what answered (sending it again would get the same answer)."""
        message = (f"attempt {attempt['number']}: {exc}; not retried: check that VIDEOJOB_RAY_DASHBOARD_URL is the "
                   "Ray head's dashboard (port 8265) and what any proxy in front of it allows")
        attempts = [dict(a, result="Failed", reason=Reason.SUBMISSION_REFUSED.value, finishedAt=now(),
                         message=message[:1000]) if a.get("number") == attempt["number"] else a
                    for a in self.book.status.get("attempts") or []]
        self.ctx.metrics.attempts.labels(result="Failed").inc()
        self._fail(Reason.SUBMISSION_REFUSED, message, changes={"attempts": attempts})

    def _ensure_submitted(self, stopped, job: VideoJob, plan: dict[str, Any], attempt: dict[str, Any]) -> None:
        sid = attempt["submissionId"]
        existing = self._ray(stopped, lambda: self.ctx.ray.job(sid), Phase.RUNNING.value)
        if existing is None:
            request = self._request(job, plan, attempt)
            with self.submit_lock:
                if self.deleting.is_set():
                    raise Stopped
                launch = self.ctx.launch
                entrypoint, runtime_env = request.submission(launch.python)  # queries off the command line
                try:
                    created = self._ray(stopped, lambda: launch.submit(
                        self.ctx.ray, sid, entrypoint, runtime_env=runtime_env,
                        metadata={"videojob.io/namespace": self.namespace, "videojob.io/name": self.name,
                                  "videojob.io/uid": self.uid, "videojob.io/attempt": str(attempt["number"])}),
                        Phase.RUNNING.value)
                except RayRefused as exc:
                    self._refused(attempt, exc)
                    raise Stopped from None
            if created:
                self.ctx.metrics.submissions.inc()
            message = f"attempt {attempt['number']}: driver {sid} " + ("submitted" if created else "adopted")
        else:
            message = f"attempt {attempt['number']}: driver {sid} adopted ({existing.status})"
        log.info("%s: %s", self.key, message)
        # Written with the attempt already; only a status that says otherwise (an
        # attempt resumed after a restart or a Ray outage) is corrected here.
        self.book.update({"phase": Phase.RUNNING.value,
                          "actorGroup": {"name": attempt.get("group") or group_name(self.uid),
                                         "reused": bool((self.book.status.get("actorGroup") or {}).get("reused")),
                                         "kept": False}},
                         event_message=message)
