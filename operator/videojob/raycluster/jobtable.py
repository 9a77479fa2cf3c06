"""Every running job's driver status from one read of Ray's job table per interval.

Why: each running VideoJob looked up its own driver (``GET /api/jobs/<id>``)
every ``poll_interval_s``; with hundreds running, that is hundreds of requests
a second to the one dashboard process. Watchers ask ``JobTable.job(sid)``
instead: one ``GET /api/jobs/`` answers all of them while it is younger than
``max_age_s`` (the poll interval, so a driver's end is seen at most one
interval later than before). The operator's hygiene keeps the table small
(ended drivers leave it), so the list stays cheap.

A submission id the last read does not hold (submitted since, or gone) is
asked about alone, so a new driver is never taken for a lost one.

A read that fails (Ray unreachable) is shared too, for ``max_age_s``: the
threads that waited for it, and those that come within that time, get its
error at once instead of each trying again in turn behind the lock (one
outage stalled every running job's thread one after the other: 8 threads
learned of it at 0.6 ... 4.1 s, about a minute each when the read hung).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .client import RayClient, RayJob, RayUnavailable


class JobTable:
    """``job(sid)`` served from a shared, recent read of Ray's whole job table."""

    def __init__(self, ray: RayClient, max_age_s: float, clock: Callable[[], float] = time.monotonic):
        self.ray, self.max_age_s, self.clock = ray, max_age_s, clock
        self._jobs: dict[str, RayJob] = {}
        self._read_at = float("-inf")  # clock() when the read in _jobs began
        self._failed: tuple[RayUnavailable, float] | None = None  # the last read's error, and when
        self._lock = threading.Lock()  # one read at a time; the others wait for it and share it
        self.reads = 0  # whole-table reads (for tests and the polling benchmark)
        self.single = 0  # lookups the table could not answer
        self.failed_reads = 0  # whole-table reads that failed (each shared for max_age_s)

    def job(self, submission_id: str) -> RayJob | None:
        with self._lock:
            failed = self._failed
            if failed is not None and self.clock() - failed[1] < self.max_age_s:
                raise type(failed[0])(str(failed[0]))  # a copy: each thread its own traceback
            if self.clock() - self._read_at >= self.max_age_s:
                started = self.clock()
                try:
                    table = {j.submission_id: j for j in self.ray.jobs() if j.submission_id}
                except RayUnavailable as exc:
                    self._failed = (exc, self.clock())
                    self.failed_reads += 1
                    raise
                self._jobs, self._read_at, self._failed = table, started, None
                self.reads += 1
            found = self._jobs.get(submission_id)
        if found is not None:
            return found
        self.single += 1
        return self.ray.job(submission_id)
