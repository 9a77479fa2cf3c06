"""One VideoJob from creation to its end: plan, queue, submit, watch, finish; and deletion.

Plain Python over three interfaces (the Kubernetes status, a ``RayClient``,
the scheduler's ``Admissions``), so it runs the same under kopf, in tests, and in the load
benchmark with an instant Ray. kopf's daemon calls ``JobLifecycle.run``; its
deletion handler calls ``JobLifecycle.delete``.

``JobLifecycle`` is this module's loop and planning, plus one part per
responsibility, each in its own module: ``queueing`` (waiting for GPUs),
``attempts`` (writing an attempt, submitting its driver), ``watching`` (the
driver's records into status), ``endings`` (success, re-plan, retry,
re-queue, failure) and ``deletion``.

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
import zlib
from typing import Any, Callable

from ..api import InvalidVideoJob, VideoJob, parse_videojob
from ..api.status import ConditionType, Phase, Reason
from ..driver_protocol import result_of
from ..planner.classes import plan_classes
from ..raycluster.client import RayAuthError, RayUnavailable
from .admission import pool_key
from .attempts import FAULT_ANNOTATION, Attempts
from .context import TERMINAL, Context, EventFn, Parked, Stopped, epoch
from .deletion import Deletion
from .endings import Endings
from .flags import FlagGroup, SharedFlag
from .hygiene import after_end
from .kube import Gone
from .kueue_admission import KueueQueueing
from .outcome import clip, outcome_of
from .queueing import Queueing
from .status import StatusBook, now
from .watching import Watching

log = logging.getLogger("videojob.controller")

DELETIONS = FlagGroup()  # the lifecycles' deletion flags (nobody waits on them)
_PLAN_KEYS = ("gpus", "ulysses", "ring", "cfg", "offload", "vaeTiling", "vaeSlicing", "cache", "fp8Weights",
              "decodeOffload", "summary")
__all__ = ["FAULT_ANNOTATION", "TERMINAL", "Context", "EventFn", "JobLifecycle", "Stopped", "epoch", "job_document"]


def job_document(obj: dict[str, Any]) -> dict[str, Any]:
    """What the lifecycle parses of a VideoJob from the API server: its spec and
    metadata without ``managedFields`` (about half of an object's size) and without
    the status (the ``StatusBook`` holds that, as the API server wrote it)."""
    metadata = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "managedFields"}
    return {**{k: v for k, v in obj.items() if k not in ("metadata", "status")}, "metadata": metadata}


class JobLifecycle(Queueing, KueueQueueing, Attempts, Watching, Endings, Deletion):
    """One job's lifecycle (the module says how it is split)."""

    def __init__(self, ctx: Context, namespace: str, name: str, uid: str):
        self.ctx, self.namespace, self.name, self.uid = ctx, namespace, name, uid
        self.key = f"{namespace}/{name}"
        self.deleting = SharedFlag(DELETIONS)  # set by the finalizer; looked at, never waited on
        self.submit_lock = threading.Lock()
        self.book = StatusBook(ctx.jobs, namespace, name, on_phase=self._phase_event, uid=uid)
        self.annotations: dict[str, str] = {}
        self._unwritten_plan: tuple[dict[str, Any], str] | None = None
        self._ray_was_down = False
        self._last_choice = None  # the planner's choice, from planning to the queue (or kueue's admission)
        self._waiting_ask = None  # (Ask, plans on the classes it may spill to) while it waits for GPUs
        self.parking = False  # run(park=True): raise Parked rather than poll the queue
        self.on_admitted = None  # the job runner's callback: this run got past the queue (see runner.py)
        self._parked_job: bytes | None = None  # the job's document, compressed, while parked (see _park_job)
        self._document: dict[str, Any] | None = None  # what the job was parsed from, while this run has it
        self._queue_shown: tuple[float, int | None] = (float("-inf"), None)  # (written at, place) while queued
        self._kueue_parked: tuple[str, str | None] | None = None  # (Workload, resourceVersion) it parked on
        self._kueue_shown: str | None = None  # the Kueue wait its status shows, kept while parked

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
                self._ray_was_down = True
                self.ctx.metrics.ray_errors.inc()
                reason = Reason.RAY_AUTH_FAILED if isinstance(exc, RayAuthError) else Reason.RAY_UNAVAILABLE
                log.warning("%s: %s", self.key, exc)
                self.book.update({"conditions": self.book.condition(ConditionType.ADMITTED, "Unknown", reason,
                                                                    f"{exc}; retrying every "
                                                                    f"{self.ctx.settings.ray_retry_s:g} s"),
                                  "message": str(exc)[:500], "phase": waiting_phase})
                self._wait(stopped, self.ctx.settings.ray_retry_s)
                continue
            if self._ray_was_down:
                self._ray_back()
            return result

    def _ray_back(self) -> None:
        """Ray answers again: the condition that said it did not is set back (a job
        that then runs and succeeds must not still say Ray is unreachable)."""
        self._ray_was_down = False
        admitted = next((c for c in self.book.status.get("conditions") or []
                         if c.get("type") == ConditionType.ADMITTED.value), None)
        if admitted is None or admitted.get("reason") not in (Reason.RAY_UNAVAILABLE.value,
                                                               Reason.RAY_AUTH_FAILED.value):
            return
        attempt = self._active_attempt()
        if attempt is not None:
            status, reason, message = "True", Reason.ADMITTED, f"Ray answers again; attempt {attempt['number']} goes on"
        else:
            status, reason, message = "False", Reason.WAITING_FOR_GPUS, "Ray answers again"
        self.book.update({"message": message, "conditions": self.book.condition(ConditionType.ADMITTED, status,
                                                                                reason, message)})

    def _fail(self, reason: Reason, message: str, condition: ConditionType = ConditionType.COMPLETED,
              changes: dict[str, Any] | None = None) -> None:
        self.book.update({"phase": Phase.FAILED.value, "message": clip(message, 1000), "completionTime": now(),
                          "queue": None, **(changes or {}),
                          "conditions": self.book.condition(condition, "False", reason, message)},
                         event_message=message)
        after_end(self)  # an attempt's end written with it: its driver leaves Ray's job table
        self.ctx.admissions.cancel(self.key)
        self._capacity_metrics()

    # -- the lifecycle ---------------------------------------------------------

    def run(self, stopped, park: bool = False) -> bool:
        """From wherever the status says the job is, to its end (or until stopped);
        with ``park``, returns True as soon as the job waits in the queue (see ``Parked``),
        to be called again once it was admitted or its place moved."""
        self.parking = park
        try:
            self._run(stopped)
            if self.deleting.is_set():
                raise Stopped
        except Parked:
            if not self.deleting.is_set():
                return True
            self._stopped_by_deletion()  # deleted as it parked: no place is kept for it
        except (Stopped, Gone):
            log.info("%s: lifecycle stopped", self.key)
            if self.deleting.is_set():
                self._stopped_by_deletion()
        self._parked_job = self._kueue_parked = self._document = None
        return False

    def _stopped_by_deletion(self) -> None:
        # The finalizer released the job's GPUs; an admission this daemon got after
        # that (it was between two looks at the queue) must not outlive it.
        with self.submit_lock:
            self.ctx.admissions.cancel(self.key)
        self._capacity_metrics()

    def _run(self, stopped) -> None:
        if stopped.is_set() or self.deleting.is_set():  # a parked job woken after its deletion
            raise Stopped
        if self._parked_job is not None:  # back from the queue: the book is this job's latest
            blob, self._parked_job = self._parked_job, None
            self._document = json.loads(zlib.decompress(blob))
            self._loop(stopped, parse_videojob(self._document))
            return
        obj = self.book.load()
        self.annotations = dict(obj["metadata"].get("annotations") or {})
        shown = (self.book.status.get("queue") or {}).get("position")
        if self.book.phase == Phase.QUEUED.value and shown and self._queue_shown[1] is None:
            # A restarted operator's queued job shows a place already: rewritten once it has
            # moved, as if written just now, not by every job at once (10,000 writes).
            self._queue_shown = (time.monotonic(), int(shown))
        self.ctx.metrics.set_phase(self.key, self.book.phase)
        if self.book.phase in TERMINAL:
            self.ctx.admissions.cancel(self.key)
            self._kueue_release("the job ended")  # a crash between the end's write and the release
            return
        try:
            self._document = job_document(obj)
            job = parse_videojob(self._document)
        except InvalidVideoJob as exc:  # the API server checks the same rules; this is a backstop
            self._fail(Reason.INVALID_SPEC, "; ".join(str(p) for p in exc.problems), ConditionType.PLANNED)
            return
        self._loop(stopped, job)

    def _loop(self, stopped, job: VideoJob) -> None:
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
                                            attempt.get("group"), self._pool_key(job, plan), self._ask(job, plan),
                                            started_at=attempt.get("startedAt"))
                self._capacity_metrics()
            if self.on_admitted is not None:  # from here the thread watches a running attempt
                self.on_admitted()
            while True:
                self._ensure_submitted(stopped, job, plan, attempt)
                finished = self._watch(stopped, attempt)
                if finished is not None:
                    break
                log.warning("%s: Ray lost driver %s (a restarted head?); submitting it again", self.key,
                            attempt["submissionId"])
            ray_job, logs = finished
            outcome = outcome_of(ray_job, result_of(logs), logs)
            log.info("%s: attempt %s ended %s (%s); its driver spoke protocol %s", self.key, attempt["number"],
                     outcome.attempt_result, outcome.reason, outcome.driver_protocol or "?")
            if outcome.kind == "succeeded":
                self._succeed(job, plan, attempt, outcome.result)
                return
            if not self._retry(stopped, job, plan, attempt, outcome):
                return

    def _park_job(self, job: VideoJob) -> None:
        """Keep ``job`` while it waits without a thread, as its compressed document
        (~1 KiB), not as parsed models: a parsed VideoJob is hundreds of dicts and
        sets, and 10,000 queued jobs kept one each (issue 22's memory goal).
        Parsed again when the job is woken; no GET."""
        doc, self._document = self._document, None
        if doc is None:  # not read by this run (a test's lifecycle): the job's own fields
            doc = job.model_dump(mode="json", by_alias=True, exclude={"status"})
        self._parked_job = zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 1)

    def shown_place(self) -> int | None:
        """The queue place the job's status shows (None: not shown yet)."""
        return self._queue_shown[1]

    def _pool_key(self, job: VideoJob, plan: dict[str, Any]) -> str:
        return pool_key(job.spec.model.name, job.spec.model.source, plan)

    def _plan(self, job: VideoJob) -> dict[str, Any] | None:
        if self.book.status.get("plan"):
            return self.book.status["plan"]
        if self._unwritten_plan is not None:  # planned before it parked, not written yet
            return self._unwritten_plan[0]
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
