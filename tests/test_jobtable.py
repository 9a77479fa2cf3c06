"""The shared job table (raycluster/jobtable.py): one read of Ray's table answers every watcher.

The real dashboard answers it in every operator test that runs a driver; here,
the rules on a counting client: reads per interval, and ids the read lacks.
"""

from __future__ import annotations

import threading
import time

import pytest

from videojob.raycluster.client import RayJob, RayUnavailable
from videojob.raycluster.jobtable import JobTable


class Counting:
    def __init__(self, jobs: dict[str, str]):
        self.table = dict(jobs)
        self.lists = self.singles = 0

    def jobs(self):
        self.lists += 1
        return [RayJob(sid, status) for sid, status in self.table.items()]

    def job(self, sid):
        self.singles += 1
        return RayJob(sid, self.table[sid]) if sid in self.table else None


def test_one_read_answers_every_running_job_within_the_interval():
    clock = [0.0]
    ray = Counting({f"sid-{i}": "RUNNING" for i in range(500)})
    table = JobTable(ray, max_age_s=1.0, clock=lambda: clock[0])
    for _ in range(3):  # three polls of 500 watchers, 0.3 s apart
        assert all(table.job(f"sid-{i}").status == "RUNNING" for i in range(500))
        clock[0] += 0.3
    assert ray.lists == 1 and ray.singles == 0
    ray.table["sid-7"] = "SUCCEEDED"
    clock[0] += 0.2  # 1.1 s after the read: the next look reads again
    assert table.job("sid-7").status == "SUCCEEDED" and ray.lists == 2


def test_an_id_the_read_lacks_is_asked_alone_never_taken_for_lost():
    ray = Counting({"old": "RUNNING"})
    table = JobTable(ray, max_age_s=60.0)
    assert table.job("old").status == "RUNNING"
    ray.table["new"] = "PENDING"  # submitted after the read
    assert table.job("new").status == "PENDING" and ray.singles == 1 and ray.lists == 1
    assert table.job("gone") is None and ray.singles == 2


def test_watchers_at_once_share_one_read():
    ray = Counting({f"s{i}": "RUNNING" for i in range(64)})
    table = JobTable(ray, max_age_s=30.0)
    barrier = threading.Barrier(64)
    seen = []

    def watch(i):
        barrier.wait()
        seen.append(table.job(f"s{i}").status)

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == ["RUNNING"] * 64 and ray.lists == 1


class Down:
    """Ray unreachable: each read of the table fails after ``read_s`` (the client's tries)."""

    def __init__(self, read_s: float):
        self.read_s, self.lists = read_s, 0

    def jobs(self):
        self.lists += 1
        time.sleep(self.read_s)
        raise RayUnavailable("cannot reach Ray's dashboard")

    def job(self, sid):
        raise AssertionError("no single lookup while the table's read fails")


def test_an_outage_is_learned_by_every_watcher_from_one_failed_read():
    """Issue 36, 7: the lock was held across a failing read that was not kept, so the watchers
    behind it each read again in turn: the eighth learned of the outage eight reads late."""
    ray = Down(read_s=0.4)
    table = JobTable(ray, max_age_s=5.0)
    learned: list[float] = []
    start = time.monotonic()

    def watch(i: int) -> None:
        try:
            table.job(f"sid-{i}")
        except RayUnavailable:
            learned.append(time.monotonic() - start)

    threads = [threading.Thread(target=watch, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(learned) == 8 and ray.lists == 1 and table.failed_reads == 1
    assert max(learned) < 2 * ray.read_s, f"the last watcher learned of it after {max(learned):.1f} s"
    with pytest.raises(RayUnavailable):
        table.job("sid-later")  # within max_age: the same answer, no read
    assert ray.lists == 1
