"""Watching a running attempt: the driver's records, turned into status.

Mixed into ``JobLifecycle``: ``_watch`` polls the driver's Ray job (from the
shared job table: one read of Ray's table per interval for every running job)
until it ends, and reads its log only when there is news to show (at most every
``progress_interval_s``: the last ``LOG_TAIL_LINES`` lines, so a poll costs the
same however long the log) and, whole, once at its end. On the way it shows, each only when it changed and at
most every ``progress_interval_s``:

- a driver whose Ray job is still PENDING while drivers need resources
  (VIDEOJOB_DRIVER_RESOURCES): ``ActorsReady=False``, ``WaitingForDriver``;
- a placement that waits (the driver's ``placement`` progress records):
  ``WaitingForNode`` while the autoscaler starts a node of the job's class,
  ``WaitingForPlacement`` while nothing is launching, with the driver's
  message ("waiting for a node of class X (the autoscaler is starting one
  ...)") as the job's message;
- the group ready (the driver's ``group`` record), then denoising progress:
  ``ActorsReady=True`` and ``status.progress``.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..api.status import ConditionType, Phase, Reason
from ..driver_protocol import records, result_of
from ..raycluster.client import RayJob

log = logging.getLogger("videojob.controller")

LOG_TAIL_LINES = 200  # a running driver's last lines read for its progress (one record a step; others between)
PREEMPT_RETRY_POLLS = 10  # a preempt driver that could not ask the ranks is sent again after this many polls
PLACEMENT_REASONS = {"waiting-for-node": Reason.WAITING_FOR_NODE, "waiting-for-room": Reason.WAITING_FOR_PLACEMENT}


class Watching:
    """``JobLifecycle``'s watch of a running attempt (see the module)."""

    def _watch(self, stopped, attempt: dict[str, Any]) -> tuple[RayJob, str] | None:
        """Until the driver ends ((its Ray job, its log)) or Ray no longer knows it (None)."""
        sid = attempt["submissionId"]
        last_write = float("-inf")
        waiting = False
        preempt: tuple[str, float] | None = None  # the preempt driver sent, and when
        while True:
            if preempt is None:
                wanted = self.ctx.admissions.preempt_requested(self.key)
                if not wanted and self.ctx.kueue is not None:
                    self._evicted_by_kueue = self._kueue_eviction(attempt)
                    wanted = self._evicted_by_kueue is not None
                if wanted:
                    preempt = self._ask_to_preempt(stopped, attempt)
            else:
                preempt = self._preempt_again_if_refused(stopped, attempt, preempt)
            ray_job: RayJob = self._ray(stopped, lambda: self.ctx.driver(sid), Phase.RUNNING.value)
            if ray_job is None:
                return None
            clock = time.monotonic()
            # The log only when it is read: its last lines when progress is due to be shown,
            # the whole of it once, at the end (the result).
            due = clock - last_write >= self.ctx.settings.progress_interval_s
            logs = ""
            if ray_job.terminal:
                logs = self._ray(stopped, lambda: self.ctx.ray.logs(sid), Phase.RUNNING.value)
            elif ray_job.status != "PENDING" and due:
                logs = self._ray(stopped, lambda: self.ctx.ray.log_tail(sid, LOG_TAIL_LINES, ray_job.driver_node_id), Phase.RUNNING.value)
            if ray_job.terminal:
                if waiting:  # it ended between two looks: the wait it showed is over
                    self._show_latest(attempt, logs, waiting)
                return ray_job, logs
            if ray_job.status == "PENDING":
                waiting = self._show_pending_driver(attempt) or waiting
            elif due:
                wrote, waiting = self._show_latest(attempt, logs, waiting)
                if wrote:
                    last_write = clock
            self._wait(stopped, self.ctx.settings.poll_interval_s)

    def _ask_to_preempt(self, stopped, attempt: dict[str, Any], again: bool = False) -> tuple[str, float] | None:
        """A job of higher priority needs this one's GPUs: its ranks checkpoint and stop
        at their next step boundary (a small driver asks them); the attempt then ends
        Preempted and the job waits in the queue again. (the preempt driver, when it was
        sent); None: the attempt has no group yet, asked again at the next look."""
        from .groups import submit_preempt

        group = attempt.get("group")
        if not group:
            return None
        by = self.ctx.admissions.preempted_by(self.key) or "a job of higher priority"
        evicted = getattr(self, "_evicted_by_kueue", None)
        if evicted is not None:
            by = f"Kueue ({evicted[0]}: {evicted[1][:300]})"
        plan = self.book.status.get("plan") or {}
        sid = self._ray(stopped, lambda: submit_preempt(self.ctx.ray, group, self._job_id(attempt),
                                                        int(plan.get("gpus") or 8), self.ctx.launch,
                                                        f"preempted by {by}"), Phase.RUNNING.value)
        if not again:
            message = f"attempt {attempt['number']}: preempted by {by}; stopping at the next step boundary"
            self.ctx.event(self.namespace, self.name, self.uid, "Normal", "Preempting", message)
            self.book.update({"message": message})
        return sid, time.monotonic()

    def _preempt_again_if_refused(self, stopped, attempt: dict[str, Any],
                                  preempt: tuple[str, float]) -> tuple[str, float] | None:
        """A preemption ends only when the attempt ends: a preempt driver that could not ask
        the ranks (the victim was still starting: its group not up yet, ``GroupNotFound``;
        or Ray lost it) is sent again, at most every ``PREEMPT_RETRY_POLLS`` polls, until one
        asked them, while the preemption is still wanted (None: it was withdrawn, its job
        having left the queue). (It was fire-and-forget: a victim caught starting ran to its
        end, and the head it was chosen for waited all of it, with every other preemption of
        its class.)"""
        sid, sent = preempt
        if time.monotonic() - sent < PREEMPT_RETRY_POLLS * self.ctx.settings.poll_interval_s:
            return preempt
        job = self._ray(stopped, lambda: self.ctx.ray.job(sid), Phase.RUNNING.value)
        if job is not None and not job.terminal:
            return preempt  # still asking
        result = result_of(self._ray(stopped, lambda: self.ctx.ray.logs(sid), Phase.RUNNING.value)) \
            if job is not None else None
        if result is not None and result.get("ok"):
            return sid, float("inf")  # the ranks were asked: the attempt ends Preempted at a step boundary
        if not self.ctx.admissions.preempt_requested(self.key) and getattr(self, "_evicted_by_kueue", None) is None:
            message = f"attempt {attempt['number']}: the preemption was withdrawn (the job it was for left the queue)"
            log.info("%s: %s", self.key, message)
            self.book.update({"message": message})
            return None
        error = (result or {}).get("error") or {}
        log.info("%s: preempt driver %s could not ask the ranks (%s: %s); asking again", self.key, sid,
                 error.get("reason") or ("lost" if job is None else job.status), error.get("message", "")[:200])
        return self._ask_to_preempt(stopped, attempt, again=True) or preempt

    def _show_latest(self, attempt: dict[str, Any], logs: str, waiting: bool) -> tuple[bool, bool]:
        """Show the driver's latest news; (written, still waiting for placement)."""
        latest = None
        for item in records(logs):
            if item["type"] in ("progress", "group"):
                latest = item
        if latest is None:
            return False, waiting
        if latest["type"] == "group":
            return self._show_group(attempt, latest, waiting), False
        if latest.get("stage") == "placement" and latest.get("state") in PLACEMENT_REASONS:
            return self._show_placement(attempt, latest), True
        return self._show_progress(attempt, latest, waiting), False

    def _show_group(self, attempt: dict[str, Any], group: dict[str, Any], was_waiting: bool) -> bool:
        how = "reused" if group.get("reused") else f"started in {group.get('seconds')}s"
        message = f"attempt {attempt['number']}: group {group.get('name')} ready ({how})"
        changes: dict[str, Any] = {"conditions": self.book.condition(ConditionType.ACTORS_READY, "True",
                                                                     Reason.ACTORS_READY, message)}
        if was_waiting:  # the waiting message is no longer news
            changes["message"] = message
        return self.book.update(changes)

    def _show_pending_driver(self, attempt: dict[str, Any]) -> bool:
        """True when the job's message now says its driver waits (news to replace once it runs)."""
        resources = self.ctx.launch.resources
        if not resources:
            return False  # Ray starts drivers on the head at once: PENDING is a moment of runtime-env setup
        message = (f"attempt {attempt['number']}: its driver waits for a Ray node that offers "
                   f"{json.dumps(resources, sort_keys=True)} (VIDEOJOB_DRIVER_RESOURCES; with KubeRay, the "
                   "drivers' worker group)")
        self.book.update({"message": message, "conditions": self.book.condition(
            ConditionType.ACTORS_READY, "False", Reason.WAITING_FOR_DRIVER, message)})
        return True

    def _show_placement(self, attempt: dict[str, Any], progress: dict[str, Any]) -> bool:
        message = f"attempt {attempt['number']}: {progress.get('message') or progress['state']}"
        return self.book.update({"message": message[:1000], "conditions": self.book.condition(
            ConditionType.ACTORS_READY, "False", PLACEMENT_REASONS[progress["state"]], message)})

    def _show_progress(self, attempt: dict[str, Any], progress: dict[str, Any], was_waiting: bool) -> bool:
        steps = int(progress.get("steps") or 0)
        step = int(progress.get("step") or 0)
        self.ctx.admissions.progress(self.key, step, steps)
        changes: dict[str, Any] = {
            "progress": {"step": step, "steps": steps, "percent": int(100 * step / steps) if steps else 0},
            "conditions": self.book.condition(ConditionType.ACTORS_READY, "True", Reason.RUNNING,
                                              f"{progress.get('stage') or ''}".strip())}
        if was_waiting:  # the waiting message is no longer news
            changes["message"] = f"attempt {attempt['number']}: running ({progress.get('stage') or 'start'})"
        return self.book.update(changes)
