"""The driver's progress records: one per change of (step, stage, state), and the placement's waits."""

from __future__ import annotations

import time
from typing import Any

from .stopping import OUT, STATE


class ProgressPrinter:
    """A progress record when (step, stage, state) changed, at most every ``interval_s``
    (a change held back is printed once the interval has passed: the callback runs every poll)."""

    def __init__(self, interval_s: float, job_id: str):
        self.interval_s, self.job_id = interval_s, job_id
        self.last_key: tuple | None = None
        self.last_at = float("-inf")

    def __call__(self, progress: dict[str, Any]) -> None:
        if progress.get("job_id") != self.job_id:
            return  # a warm rank that has not begun this job yet still shows the last one
        STATE.progress = progress
        key = (progress.get("step"), progress.get("stage"), progress.get("state"))
        now = time.monotonic()
        if key == self.last_key or now - self.last_at < self.interval_s:
            return
        self.last_key, self.last_at = key, now
        OUT.emit("progress", step=progress.get("step", 0), steps=progress.get("steps", 0),
                 percent=progress.get("percent", 0), stage=progress.get("stage", ""),
                 state=progress.get("state", ""), job_id=self.job_id)


class PlacementPrinter:
    """Progress records while the group's placement waits (``placement.wait_placed``):
    stage ``placement``, state ``waiting-for-node`` while the autoscaler launches a
    node of the group's type, ``waiting-for-room`` while nothing is launching."""

    def __init__(self, job_id: str, steps: int, group):
        self.job_id, self.steps = job_id, steps
        self.world, self.node_type = group.ulysses * group.ring * group.cfg, group.node_type

    def __call__(self, wait: dict[str, Any]) -> None:
        node_type = wait.get("nodeType") or self.node_type
        if wait["state"] == "waiting-for-node":
            message = (f"waiting for a node of class {node_type} (the autoscaler is starting one: "
                       f"{wait.get('launching')}; {wait['waitedS']}s so far, at most {wait['maxWaitS']:.0f}s)")
        else:
            message = (f"waiting for room for {self.world} rank(s) in one pod"
                       + (f" of class {node_type}" if node_type else "")
                       + f" (nothing is launching; {wait['idleS']}s of {wait['timeoutS']:.0f}s)")
        STATE.progress = {"stage": "placement", "state": wait["state"]}
        OUT.emit("progress", step=0, steps=self.steps, percent=0, stage="placement", state=wait["state"],
                 nodeType=node_type, waitedS=wait["waitedS"], message=message, job_id=self.job_id)
