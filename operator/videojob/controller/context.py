"""What every job's lifecycle shares, and the small pieces its parts all use."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

from ..api.status import Phase
from ..inventory import ClusterInventory
from ..metrics import Metrics
from ..raycluster.client import RayClient
from ..settings import OperatorSettings
from .admission import Admissions
from .groups import DriverLaunch
from .kube import VideoJobs

EventFn = Callable[[str, str, str, str, str, str], None]  # (namespace, name, uid, type, reason, message)
TERMINAL = {Phase.SUCCEEDED.value, Phase.FAILED.value, Phase.CANCELLED.value}


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
    kueue: Any = None  # kueue.KueueApi in kueue admission mode (settings.admission), else None
    job_table: Any = None  # raycluster.jobtable.JobTable: running drivers' status, one read for all

    def driver(self, submission_id: str):
        """A driver's Ray job (None: Ray does not know it), from the shared job table when there is one."""
        table = self.job_table
        return table.job(submission_id) if table is not None else self.ray.job(submission_id)

    @property
    def launch(self) -> DriverLaunch:
        """How drivers are submitted (every one: attempts' and teardowns')."""
        return DriverLaunch.of(self.settings)


class Stopped(Exception):
    """The daemon was asked to stop (operator shutdown or the job's deletion)."""


class Parked(Exception):
    """The job waits for GPUs and its lifecycle runs parked (``JobLifecycle.run(park=True)``):
    its thread goes back to the pool, and the job runner calls ``run`` again once the
    scheduler admitted it (or its place in the queue moved)."""


def parse_time(timestamp: object) -> float | None:
    """Seconds since the epoch of a status timestamp (None when it is not one)."""
    try:
        return datetime.strptime(str(timestamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None


def epoch(timestamp: str) -> float:
    """Seconds since the epoch of a status timestamp (now, when it is not one)."""
    parsed = parse_time(timestamp) if timestamp is not None else None
    return time.time() if parsed is None else parsed
