"""The operator's controller over an API server and a Ray that live in this process.

``MemoryJobs`` is ``videojob.controller.kube.VideoJobs`` (get, list, delete, patch_status)
over a dict, with what the operator relies on of the API server: JSON merge patches of
the status, resourceVersions (a patch with ``expect`` is refused with Conflict when the
object changed), uids (made at creation; a status write that carries one reaches only that object, as the
operator's JSON patch that tests /metadata/uid does on the real server), and Gone for an
object that is not there. Ray is ``benchmarks/fake_ray.InstantRay``. The books (``Admissions``), the job
lifecycles and the scheduler are the product's; only the two services are stand-ins, so
a test of the books' races runs in milliseconds and can stop a thread at any line.
"""
from __future__ import annotations

import copy
import itertools
import sys
import threading
import uuid
from typing import Any, Callable

from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from fake_ray import InstantRay  # noqa: E402

from videojob.controller.kube import Conflict, Gone  # noqa: E402
from videojob.controller.status import merged  # noqa: E402 - RFC 7386, as the API server merges


class MemoryJobs:
    """VideoJobs in a dict: ``create`` and ``remove`` are the test's (a user's kubectl)."""

    def __init__(self):
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._versions = itertools.count(1)
        self._lock = threading.Lock()
        self.patches: list[tuple[str, str, dict[str, Any]]] = []  # (namespace, name, status patch) applied
        self.before_patch: Callable[[str, str, dict[str, Any]], None] | None = None  # a test's hook

    def create(self, doc: dict[str, Any]) -> dict[str, Any]:
        meta = doc["metadata"]
        key = (meta.get("namespace", "default"), meta["name"])
        with self._lock:
            if key in self._objects:
                raise Conflict(f"{key[0]}/{key[1]} exists")
            obj = copy.deepcopy(doc)
            obj["metadata"] = {**meta, "namespace": key[0], "uid": str(uuid.uuid4()),
                               "resourceVersion": str(next(self._versions)), "generation": 1,
                               "creationTimestamp": meta.get("creationTimestamp", "2026-12-07T00:00:00Z")}
            self._objects[key] = obj
            return copy.deepcopy(obj)

    def remove(self, namespace: str, name: str) -> None:
        with self._lock:
            self._objects.pop((namespace, name), None)

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        with self._lock:
            obj = self._objects.get((namespace, name))
            if obj is None:
                raise Gone(f"{namespace}/{name}")
            return copy.deepcopy(obj)

    def list(self, namespaces: list[str], page_size: int = 500,
             reduce: Callable[[dict[str, Any]], Any] | None = None) -> list[Any]:
        with self._lock:
            found = [copy.deepcopy(o) for (ns, _), o in sorted(self._objects.items())
                     if not namespaces or ns in namespaces]
        if reduce is None:
            return found
        return [kept for kept in map(reduce, found) if kept is not None]

    def delete(self, namespace: str, name: str, uid: str) -> bool:
        with self._lock:
            obj = self._objects.get((namespace, name))
            if obj is None or obj["metadata"]["uid"] != uid:
                return False
            del self._objects[(namespace, name)]
            return True

    def patch_status(self, namespace: str, name: str, status: dict[str, Any],
                     expect: str | None = None, uid: str | None = None,
                     known: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.before_patch is not None:
            self.before_patch(namespace, name, status)
        with self._lock:
            obj = self._objects.get((namespace, name))
            if obj is None:
                raise Gone(f"{namespace}/{name}")
            if uid is not None and obj["metadata"]["uid"] != uid:  # as the real server's test op (kube.py)
                raise Gone(f"{namespace}/{name} (uid {uid}): another object of that name now")
            if expect is not None and obj["metadata"]["resourceVersion"] != expect:
                raise Conflict(f"{namespace}/{name} changed since resourceVersion {expect}")
            obj["status"] = merged(obj.get("status") or {}, status)
            obj["metadata"]["resourceVersion"] = str(next(self._versions))
            self.patches.append((namespace, name, copy.deepcopy(status)))
            return copy.deepcopy(obj)


class StartingRay(InstantRay):
    """Ray for stories about running jobs: a job's driver runs until it is stopped or preempted
    (``delay_s``, an hour by default), showing step 1 done; its group is up only once the test says so (``up``),
    and a preempt driver finds it only then: before, it answers ``GroupNotFound`` as the real
    one does for a victim still starting. A preempted driver ends as the real one does (its
    result: ``Preempted``, after a checkpoint of step 1)."""

    def __init__(self, delay_s: float = 3600.0):
        super().__init__(delay_s=delay_s)
        self.groups_up: set[str] = set()
        self.preempts: list[tuple[str, str, bool]] = []  # (preempt driver, group, whether it asked the ranks)
        self._preempted: set[str] = set()  # job drivers asked to stop for a preemption
        self._preempt_ok: dict[str, bool] = {}  # preempt driver -> whether it found its group
        self._lost: set[str] = set()  # job drivers whose group lost a rank
        self.teardowns: list[str] = []  # groups a teardown driver was submitted for, in order
        self.teardowns_work = True  # False: a teardown driver removes nothing (it failed)
        self.on_teardown: Callable[[str], None] | None = None  # a test's look at that moment

    def up(self, group: str) -> None:
        with self._lock:
            self.groups_up.add(group)

    def lose(self, group: str) -> None:
        """The group's rank dies: its job's driver ends as lost (ActorDied), the group left behind."""
        with self._lock:
            self._lost |= {sid for sid, d in self._drivers.items() if (d.request.get("group") or {}).get("name") == group}

    # -- the State API: a group that is up has its placement group and rank 0 -------------

    def placement_groups(self, name_prefix: str = "", live_only: bool = True, where=None) -> list[dict[str, Any]]:
        self.calls["placement_groups"] += 1
        with self._lock:
            rows = [{"name": f"{g}-pg", "state": "CREATED", "placement_group_id": f"pg-{g}"} for g in self.groups_up]
        wanted = (where or {}).get("name")
        return [r for r in rows if r["name"].startswith(name_prefix) and (wanted is None or r["name"] == wanted)]

    def actors(self, name_prefix: str = "", alive_only: bool = True, where=None) -> list[dict[str, Any]]:
        self.calls["actors"] += 1
        with self._lock:
            rows = [{"name": f"{g}-rank0", "state": "ALIVE", "placement_group_id": f"pg-{g}"} for g in self.groups_up]
        where = where or {}
        return [r for r in rows if r["name"].startswith(name_prefix)
                and all(r.get(k) == v for k, v in where.items())]

    def submit(self, submission_id, entrypoint, **kwargs) -> bool:
        if " --teardown " in entrypoint:
            group = entrypoint.split(" --teardown ", 1)[1].split()[0]
            self.teardowns.append(group)
            if self.on_teardown is not None:
                self.on_teardown(group)
            if self.teardowns_work:
                with self._lock:
                    self.groups_up.discard(group)
            return super().submit(submission_id, entrypoint, **kwargs)
        if " --preempt " not in entrypoint:
            return super().submit(submission_id, entrypoint, **kwargs)
        group = entrypoint.split(" --preempt ", 1)[1].split()[0]
        with self._lock:
            found = group in self.groups_up
            if found:
                self._preempted |= {sid for sid, d in self._drivers.items()
                                    if (d.request.get("group") or {}).get("name") == group and not d.stopped}
            self._preempt_ok[submission_id] = found
            self.preempts.append((submission_id, group, found))
        return super().submit(submission_id, entrypoint, **kwargs)

    def _status(self, driver) -> str:
        if driver.submission_id in self._preempt_ok:
            return "SUCCEEDED" if self._preempt_ok[driver.submission_id] else "FAILED"
        if driver.submission_id in self._preempted or driver.submission_id in self._lost:
            return "FAILED"
        return super()._status(driver)

    def _log(self, submission_id: str) -> str:
        from videojob.driver_protocol import record

        with self._lock:
            ok = self._preempt_ok.get(submission_id)
            preempted = submission_id in self._preempted
            lost = submission_id in self._lost
            driver = self._drivers.get(submission_id)
        if ok is not None:
            return record("result", ok=ok, preempt=True, error=None if ok else {
                "reason": "GroupNotFound", "stage": "preempt", "message": "the group is not running"}) + "\n"
        if lost and driver is not None:
            group = (driver.request.get("group") or {}).get("name")
            return "\n".join([record("group", name=group, reused=False, world=1, seconds=0.0),
                              record("result", ok=False, error={"reason": "ActorDied", "stage": "denoise",
                                                                "message": "rank 0 died", "step": 1})]) + "\n"
        if driver is not None and driver.request and not preempted and self._status(driver) == "RUNNING":
            steps = int((driver.request.get("job") or {}).get("steps") or 0) or 50
            group = (driver.request.get("group") or {}).get("name")
            return "\n".join([record("group", name=group, reused=False, world=1, seconds=0.0),
                              record("progress", step=1, steps=steps, stage="denoise")]) + "\n"
        if preempted and driver is not None:
            group = (driver.request.get("group") or {}).get("name")
            return "\n".join([record("group", name=group, reused=False, world=1, seconds=0.0),
                              record("result", ok=False, error={"reason": "Preempted", "stage": "denoise",
                                                                "message": "preempted", "step": 1,
                                                                "checkpointStep": 1})]) + "\n"
        return super()._log(submission_id)


class ManualClock:
    """The books' clock (``Admissions.clock``), moved by the test: how long a job has run."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def memory_controller(tmp_path, classes: list[dict], ray: InstantRay | None = None, jobs: MemoryJobs | None = None,
                      **settings: Any):
    """A Controller (not started: no threads, no metrics server) over MemoryJobs and InstantRay
    (``jobs`` and ``ray`` of an earlier one: the operator restarted); its ``ctx`` is set as
    ``start`` would set it."""
    from operator_inprocess import write_classes

    from videojob.controller.context import Context
    from videojob.controller.operator import Controller
    from videojob.settings import OperatorSettings

    base = dict(ray_mode="address", ray_dashboard_url="http://instant-ray.invalid", driver_python=sys.executable,
                namespaces=["ns"], metrics_port=0, poll_interval_s=0.05, progress_interval_s=0.05, queue_status_interval_s=0,
                inventory_file=write_classes(tmp_path / f"inventory-{uuid.uuid4().hex}.yaml", classes),
                warm_group_ttl_s=0, sweep_interval_s=3600, ray_retry_s=0.05, retry_backoff_s=0.05)
    jobs, ray = jobs or MemoryJobs(), ray or InstantRay()
    controller = Controller(OperatorSettings(**{**base, **settings}), ray=ray, jobs=jobs)
    controller.ctx = Context(jobs=jobs, ray=ray, admissions=controller.admissions, inventory=controller.inventory,
                             settings=controller.settings, metrics=controller.metrics,
                             event=lambda *args: None)
    return controller, jobs, ray


__all__ = ["InstantRay", "ManualClock", "MemoryJobs", "StartingRay", "memory_controller"]
