"""One VideoJob from creation to its end: plan, queue, submit, watch, finish; and deletion.

Plain Python over three interfaces (the Kubernetes status, a ``RayClient``,
the scheduler's ``Admissions``), so it runs the same under kopf, in tests, and in the load
benchmark with an instant Ray. kopf's daemon calls ``JobLifecycle.run``; its
deletion handler calls ``JobLifecycle.delete``.

Restart safety: everything needed to resume is in the status. The attempt
and its deterministic submission id are written (with the resourceVersion
it was computed from) before the driver is submitted; a resumed operator
finds the attempt, asks Ray for that submission id and adopts the driver
(or submits it, if the operator died between the two steps). Ray answers a
duplicate submission with "already exists", which is adopted too.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

from ..api import InvalidVideoJob, VideoJob, parse_videojob
from ..api.status import ConditionType, Phase, Reason
from ..driver_protocol import DriverRequest, GroupRequest, group_name, last_progress, result_of, submission_id
from ..inventory import ClusterInventory
from ..jobrequest import job_fields, seed_for
from ..metrics import Metrics
from ..planner.classes import class_rank, plan_classes
from ..planner.memory import OFFLOAD_MODES
from ..raycluster.client import RayAuthError, RayClient, RayJob, RayUnavailable
from ..scheduling import Admission, Ask, Fallback
from ..settings import OperatorSettings
from .admission import Admissions, pool_key
from .groups import present, teardown_groups
from .kube import Conflict, Gone, VideoJobs
from .outcome import Outcome, outcome_of, story, success_changes
from .status import StatusBook, now

log = logging.getLogger("videojob.controller")

EventFn = Callable[[str, str, str, str, str, str], None]  # (namespace, name, uid, type, reason, message)
TERMINAL = {Phase.SUCCEEDED.value, Phase.FAILED.value, Phase.CANCELLED.value}
_PLAN_KEYS = ("gpus", "ulysses", "ring", "cfg", "offload", "vaeTiling", "vaeSlicing", "cache", "fp8Weights",
              "decodeOffload", "summary")
FAULT_ANNOTATION = "videojob.io/inject-fault"


@dataclass
class Context:
    """What every job's lifecycle shares."""

    jobs: VideoJobs
    ray: RayClient
    admissions: Admissions
    inventory: ClusterInventory
    settings: OperatorSettings
    metrics: Metrics
    event: EventFn


class Stopped(Exception):
    """The daemon was asked to stop (operator shutdown or the job's deletion)."""


def _epoch(timestamp: str) -> float:
    try:
        return datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").timestamp()
    except (TypeError, ValueError):
        return time.time()


class JobLifecycle:
    def __init__(self, ctx: Context, namespace: str, name: str, uid: str):
        self.ctx, self.namespace, self.name, self.uid = ctx, namespace, name, uid
        self.key = f"{namespace}/{name}"
        self.deleting = threading.Event()
        self.submit_lock = threading.Lock()
        self.book = StatusBook(ctx.jobs, namespace, name, on_phase=self._phase_event)
        self.annotations: dict[str, str] = {}
        self._unwritten_plan: tuple[dict[str, Any], str] | None = None
        self._last_choice = None

    # -- helpers ---------------------------------------------------------------

    def _phase_event(self, before: str, after: str, message: str) -> None:
        kind = "Warning" if after == Phase.FAILED.value else "Normal"
        self.ctx.event(self.namespace, self.name, self.uid, kind, after, message or f"{before} -> {after}")
        self.ctx.metrics.set_phase(self.key, after)

    def _wait(self, stopped, seconds: float) -> None:
        """Sleep up to ``seconds``; ``stopped`` is kopf's daemon flag (or a threading.Event)."""
        if stopped.wait(seconds) or stopped.is_set() or self.deleting.is_set():
            raise Stopped

    def _capacity_metrics(self) -> None:
        self.ctx.metrics.set_capacity(self.ctx.admissions.snapshot())

    def _ray(self, stopped, call: Callable[[], Any], waiting_phase: str) -> Any:
        """``call()`` until Ray answers: while it cannot be reached (or refuses the
        token), say so in a condition and retry, never crash or give up."""
        while True:
            try:
                result = call()
            except RayUnavailable as exc:
                self.ctx.metrics.ray_errors.inc()
                reason = Reason.RAY_AUTH_FAILED if isinstance(exc, RayAuthError) else Reason.RAY_UNAVAILABLE
                log.warning("%s: %s", self.key, exc)
                self.book.update({"conditions": self.book.condition(ConditionType.ADMITTED, "Unknown", reason,
                                                                    f"{exc}; retrying every "
                                                                    f"{self.ctx.settings.ray_retry_s:g} s"),
                                  "message": str(exc)[:500], "phase": waiting_phase})
                self._wait(stopped, self.ctx.settings.ray_retry_s)
                continue
            return result

    def _fail(self, reason: Reason, message: str, condition: ConditionType = ConditionType.COMPLETED,
              changes: dict[str, Any] | None = None) -> None:
        self.book.update({"phase": Phase.FAILED.value, "message": message[:1000], "completionTime": now(),
                          "queue": None, **(changes or {}),
                          "conditions": self.book.condition(condition, "False", reason, message)},
                         event_message=message)
        self.ctx.admissions.cancel(self.key)
        self._capacity_metrics()

    # -- the lifecycle ---------------------------------------------------------

    def run(self, stopped) -> None:
        """From wherever the status says the job is, to its end (or until stopped)."""
        try:
            self._run(stopped)
        except (Stopped, Gone):
            log.info("%s: lifecycle stopped", self.key)
            return

    def _run(self, stopped) -> None:
        obj = self.book.load()
        self.annotations = dict(obj["metadata"].get("annotations") or {})
        self.ctx.metrics.set_phase(self.key, self.book.phase)
        if self.book.phase in TERMINAL:
            self.ctx.admissions.cancel(self.key)
            return
        try:
            job = parse_videojob(obj)
        except InvalidVideoJob as exc:  # the API server checks the same rules; this is a backstop
            self._fail(Reason.INVALID_SPEC, "; ".join(str(p) for p in exc.problems), ConditionType.PLANNED)
            return
        while True:
            plan = self._plan(job)
            if plan is None:
                return
            attempt = self._active_attempt()
            if attempt is None:
                admission, plan = self._admit(stopped, job, plan)
                attempt = self._start_attempt(stopped, job, plan, admission)
            else:
                self.ctx.admissions.running(self.key, plan.get("gpuClass") or self.ctx.inventory.classes[0].name,
                                            plan["gpus"], plan.get("estimatedSeconds") or 60.0,
                                            attempt.get("group"), self._pool_key(job, plan))
                self._capacity_metrics()
            while True:
                self._ensure_submitted(stopped, job, plan, attempt)
                finished = self._watch(stopped, attempt)
                if finished is not None:
                    break
                log.warning("%s: Ray lost driver %s (a restarted head?); submitting it again", self.key,
                            attempt["submissionId"])
            ray_job, result = finished
            outcome = outcome_of(ray_job, result)
            if outcome.kind == "succeeded":
                self._succeed(job, plan, attempt, outcome.result)
                return
            if not self._retry(stopped, job, plan, attempt, outcome):
                return

    def _pool_key(self, job: VideoJob, plan: dict[str, Any]) -> str:
        return pool_key(job.spec.model.name, job.spec.model.source, plan)

    def _plan(self, job: VideoJob) -> dict[str, Any] | None:
        if self.book.status.get("plan"):
            return self.book.status["plan"]
        choice = self._choice(job)
        if choice.chosen is None:
            self._fail(Reason.DOES_NOT_FIT, f"{choice.reason}; it can never run on this cluster",
                       ConditionType.PLANNED)
            return None
        # Written with the job's next status change (queued or admitted): one write, not two.
        self._unwritten_plan = (self._plan_status(choice), choice.reason)
        self._last_choice = choice  # _admit's class options: the planner runs once per job
        return self._unwritten_plan[0]

    def _with_plan(self, changes: dict[str, Any], condition: tuple) -> tuple[dict[str, Any], str]:
        """``changes`` plus a plan not yet written (and its Planned condition) with
        ``condition`` (type, status, reason, message) set; and the event message."""
        changes = dict(changes)
        conditions = None
        prefix = ""
        if self._unwritten_plan is not None:
            plan, reason = self._unwritten_plan
            changes["plan"] = plan
            conditions = self.book.condition(ConditionType.PLANNED, "True", Reason.PLANNED,
                                             f"{plan['summary']}: {reason}")
            prefix = f"planned {plan['summary']} on {plan['gpuClass']} ({reason}); "
        changes["conditions"] = self.book.condition(*condition, base=conditions)
        return changes, prefix + changes.get("message", "")

    @staticmethod
    def _plan_status(choice, option: tuple | None = None) -> dict[str, Any]:
        """The status.plan of ``choice`` (or of one of its ``options``: (class, alternative))."""
        klass, chosen = option if option is not None else (choice.klass, choice.chosen)
        full = chosen.to_json()
        plan = {k: full[k] for k in _PLAN_KEYS}
        plan.update(estimatedPeakGiBPerGPU=full["peakGiBPerGPU"], estimatedSeconds=full["estimatedSeconds"],
                    gpuClass=klass.name)
        return plan

    def _choice(self, job: VideoJob, attempts: list[dict[str, Any]] | None = None):
        """The planner's choice for the job as its attempts so far leave it: after
        out-of-memory attempts, with their margin and without their layouts."""
        if attempts is None:
            attempts = self.book.status.get("attempts") or []
        ooms = [a for a in attempts if a.get("result") == "OutOfMemory"]
        tried = {((a.get("plan") or {}).get("gpuClass"), (a.get("plan") or {}).get("summary")) for a in ooms}
        return plan_classes(job.spec, self.ctx.inventory, margin=self.ctx.settings.oom_margin ** len(ooms),
                            exclude=tried)

    def _active_attempt(self) -> dict[str, Any] | None:
        attempts = self.book.status.get("attempts") or []
        if attempts and attempts[-1].get("result") == "Running":
            return attempts[-1]
        return None

    def _admit(self, stopped, job: VideoJob, plan: dict[str, Any]) -> tuple[Admission, dict[str, Any]]:
        """Wait for GPUs; returns the admission and the plan it runs with (another
        class's layout when the scheduler let the job spill there)."""
        klass = plan.get("gpuClass") or self.ctx.inventory.classes[0].name
        choice, self._last_choice = self._last_choice or self._choice(job), None
        options = {k.name: (k, a) for k, a in choice.options}
        fallbacks = []
        for name, (k, a) in options.items():
            if name != klass:
                alt = self._plan_status(None, (k, a))
                fallbacks.append(Fallback(name, a.layout.gpus, a.seconds, self._pool_key(job, alt),
                                          class_rank(k, a)[0]))
        offload_rank = OFFLOAD_MODES.index(plan.get("offload") or "none")
        ask = Ask(self.key, klass, plan["gpus"], job.spec.resources.priority,
                  _epoch(str(job.metadata.get("creationTimestamp", ""))),
                  float(plan.get("estimatedSeconds") or 60.0), self._pool_key(job, plan),
                  offload_rank=offload_rank, fallbacks=tuple(fallbacks))
        last_write, last_place = float("-inf"), None
        while True:
            try:
                admission, position, why = self.ctx.admissions.request(ask)
            except ValueError as exc:  # more GPUs than one pod of the class: never
                self._fail(Reason.DOES_NOT_FIT, f"{exc}: it can never run here", ConditionType.ADMITTED)
                raise Stopped from None
            self._capacity_metrics()
            if admission is not None:
                if admission.evict:
                    self._evict(admission.evict, "needed by " + self.key)
                if admission.spilled and admission.klass in options:
                    spilled = self._plan_status(None, options[admission.klass])
                    self._unwritten_plan = (spilled, f"spilled from {klass}, where it would have waited, to "
                                                     f"{admission.klass}, where it ends sooner")
                    return admission, spilled
                return admission, plan
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
            self._wait(stopped, self.ctx.settings.poll_interval_s)

    def _evict(self, groups: tuple[str, ...], why: str) -> None:
        """Tear down idle warm groups whose GPUs this job needs (and wait, bounded, for them to go)."""
        self.ctx.metrics.evictions.labels(why="needed").inc(len(groups))
        try:
            left = teardown_groups(self.ctx.ray, groups, self.ctx.settings.driver_python, why, wait_s=60.0)
        except RayUnavailable as exc:
            log.warning("%s: could not evict %s (%s); the placement waits for them", self.key, groups, exc)
            return
        if left:
            log.warning("%s: evicted groups %s still present after 60 s; the placement waits for them",
                        self.key, left)

    def _start_attempt(self, stopped, job: VideoJob, plan: dict[str, Any], admission: Admission) -> dict[str, Any]:
        """Write the attempt, its group and its submission id before anything is submitted."""
        while True:
            attempts = list(self.book.status.get("attempts") or [])
            number = len(attempts) + 1
            group = admission.reuse or group_name(self.uid, f"a{number}")
            attempt = {"number": number, "plan": plan, "startedAt": now(), "result": "Running", "group": group,
                       "submissionId": submission_id(self.namespace, self.name, self.uid, number)}
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
                return attempt
            except Conflict:
                log.info("%s: status changed while starting an attempt; re-reading", self.key)
                self.book.load()
                active = self._active_attempt()
                if active is not None:  # someone (a previous life of this operator) already started one
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

    def _request(self, job: VideoJob, plan: dict[str, Any], attempt: dict[str, Any]) -> DriverRequest:
        settings, inventory = self.ctx.settings, self.ctx.inventory
        fields = job_fields(job, plan, job_id=self.name, output_name=self.name, seed=seed_for(job))
        fault = self._fault(attempt["number"])
        if fault is not None:
            fields["inject_fault"] = fault
        klass = inventory.get(plan["gpuClass"]) if plan.get("gpuClass") else inventory.classes[0]
        bundle = {klass.resource: 1.0} if inventory.uses_class_resources else {}
        return DriverRequest(
            namespace=self.namespace, name=self.name, uid=self.uid, attempt=attempt["number"],
            group=GroupRequest(name=attempt.get("group") or group_name(self.uid), ulysses=plan["ulysses"],
                               ring=plan["ring"], cfg=plan["cfg"], device=inventory.device,
                               bundle_resources=bundle, keep=settings.warm_group_ttl_s > 0,
                               cpus_per_rank=settings.cpus_per_rank if inventory.device == "cpu" else None),
            job=fields, output_uri=job.spec.output.uri if job.spec.output else None,
            placement_timeout_s=settings.placement_timeout_s, job_timeout_s=settings.job_timeout_s,
            progress_interval_s=min(settings.progress_interval_s, 1.0),
        )

    def _ensure_submitted(self, stopped, job: VideoJob, plan: dict[str, Any], attempt: dict[str, Any]) -> None:
        sid = attempt["submissionId"]
        existing = self._ray(stopped, lambda: self.ctx.ray.job(sid), Phase.RUNNING.value)
        if existing is None:
            request = self._request(job, plan, attempt)
            with self.submit_lock:
                if self.deleting.is_set():
                    raise Stopped
                created = self._ray(stopped, lambda: self.ctx.ray.submit(
                    sid, request.entrypoint(self.ctx.settings.driver_python), entrypoint_num_cpus=0,
                    metadata={"videojob.io/namespace": self.namespace, "videojob.io/name": self.name,
                              "videojob.io/uid": self.uid, "videojob.io/attempt": str(attempt["number"])}),
                    Phase.RUNNING.value)
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

    def _watch(self, stopped, attempt: dict[str, Any]) -> tuple[RayJob, dict[str, Any] | None] | None:
        """Until the driver ends ((its Ray job, its result record)) or Ray no longer knows it (None)."""
        sid = attempt["submissionId"]
        last_write = 0.0
        while True:
            ray_job: RayJob = self._ray(stopped, lambda: self.ctx.ray.job(sid), Phase.RUNNING.value)
            if ray_job is None:
                return None
            logs = self._ray(stopped, lambda: self.ctx.ray.logs(sid), Phase.RUNNING.value)
            if ray_job.terminal:
                return ray_job, result_of(logs)
            progress = last_progress(logs)
            clock = time.monotonic()
            if progress and clock - last_write >= self.ctx.settings.progress_interval_s:
                steps = int(progress.get("steps") or 0)
                step = int(progress.get("step") or 0)
                if self.book.update({"progress": {"step": step, "steps": steps,
                                                  "percent": int(100 * step / steps) if steps else 0},
                                     "conditions": self.book.condition(ConditionType.ACTORS_READY, "True",
                                                                       Reason.RUNNING,
                                                                       f"{progress.get('stage') or ''}".strip())}):
                    last_write = clock
            self._wait(stopped, self.ctx.settings.poll_interval_s)

    # -- endings ---------------------------------------------------------------

    def _ended_attempts(self, attempt: dict[str, Any], result: str, reason: str, message: str) -> list[dict]:
        attempts = list(self.book.status.get("attempts") or [])
        index = next(i for i, a in enumerate(attempts) if a.get("number") == attempt["number"])
        attempts[index] = {**attempts[index], "finishedAt": now(), "result": result, "reason": reason,
                           "message": message}
        self.ctx.metrics.attempts.labels(result=result).inc()
        return attempts

    def _succeed(self, job: VideoJob, plan: dict[str, Any], attempt: dict[str, Any], result: dict[str, Any]) -> None:
        metrics = self.ctx.metrics
        changes, measured = success_changes(self.book.status, result)
        if "cacheSkipRatio" in measured:
            metrics.cache_skip_ratio.observe(measured["cacheSkipRatio"])
        estimated = plan.get("estimatedPeakGiBPerGPU")
        if estimated and measured.get("peakGiB"):
            metrics.memory_ratio.observe(measured["peakGiB"] / estimated)
        for key, value in measured.items():
            if key.endswith("Seconds"):
                metrics.stage_seconds.labels(stage=key.removesuffix("Seconds")).observe(value)
        group = result.get("groupName") or attempt.get("group")
        kept = bool(result.get("groupKept")) and self.ctx.settings.warm_group_ttl_s > 0
        pool = self._pool_key(job, plan)
        # The GPUs: held by the idle warm group from now on, or free.
        self.ctx.admissions.finish(self.key, keep_group=group if kept else None, model=job.spec.model.name)
        self._capacity_metrics()
        changes.update({
            "phase": Phase.SUCCEEDED.value, "completionTime": now(),
            "attempts": self._ended_attempts(attempt, "Succeeded", Reason.SUCCEEDED.value, ""),
            "actorGroup": {"name": group, "reused": bool(result.get("groupReused")), "kept": kept,
                           "poolKey": pool if kept else None},
            "conditions": self.book.condition(ConditionType.COMPLETED, "True", Reason.SUCCEEDED, changes["message"])})
        started = self.book.status.get("startTime")
        self.book.update(changes, event_message=changes["message"])
        if started:
            metrics.job_seconds.observe(max(0.0, _epoch(changes["completionTime"]) - _epoch(started)))

    def _retry(self, stopped, job: VideoJob, plan: dict[str, Any], attempt: dict[str, Any],
               outcome: Outcome) -> bool:
        """After a failed attempt: record it, free its GPUs and group, and either set up
        the next attempt (True) or fail the job with every attempt's story (False)."""
        attempts = self._ended_attempts(attempt, outcome.attempt_result, outcome.reason, outcome.message)
        self.ctx.admissions.finish(self.key)
        self._capacity_metrics()
        group = attempt.get("group")
        if group and (outcome.result.get("groupKept") or outcome.kind == "lost"):
            try:  # a failed attempt's group is in an unknown state: it goes (not back to the pool)
                teardown_groups(self.ctx.ray, [group], self.ctx.settings.driver_python,
                                f"attempt {attempt['number']} of {self.key} failed", wait_s=30.0,
                                world=plan["gpus"])
            except RayUnavailable as exc:
                log.warning("%s: could not remove group %s (%s); the sweeper will", self.key, group, exc)
        settings = self.ctx.settings
        left = settings.max_attempts - len(attempts)
        typed = {"oom": Reason.OUT_OF_MEMORY, "lost": Reason.FAILED}.get(outcome.kind, Reason.FAILED)
        if outcome.reason == "Cancelled":
            typed = Reason.CANCELLED
        if outcome.kind not in ("oom", "lost") or left <= 0:
            why = "" if outcome.kind not in ("oom", "lost") else f" (no attempts left of {settings.max_attempts})"
            message = f"{outcome.message}{why}. {story(attempts)}"
            self._fail(typed, message, changes={"attempts": attempts})
            return False
        if outcome.kind == "oom":
            choice = self._choice(job, attempts)
            if choice.chosen is None:
                message = (f"{outcome.message}; no stricter layout fits ({choice.reason}). {story(attempts)}")
                self._fail(Reason.OUT_OF_MEMORY, message, changes={"attempts": attempts})
                return False
            new_plan = self._plan_status(choice)
            message = (f"attempt {attempt['number']} ran out of memory with {plan['summary']} on "
                       f"{plan.get('gpuClass')}; re-planned: {new_plan['summary']} on {new_plan['gpuClass']}")
            self.book.update({"phase": Phase.PLANNED.value, "plan": new_plan, "attempts": attempts,
                              "message": message, "progress": None,
                              "conditions": self.book.condition(ConditionType.PLANNED, "True", Reason.REPLANNED,
                                                                message)}, event_message=message)
            return True
        delay = settings.retry_backoff_s * 2 ** max(0, len(attempts) - 1)
        message = (f"attempt {attempt['number']} lost ({outcome.reason}): {outcome.message[:300]}; "
                   f"retrying in {delay:g} s ({left} attempt(s) left)")
        self.book.update({"phase": Phase.QUEUED.value, "attempts": attempts, "message": message, "progress": None,
                          "conditions": self.book.condition(ConditionType.ADMITTED, "False", Reason.FAILED,
                                                            message)}, event_message=message)
        self._wait(stopped, delay)
        return True

    # -- deletion --------------------------------------------------------------

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
                teardown_groups(self.ctx.ray, [kept["name"]], self.ctx.settings.driver_python,
                                f"{self.key} deleted")
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
            teardown_groups(ray, [group], self.ctx.settings.driver_python, f"{self.key} deleted",
                            wait_s=max(0.0, deadline - time.monotonic()), world=world)
