"""Progress a rank reports while it runs, and the cancel token of each job.

Both are read and written from different threads of one actor (Ray gives
the actor spare threads, so progress and cancel are answered during a run).
A cancel names the job it is for, so one that arrives before the job starts
still counts, and one for a finished job cannot cancel the next.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import asdict, dataclass
from typing import Any

STATES = ("idle", "loading", "running", "writing", "done", "failed", "cancelled")


@dataclass
class Progress:
    job_id: str = ""
    state: str = "idle"
    step: int = 0
    steps: int = 0
    stage: str = ""

    @property
    def percent(self) -> int:
        return int(100 * self.step / self.steps) if self.steps else 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "percent": self.percent}


# Cancel levels: what a job was asked (the ranks agree on the highest any of them holds).
NOT_CANCELLED, STOP, STOP_AND_CHECKPOINT = 0, 1, 2


class CancelTokens:
    """Which jobs were asked to stop, and whether to save a checkpoint first
    (a preemption). ``cancel(None)`` stops the job running now."""

    def __init__(self, remember: int = 256):
        self._lock = threading.Lock()
        self._remember = remember
        self._levels: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._current: str | None = None

    def cancel(self, job_id: str | None = None, checkpoint: bool = False) -> str | None:
        """Returns the job id the cancel was recorded for (None: nothing to cancel).
        A job asked both ways keeps the higher level: saving first costs a stop nothing."""
        with self._lock:
            target = job_id if job_id is not None else self._current
            if target is not None:
                level = STOP_AND_CHECKPOINT if checkpoint else STOP
                self._levels[target] = max(level, self._levels.pop(target, NOT_CANCELLED))
                while len(self._levels) > self._remember:
                    self._levels.popitem(last=False)
            return target

    def begin(self, job_id: str) -> None:
        with self._lock:
            self._current = job_id

    def end(self) -> None:
        """The job ran: a cancel it got is used up (the same id run again later starts clean)."""
        with self._lock:
            if self._current is not None:
                self._levels.pop(self._current, None)
            self._current = None

    def level(self, job_id: str) -> int:
        """``NOT_CANCELLED``, ``STOP`` or ``STOP_AND_CHECKPOINT``."""
        with self._lock:
            return self._levels.get(job_id, NOT_CANCELLED)

    def is_cancelled(self, job_id: str) -> bool:
        return self.level(job_id) > NOT_CANCELLED
