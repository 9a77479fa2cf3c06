"""How an attempt's end becomes the job's: success, a re-plan, a retry, a
re-queue, or failure with every attempt's story.

Mixed into ``JobLifecycle``. Every ended attempt stays in ``status.attempts``
with its result. What happens next (``outcome.Outcome.kind``):

- succeeded: the output and measurements in status; the group stays warm or goes;
- oom: re-planned stricter (``OOM_MARGIN``), a new attempt;
- lost: the same plan after a backoff (doubled per attempt);
- requeue (``NoPlacement``: no room for the group and no node of its class
  being launched): back to the queue after a backoff, the attempt recorded
  as ``Requeued``, which does not count against ``MAX_ATTEMPTS``. So that a
  group that can never be placed does not loop for ever, the job fails with
  reason ``NoPlacement`` once ``PLACEMENT_REQUEUE_LIMIT_S`` has passed since
  its first re-queued attempt started (status timestamps: a restarted
  operator keeps counting);
- failed (bad input, a bug, ``ProtocolIncompatible``, a driver that exited
  with an error before it printed anything: ``DriverStartFailed``): failed, no
  retry.

Only non-requeued attempts count against ``MAX_ATTEMPTS`` (``counted``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..api import VideoJob
from ..api.status import ConditionType, Phase, Reason
from ..kueue import DEACTIVATED_REASONS
from ..raycluster.client import RayUnavailable
from .context import epoch
from .groups import present, teardown_groups
from .hygiene import after_end
from .outcome import NOT_OURS, Outcome, attempt_steps, clip, story, success_changes
from .status import now

log = logging.getLogger("videojob.controller")
REQUEUED = "Requeued"
# A re-queued job tries again after retry_backoff_s, doubled per re-queue, at most this long.
REQUEUE_BACKOFF_CAP_S = 300.0
GROUP_GONE_WAIT_S = 30.0  # an ended attempt's group teardown is waited for this long before its GPUs are released


PREEMPTED = "Preempted"


def counted(attempts: list[dict[str, Any]]) -> int:
    """The attempts that count against max_attempts (re-queued and preempted ones do not)."""
    return sum(1 for a in attempts if a.get("result") not in (REQUEUED, PREEMPTED))


class Endings:
    """``JobLifecycle``'s endings of attempts (see the module)."""

    def _ended_attempts(self, attempt: dict[str, Any], result: str, reason: str, message: str,
                        record: dict[str, Any] | None = None) -> list[dict]:
        attempts = list(self.book.status.get("attempts") or [])
        index = next(i for i, a in enumerate(attempts) if a.get("number") == attempt["number"])
        attempts[index] = {**attempts[index], "finishedAt": now(), "result": result, "reason": reason,
                           "message": message, **attempt_steps(record or {}, self.book.status)}
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
        changes.update({
            "phase": Phase.SUCCEEDED.value, "completionTime": now(),
            "attempts": self._ended_attempts(attempt, "Succeeded", Reason.SUCCEEDED.value, "", result),
            "actorGroup": {"name": group, "reused": bool(result.get("groupReused")), "kept": kept,
                           "poolKey": pool if kept else None},
            "conditions": self.book.condition(ConditionType.COMPLETED, "True", Reason.SUCCEEDED, changes["message"])})
        computed = sum(a.get("stepsComputed") or 0 for a in changes["attempts"])
        if computed:
            changes["measured"] = {**changes["measured"], "stepsComputed": computed}
        started = self.book.status.get("startTime")
        # The status first, then the books: if the write fails, the daemon starts again
        # from a status that still says Running and books that still hold the job (a
        # write after the books changed would leave the GPUs counted twice, as the
        # running job found again and as its kept group).
        self.book.update(changes, event_message=changes["message"])
        after_end(self)  # the end is written: its driver leaves Ray's job table
        # The GPUs: held by the idle warm group from now on, or free.
        self.ctx.admissions.finish(self.key, keep_group=group if kept else None, model=job.spec.model.name)
        self._capacity_metrics()
        if started:
            metrics.job_seconds.observe(max(0.0, epoch(changes["completionTime"]) - epoch(started)))

    def _retry(self, stopped, job: VideoJob, plan: dict[str, Any], attempt: dict[str, Any],
               outcome: Outcome) -> bool:
        """After a failed attempt: record it, free its GPUs and group, and either set up
        the next attempt (True) or fail the job with every attempt's story (False)."""
        attempts = self._ended_attempts(attempt, outcome.attempt_result, outcome.reason, outcome.message,
                                        outcome.result)
        self._remove_group(attempt, plan, outcome)
        by = self.ctx.admissions.preempted_by(self.key)  # finish forgets the preemption
        # The GPUs go back to the books only now: freed while the group still held them, the
        # next job's group waited for Ray's resources (or was refused them) behind it.
        self.ctx.admissions.finish(self.key)
        self._capacity_metrics()
        if outcome.kind == "requeue":
            return self._requeue(stopped, plan, attempt, attempts, outcome)
        if outcome.kind == "preempted":
            return self._preempted(attempt, attempts, outcome, by)
        settings = self.ctx.settings
        used = counted(attempts)
        left = settings.max_attempts - used
        typed = {"oom": Reason.OUT_OF_MEMORY, "lost": Reason.FAILED}.get(outcome.kind, Reason.FAILED)
        if outcome.reason == "Cancelled":
            typed = Reason.CANCELLED
        elif outcome.reason == Reason.PROTOCOL_INCOMPATIBLE.value:
            typed = Reason.PROTOCOL_INCOMPATIBLE
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
            after_end(self)
            return True
        delay = settings.retry_backoff_s * 2 ** max(0, used - 1)
        message = (f"attempt {attempt['number']} lost ({outcome.reason}): {clip(outcome.message, 600)}; "
                   f"retrying in {delay:g} s ({left} attempt(s) left)")
        self.book.update({"phase": Phase.QUEUED.value, "attempts": attempts, "message": message, "progress": None,
                          "conditions": self.book.condition(ConditionType.ADMITTED, "False", Reason.FAILED,
                                                            message)}, event_message=message)
        after_end(self)
        self._wait(stopped, delay)
        return True

    def _preempted(self, attempt: dict[str, Any], attempts: list[dict[str, Any]], outcome: Outcome,
                   by: str | None) -> bool:
        """Stopped for a job of higher priority: back to the queue at once, with its
        priority and age (its Ask is built again from the spec and creation time); the
        next attempt resumes from the checkpoint the preemption saved."""
        error = outcome.result.get("error") or {}
        saved = int(error.get("checkpointStep") or 0)
        evicted, self._evicted_by_kueue = getattr(self, "_evicted_by_kueue", None), None
        if evicted is not None:
            by = f"Kueue ({evicted[0]}: {evicted[1][:300]})"
            attempts = [{**a, "reason": evicted[0]} if a.get("number") == attempt["number"] else a
                        for a in attempts]
        paused = evicted is not None and evicted[0] in DEACTIVATED_REASONS
        message = (f"attempt {attempt['number']} " + ("stopped" if paused else "preempted")
                   + (f" by {by}" if by else "") + f" after step {error.get('step') or '?'}; "
                   + (f"checkpoint of step {saved} saved; " if saved else "no checkpoint to resume from; ")
                   + ("its Workload was deactivated: the job waits until a Workload of it is active again (the "
                      "next one is made inactive; its status names it)" if paused
                      else "queued again with its priority and age"))
        attempts = [{**a, "message": message} if a.get("number") == attempt["number"] else a for a in attempts]
        reason = Reason.KUEUE_DEACTIVATED if paused else Reason.KUEUE_EVICTED if evicted else Reason.PREEMPTED
        self.book.update({"phase": Phase.QUEUED.value, "attempts": attempts, "message": message, "progress": None,
                          "actorGroup": None,
                          "conditions": self.book.condition(ConditionType.ADMITTED, "False", reason, message)},
                         event_message=message)
        after_end(self)
        return True

    def _remove_group(self, attempt: dict[str, Any], plan: dict[str, Any], outcome: Outcome) -> None:
        """A failed, lost or preempted attempt's group is gone before its GPUs are released:
        one it kept, or a lost one, is in an unknown state and is torn down (not back to the
        pool); a preempted one its driver removed as it stopped, looked at to be sure. A
        teardown not confirmed in ``GROUP_GONE_WAIT_S`` is left to the sweeper, which
        reclaims any group the books do not use (``Controller.sweep``)."""
        group = attempt.get("group")
        if not group or outcome.reason in NOT_OURS:
            return
        why = f"attempt {attempt['number']} of {self.key} {outcome.attempt_result.lower()}"
        try:
            if outcome.result.get("groupKept") or outcome.kind in ("lost", "preempted"):
                if outcome.kind == "preempted" and not outcome.result.get("groupKept") \
                        and not present(self.ctx.ray, group):
                    return
                left = teardown_groups(self.ctx.ray, [group], self.ctx.launch, why, wait_s=GROUP_GONE_WAIT_S,
                                       world=plan["gpus"])
                if left:
                    log.warning("%s: group %s still present %.0f s after its teardown; its GPUs are released "
                                "and the sweeper removes it", self.key, group, GROUP_GONE_WAIT_S)
        except RayUnavailable as exc:
            log.warning("%s: could not remove group %s (%s); the sweeper will", self.key, group, exc)

    def _requeue(self, stopped, plan: dict[str, Any], attempt: dict[str, Any], attempts: list[dict[str, Any]],
                 outcome: Outcome) -> bool:
        """Nothing could place the attempt's group: back to the queue (True), or, once
        the job has been re-queued for ``placement_requeue_limit_s``, fail it (False)."""
        settings = self.ctx.settings
        requeued = [a for a in attempts if a.get("result") == REQUEUED]
        # startedAt is in whole seconds (truncated): count from the end of that second, so the
        # job never fails before the limit.
        since = epoch(requeued[0].get("startedAt") or "") + 1.0
        spent = max(0.0, time.time() - since)
        limit = settings.placement_requeue_limit_s
        klass = plan.get("gpuClass") or "?"
        if spent >= limit:
            message = (f"no node could hold the group of {plan['gpus']} rank(s) of class {klass}: re-queued "
                       f"{len(requeued)} time(s) over {spent:.0f} s, the limit being {limit:g} s "
                       f"(VIDEOJOB_PLACEMENT_REQUEUE_LIMIT_S); last: {outcome.message}. {story(attempts)}")
            self._fail(Reason.NO_PLACEMENT, message, changes={"attempts": attempts})
            return False
        delay = min(settings.retry_backoff_s * 2 ** (len(requeued) - 1), REQUEUE_BACKOFF_CAP_S, limit - spent)
        message = (f"attempt {attempt['number']} could not be placed ({outcome.message[:400]}); re-queued, "
                   f"not counted as an attempt, trying again in {delay:.0f} s; the job fails after "
                   f"{limit - spent:.0f} s more of this (VIDEOJOB_PLACEMENT_REQUEUE_LIMIT_S). Check that class "
                   f"{klass}'s worker group can add a pod (maxReplicas, quota, node selectors, image)")
        self.book.update({"phase": Phase.QUEUED.value, "attempts": attempts, "message": message[:1000],
                          "progress": None, "actorGroup": None,
                          "conditions": self.book.condition(ConditionType.ADMITTED, "False", Reason.NO_PLACEMENT,
                                                            message)}, event_message=message)
        after_end(self)
        self._wait(stopped, delay)
        return True
