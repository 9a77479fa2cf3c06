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


class CancelTokens:
    """Which jobs were asked to stop. ``cancel(None)`` stops the job running now."""

    def __init__(self, remember: int = 256):
        self._lock = threading.Lock()
        self._cancelled: collections.deque[str] = collections.deque(maxlen=remember)
        self._current: str | None = None

    def cancel(self, job_id: str | None = None) -> str | None:
        """Returns the job id the cancel was recorded for (None: nothing to cancel)."""
        with self._lock:
            target = job_id if job_id is not None else self._current
            if target is not None and target not in self._cancelled:
                self._cancelled.append(target)
            return target

    def begin(self, job_id: str) -> None:
        with self._lock:
            self._current = job_id

    def end(self) -> None:
        with self._lock:
            self._current = None

    def is_cancelled(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._cancelled
