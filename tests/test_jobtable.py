"""The shared job table (raycluster/jobtable.py): one read of Ray's table answers every watcher.

The real dashboard answers it in every operator test that runs a driver; here,
the rules on a counting client: reads per interval, and ids the read lacks.
"""

from __future__ import annotations

import threading

from videojob.raycluster.client import RayJob
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
