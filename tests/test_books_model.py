"""The books against random stories (issue 36, "done when": a model-based test).

A hypothesis state machine drives the product's own ``Admissions``, job lifecycles,
job runner and spawner (the objects ``memory_controller`` wires up) over the in-memory
API server and a fake Ray (tests/memory_operator.py), through random steps: jobs
created (1 or 2 GPUs, a priority) and deleted, a job of the highest priority that must
preempt, a driver that ends or loses a rank, the operator restarted, Ray away for a
while, a sweep. After every step the system is brought to rest (every job running on
a group that is up, parked in the queue showing its place, or ended; a scheduling
pass on the books then changes nothing), and the invariants are checked:

- the books equal Ray: the jobs the books hold GPUs for are exactly those whose
  attempt's driver runs, with the same GPUs and group, and the groups up in Ray are
  exactly the books' groups;
- no job is granted twice: never waiting and running at once, never two drivers;
- no deleted job holds anything: no GPUs in the books, no driver, no group;
- the GPUs granted never exceed a pod's or the cluster's capacity, in the books or in Ray;
- no lifecycle failed with an error the operator did not handle.

Not modelled: Kueue eviction. Kueue admission mode needs a real API server with
Kueue's CRDs (``videojob.kueue.KueueApi`` is a Kubernetes client; there is no
in-memory Workload store), and in that mode ``Admissions`` is not the books; its
evictions are tested against a real Kueue (tests/test_kueue_operator.py). Also not
modelled: an operator that crashes mid-line (a restart here is kopf's cleanup, the
jobs' tasks stopped; the mid-line races are tests/test_books_races.py), and warm
groups (``warm_group_ttl_s=0``, as ``memory_controller`` sets it).
"""
from __future__ import annotations

import asyncio
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from memory_operator import InstantRay, ManualClock, MemoryJobs, StartingRay, memory_controller
from operator_inprocess import one_rank

from videojob.controller.admission import Admissions
from videojob.controller.context import TERMINAL
from videojob.controller.groups import owner_uid
from videojob.controller.runner import admission_loop
from videojob.raycluster.client import RayJob, RayUnavailable

NAMESPACE = "ns"
GPUS_PER_POD, PODS = 2, 2
CLASSES = [{"name": "gpu", "gpusPerPod": GPUS_PER_POD, "maxPods": PODS}]
CAPACITY = GPUS_PER_POD * PODS
NAMES = ("a", "b", "c", "d", "e", "f")  # few: a deleted job's name is often made again
MOST_JOBS = 5  # at once: a queue behind a full cluster, and a name left for the next
SETTLE_S = 20.0  # the most one step may take to come to rest (a loaded 2-core machine)
STEP_S = 100.0  # the books' clock moves this much per look: a running job is far from its end


class OutageRay(StartingRay):
    """``StartingRay`` that can be away (``down``: every call refused, as ``HttpRayClient``
    refuses once its retries are spent), whose drivers can end on their own (``succeed``),
    whose preemptions can be held (``hold_preempts``: the preempt driver answers
    GroupNotFound, as for a victim still starting, so a test acts while a victim is
    chosen and not stopped yet), and whose teardown of a group ends the drivers still
    running on it, as a real teardown, which kills the group's ranks, does."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.refused = 0  # calls refused while down
        self.hold_preempts = False  # True: preempt drivers find no group (GroupNotFound) and are sent again
        self._succeeded: set[str] = set()

    def _answer(self, call: str) -> None:
        if self.down:
            self.refused += 1
            raise RayUnavailable(f"the fake Ray is down ({call})")

    def version(self) -> dict[str, Any]:
        self._answer("version")
        return super().version()

    def submit(self, submission_id: str, entrypoint: str, **kwargs: Any) -> bool:
        self._answer("submit")
        if " --preempt " in entrypoint and self.hold_preempts:  # as for a victim still starting
            group = entrypoint.split(" --preempt ", 1)[1].split()[0]
            with self._lock:
                self._preempt_ok[submission_id] = False
                self.preempts.append((submission_id, group, False))
            return InstantRay.submit(self, submission_id, entrypoint, **kwargs)
        created = super().submit(submission_id, entrypoint, **kwargs)
        if " --teardown " in entrypoint and self.teardowns_work:
            group = entrypoint.split(" --teardown ", 1)[1].split()[0]
            with self._lock:
                self._lost |= {sid for sid, d in self._drivers.items() if self._group(d) == group
                               and self._status(d) == "RUNNING"}
        return created

    def job(self, submission_id: str) -> RayJob | None:
        self._answer("job")
        return super().job(submission_id)

    def log_tail(self, submission_id: str, lines: int, node_id: str | None = None) -> str:
        self._answer("log_tail")
        return super().log_tail(submission_id, lines, node_id)

    def logs(self, submission_id: str) -> str:
        self._answer("logs")
        return super().logs(submission_id)

    def jobs(self) -> list[RayJob]:
        self._answer("jobs")
        return super().jobs()

    def stop(self, submission_id: str) -> bool:
        self._answer("stop")
        return super().stop(submission_id)

    def delete(self, submission_id: str) -> bool:
        self._answer("delete")
        return super().delete(submission_id)

    def actors(self, name_prefix: str = "", alive_only: bool = True, where: dict | None = None) -> list[dict]:
        self._answer("actors")
        return super().actors(name_prefix, alive_only, where)

    def placement_groups(self, name_prefix: str = "", live_only: bool = True,
                         where: dict | None = None) -> list[dict]:
        self._answer("placement_groups")
        return super().placement_groups(name_prefix, live_only, where)

    @staticmethod
    def _group(driver: Any) -> str | None:
        return (driver.request.get("group") or {}).get("name")

    def succeed(self, group: str) -> None:
        """The driver running on ``group`` finishes its video; it removes its group (not kept)."""
        with self._lock:
            self._succeeded |= {sid for sid, d in self._drivers.items() if self._group(d) == group
                                and self._status(d) == "RUNNING"}
            self.groups_up.discard(group)

    def _status(self, driver: Any) -> str:
        if driver.submission_id in self._succeeded:
            return "SUCCEEDED"
        return super()._status(driver)

    def running_attempts(self) -> dict[str, dict[str, Any]]:
        """The attempts' drivers that run now (not preempt or teardown drivers): submission
        id -> uid, key, attempt, group and the GPUs its group holds (ulysses x ring x cfg)."""
        out = {}
        with self._lock:
            for sid, d in self._drivers.items():
                if not d.request or self._status(d) != "RUNNING":
                    continue
                group = d.request.get("group") or {}
                out[sid] = {"uid": d.metadata.get("videojob.io/uid"), "attempt": d.metadata.get("videojob.io/attempt"),
                            "key": f"{d.metadata.get('videojob.io/namespace')}/{d.metadata.get('videojob.io/name')}",
                            "group": group.get("name"),
                            "gpus": int(group.get("ulysses") or 1) * int(group.get("ring") or 1)
                            * int(group.get("cfg") or 1)}
        return out

    def groups(self) -> set[str]:
        with self._lock:
            return set(self.groups_up)


class Errors(logging.Handler):
    """ERROR records of the operator's loggers: a lifecycle that failed (the spawner logs it
    and runs it again after a backoff) is a defect the invariants must name, not a timeout."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.name}: {record.getMessage()}"
                         + (f" ({record.exc_info[1]!r})" if record.exc_info else ""))


def _until(what: str, probe: Callable[[], Any], deadline: float) -> Any:
    """``probe()`` until it is truthy; fails naming ``what`` at ``deadline`` (time.monotonic)."""
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last: {found!r})")
        time.sleep(0.02)


class Operator:
    """One life of the operator: ``memory_controller``'s Controller with what kopf and
    ``Controller.start`` run around it: kopf's event loop (the spawner's tasks, the job
    runner's coroutines), the admission loop, the books rebuilt from the statuses and
    Ray, and kopf's first listing. No metrics server and no sweeper thread: the test
    runs a sweep when a step calls for one."""

    def __init__(self, workdir: Path, jobs: MemoryJobs, ray: OutageRay, clock: ManualClock):
        self.jobs, self.ray = jobs, ray
        self.controller, _, _ = memory_controller(workdir, CLASSES, ray=ray, jobs=jobs, poll_interval_s=0.02,
                                                  progress_interval_s=0.02)
        self.admissions = self.controller.admissions
        self.admissions.clock = clock
        self.controller.rebuild()
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="model-kopf-loop", daemon=True)
        self._loop_thread.start()
        self.controller.alive.set()
        self._admission = threading.Thread(target=admission_loop, name="model-admission", daemon=True,
                                           args=(self.admissions, self.controller.alive,
                                                 self.controller.settings.poll_interval_s))
        self._admission.start()
        for obj in jobs.list([NAMESPACE]):  # kopf's first listing
            self.notice(obj)

    def _on_loop(self, what: str, work: Callable[[], Awaitable[Any]]) -> Any:
        """``work()`` awaited on kopf's loop (the spawner's calls must run there), at most ``SETTLE_S``."""
        future = asyncio.run_coroutine_threadsafe(work(), self.loop)
        try:
            return future.result(SETTLE_S)
        except TimeoutError:
            future.cancel()
            raise AssertionError(f"timed out after {SETTLE_S:g} s waiting for kopf's loop to {what}") from None

    def notice(self, obj: dict[str, Any], deleting: bool = False, gone: bool = False) -> None:
        """A watch event about ``obj``, as the operator's kopf event handler passes it on."""
        meta, status = obj["metadata"], obj.get("status") or {}
        wanted = self.controller.needs_lifecycle(status)

        async def notice() -> None:
            self.controller.spawner.notice(meta["namespace"], meta["name"], meta["uid"], wanted=wanted,
                                           deleting=deleting, gone=gone)

        self._on_loop(f"take the event about {meta['name']}", notice)

    def delete(self, name: str) -> str:
        """A user's ``kubectl delete``: the deletion event, the finalizer (the lifecycle's
        deletion, then the job's task stopped), the object gone. Returns its uid."""
        obj = self.jobs.get(NAMESPACE, name)
        uid = obj["metadata"]["uid"]
        self.notice(obj, deleting=True)
        self.controller.delete(NAMESPACE, name, uid, obj.get("status") or {})
        deadline = time.monotonic() + SETTLE_S
        _until(f"the task of deleted {name} to stop (the finalizer's wait)",
               lambda: self.controller.spawner.wait_stopped(NAMESPACE, name, uid, timeout_s=1.0), deadline)
        self.jobs.remove(NAMESPACE, name)
        self.notice(obj, gone=True)
        return uid

    def stop(self) -> None:
        """kopf's cleanup: the jobs' tasks stopped (their drivers run on), then the controller."""
        self._on_loop("stop the jobs' tasks", self.controller.spawner.close)
        self.controller.stop()
        self._admission.join(SETTLE_S)
        assert not self._admission.is_alive(), "the admission loop did not stop"
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(SETTLE_S)
        assert not self._loop_thread.is_alive(), "kopf's loop did not stop"
        self.loop.close()


class Books:
    """A consistent copy of the books, taken under their lock."""

    def __init__(self, admissions: Admissions) -> None:
        with admissions._lock:  # one view of queue, running jobs, grants and pods
            s = admissions.scheduler
            self.waiting = set(s.waiting)
            self.running = {k: (r.group, r.gpus, r.preempting) for k, r in s.running.items()}
            self.granted = set(admissions._granted)
            self.idle = {g: i.gpus for g, i in s.idle.items()}
            self.used = {c.name: list(c.used) for c in s.classes.values()}
            self.places = dict(admissions._places)


class BooksModel(RuleBasedStateMachine):
    """Random steps against the real operator; at rest after each, the invariants hold."""

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(prefix="books-model-")
        self.errors = Errors()
        logging.getLogger("videojob").addHandler(self.errors)
        self.clock, self.jobs, self.ray = ManualClock(), MemoryJobs(), OutageRay()
        self.deleted: set[str] = set()  # uids of deleted jobs
        self.operator = Operator(Path(self._dir.name), self.jobs, self.ray, self.clock)

    def teardown(self) -> None:
        try:
            self.operator.stop()
        finally:
            logging.getLogger("videojob").removeHandler(self.errors)
            self._dir.cleanup()

    # -- what exists ------------------------------------------------------------

    def _live(self) -> dict[str, dict[str, Any]]:
        return {obj["metadata"]["name"]: obj for obj in self.jobs.list([NAMESPACE])}

    def _free_names(self) -> list[str]:
        live = self._live()
        return sorted(set(NAMES) - set(live)) if len(live) < MOST_JOBS else []

    def _running_names(self) -> list[str]:
        return sorted(k.split("/", 1)[1] for k in Books(self.operator.admissions).running)

    def _create(self, name: str, gpus: int, priority: int) -> None:
        doc = one_rank(name)
        doc["metadata"]["namespace"] = NAMESPACE
        doc["spec"]["resources"]["priority"] = priority
        if gpus == 2:
            doc["spec"]["parallel"] = {"ulysses": 2}
            doc["spec"]["resources"]["maxGPUs"] = 2
        self.operator.notice(self.jobs.create(doc))

    def _delete(self, name: str) -> None:
        self.deleted.add(self.operator.delete(name))

    def _restart(self) -> None:
        self.operator.stop()
        self.operator = Operator(Path(self._dir.name), self.jobs, self.ray, self.clock)

    def _attempt_group(self, name: str) -> str:
        return self.jobs.get(NAMESPACE, name)["status"]["attempts"][-1]["group"]

    # -- at rest -----------------------------------------------------------------

    def _unsettled(self) -> list[str]:
        """What is not at rest yet (empty: at rest). A driver that runs gets its group up:
        the group's ranks start (StartingRay waits for the test to say so)."""
        admissions, ray = self.operator.admissions, self.ray
        running = ray.running_attempts()
        for attempt in running.values():
            if attempt["group"] not in ray.groups():
                ray.up(attempt["group"])
        books = Books(admissions)
        why = [f"admissions not collected: {sorted(books.granted)}"] if books.granted else []
        live = self._live()
        for name, obj in live.items():
            key, status = f"{NAMESPACE}/{name}", obj.get("status") or {}
            phase, attempts = status.get("phase"), status.get("attempts") or []
            if phase in TERMINAL:
                continue
            if key in books.running:
                last = attempts[-1] if attempts else {}
                if phase != "Running" or last.get("result") != "Running" or last.get("submissionId") not in running:
                    why.append(f"{key} running in the books, {phase} in its status, its driver not running")
                elif books.running[key][2]:
                    why.append(f"{key} is being preempted")
                elif not (status.get("progress") or {}).get("step"):
                    why.append(f"{key}'s progress not shown yet")
            elif key in books.waiting:
                shown = (status.get("queue") or {}).get("position")
                if phase != "Queued" or shown != books.places.get(key):
                    why.append(f"{key} waits at place {books.places.get(key)}, its status shows {phase} {shown}")
            else:
                why.append(f"{key} ({phase}) neither waits nor runs in the books")
        # A deleted job the books still hold is no passing state: the invariants name it.
        waiting = {k for k in books.waiting if k.split("/", 1)[1] in live}
        parked = self.operator.controller.runner.parked
        if parked != len(waiting):
            why.append(f"{parked} job(s) parked, {len(waiting)} waiting: {sorted(waiting)}")
        return why

    def _at_rest(self) -> tuple:
        """What a scheduling pass could change: who waits and where, who runs and on what."""
        books = Books(self.operator.admissions)
        return (sorted(books.waiting), sorted(books.running.items()), sorted(books.places.items()),
                sorted(self.ray.running_attempts()), sorted(self.ray.groups()))

    def _settle(self, sweep: bool = False) -> None:
        """Until the system is at rest and a scheduling pass, with the clock moved on, changes
        nothing. ``sweep``: the sweeper's pass once at rest (what a deletion left while Ray was away)."""
        admissions = self.operator.admissions
        deadline = time.monotonic() + SETTLE_S
        while True:
            while unsettled := self._unsettled():
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out after {SETTLE_S:g} s waiting for every job to be running "
                                         f"with its group up, parked showing its place, or ended: {unsettled}")
                time.sleep(0.02)
            if sweep:
                sweep = False
                self.operator.controller.sweep()
                continue
            before = self._at_rest()
            ran = set(Books(admissions).running)
            self.clock.advance(STEP_S)
            # Those that ran before the clock moved (a pass may start another just now).
            _until("the running jobs' expected ends to follow their progress (the clock moved on)",
                   lambda: all(r.est_end > self.clock.now + STEP_S / 2 for k, r in
                               list(admissions.scheduler.running.items()) if k in ran and not r.preempting), deadline)
            # A second on, so the next pass (the admission loop's, or this one) comes after that
            # progress: one the loop made just as the clock moved may have seen the ends before it.
            self.clock.advance(1.0)
            admissions.tick()
            if self._at_rest() == before and not self._unsettled():
                return

    # -- steps --------------------------------------------------------------------

    @initialize(first=st.lists(st.tuples(st.sampled_from([1, 2]), st.sampled_from([0, 1, 2])), min_size=2,
                               max_size=4))
    def some_jobs(self, first: list[tuple[int, int]]) -> None:
        """A few jobs (GPUs, priority) to begin with: the cluster often full, a queue behind it."""
        for name, (gpus, priority) in zip(NAMES, first):
            self._create(name, gpus, priority)
        self._settle()

    @precondition(lambda self: bool(self._free_names()))
    @rule(data=st.data(), gpus=st.sampled_from([1, 2]), priority=st.sampled_from([0, 1, 2]))
    def create(self, data: st.DataObject, gpus: int, priority: int) -> None:
        """A user creates a job (its name may be a deleted job's)."""
        self._create(data.draw(st.sampled_from(self._free_names()), label="name"), gpus, priority)
        self._settle()

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        """A user deletes a job, whatever it is doing."""
        self._delete(data.draw(st.sampled_from(sorted(self._live())), label="name"))
        self._settle()

    @precondition(lambda self: bool(self._running_names()) and bool(self._free_names()))
    @rule(data=st.data(), meanwhile=st.sampled_from(["nothing", "delete-victim", "delete-preemptor", "restart"]))
    def preempt(self, data: st.DataObject, meanwhile: str) -> None:
        """A job of 2 GPUs above every priority: it runs, on free GPUs or a victim's. Once
        a victim is chosen (before it stops), ``meanwhile`` happens."""
        name = data.draw(st.sampled_from(self._free_names()), label="name")
        top = max(((o.get("spec") or {}).get("resources") or {}).get("priority", 0) for o in self._live().values())
        key = f"{NAMESPACE}/{name}"
        self.ray.hold_preempts = True
        try:
            self._create(name, 2, top + 1)
            admissions = self.operator.admissions

            def chosen() -> tuple[list[str]] | None:
                """(the victims chosen for it,), ([],) once it runs without one; None: neither yet."""
                running = Books(admissions).running
                victims = [k for k in running if admissions.preempted_by(k) == key]
                return (victims,) if victims or key in running else None

            (victims,) = _until(f"{name} running, or a victim chosen for it", chosen, time.monotonic() + SETTLE_S)
            if victims and meanwhile == "delete-victim":
                self._delete(victims[0].split("/", 1)[1])
            elif victims and meanwhile == "delete-preemptor":
                spared = {v.split("/", 1)[1]: len(self.jobs.get(NAMESPACE, v.split("/", 1)[1])["status"]
                                                   .get("attempts") or []) for v in victims}
                self._delete(name)
            elif victims and meanwhile == "restart":
                self._restart()
        finally:
            self.ray.hold_preempts = False
        self._settle()
        if name in self._live():
            assert key in Books(self.operator.admissions).running, f"{name} outranks every job but does not run"
        if victims and meanwhile == "delete-preemptor":
            # Its victims were not asked yet (their preempt drivers were held): the preemption
            # is withdrawn with the job it was for, and none of them loses its attempt.
            for victim, attempts in spared.items():
                if victim in self._live():
                    status = self.jobs.get(NAMESPACE, victim)["status"]
                    assert len(status.get("attempts") or []) == attempts, \
                        f"{victim} was preempted for {name}, deleted before its victim was asked: {status}"

    @precondition(lambda self: bool(self._running_names()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A running job's driver ends: its video is made."""
        name = data.draw(st.sampled_from(self._running_names()), label="name")
        self.ray.succeed(self._attempt_group(name))
        self._settle()
        assert self.jobs.get(NAMESPACE, name)["status"]["phase"] == "Succeeded", f"{name} did not succeed"

    @precondition(lambda self: bool(self._running_names()))
    @rule(data=st.data())
    def lose_rank(self, data: st.DataObject) -> None:
        """A running job's group loses a rank: the attempt is lost, retried (or the job fails)."""
        self.ray.lose(self._attempt_group(data.draw(st.sampled_from(self._running_names()), label="name")))
        self._settle()

    @precondition(lambda self: bool(self._live()))
    @rule()
    def restart(self) -> None:
        """The operator restarts: a new controller adopts the jobs and drivers that exist."""
        self._restart()
        self._settle()

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data(), meanwhile=st.sampled_from(["nothing", "create", "delete", "restart"]))
    def ray_outage(self, data: st.DataObject, meanwhile: str) -> None:
        """Ray refuses every call for a while (``meanwhile`` happens then), then answers
        again. A deletion meanwhile leaves its driver and group to the sweeper (the
        finalizer cannot reach Ray): the sweeper's pass follows."""
        self.ray.down = True
        try:
            refused = self.ray.refused
            if self._running_names():  # their watches ask Ray every poll: wait until they were refused
                _until("the running jobs' watches to find Ray away", lambda: self.ray.refused >= refused + 3,
                       time.monotonic() + SETTLE_S)
            if meanwhile == "create" and self._free_names():
                name = data.draw(st.sampled_from(self._free_names()), label="name")
                self._create(name, 1, 0)
                _until(f"{name} to wait in the queue or to find Ray away", lambda: (
                    f"{NAMESPACE}/{name}" in Books(self.operator.admissions).waiting
                    or "fake Ray is down" in ((self.jobs.get(NAMESPACE, name).get("status") or {}).get("message")
                                              or "")), time.monotonic() + SETTLE_S)
            elif meanwhile == "delete" and self._live():
                self._delete(data.draw(st.sampled_from(sorted(self._live())), label="name"))
            elif meanwhile == "restart":
                self._restart()
        finally:
            self.ray.down = False
        self._settle(sweep=meanwhile == "delete")

    @precondition(lambda self: bool(self._live()))
    @rule()
    def sweep(self) -> None:
        """The sweeper's pass at rest finds nothing to reclaim: nothing was left behind."""
        swept = self.operator.controller.sweep()
        assert swept["ownerless"] == [] and swept["expired"] == [], f"the sweeper reclaimed {swept}"
        self._settle()

    # -- invariants (at rest) -----------------------------------------------------------

    @invariant()
    def no_lifecycle_failed(self) -> None:
        assert not self.errors.seen, f"the operator logged errors: {self.errors.seen}"

    @invariant()
    def books_equal_ray(self) -> None:
        books, drivers = Books(self.operator.admissions), self.ray.running_attempts()
        in_ray = {d["key"]: d["gpus"] for d in drivers.values()}
        held = {key: gpus for key, (_, gpus, _) in books.running.items()}
        live = self._live()
        assert held == in_ray, f"the books hold {held}, Ray runs {in_ray} (the jobs that exist: {sorted(live)})"
        for sid, d in drivers.items():
            obj = live.get(d["key"].split("/", 1)[1])
            assert obj is not None, f"Ray runs {sid} of {d['key']}, which is deleted; the books hold {held}"
            last = obj["status"]["attempts"][-1]
            assert d["uid"] == obj["metadata"]["uid"] and d["group"] == books.running[d["key"]][0] == last["group"], \
                f"{d['key']}: Ray runs {d}, the books say group {books.running[d['key']][0]}, its status {last}"
        groups = {group for group, _, _ in books.running.values()} | set(books.idle)
        assert self.ray.groups() == groups, f"groups up in Ray {sorted(self.ray.groups())}, the books' {sorted(groups)}"

    @invariant()
    def no_key_granted_twice(self) -> None:
        books, drivers = Books(self.operator.admissions), self.ray.running_attempts()
        assert not books.waiting & set(books.running), f"waiting and running: {books.waiting & set(books.running)}"
        assert not books.granted, f"granted, never collected: {books.granted}"
        keys = [d["key"] for d in drivers.values()]
        assert len(keys) == len(set(keys)), f"a job runs two drivers: {sorted(keys)}"

    @invariant()
    def no_deleted_job_holds_gpus(self) -> None:
        books, live = Books(self.operator.admissions), self._live()
        uids = {name: obj["metadata"]["uid"] for name, obj in live.items()}
        for key, (group, _, _) in books.running.items():
            name = key.split("/", 1)[1]
            assert name in uids and owner_uid(group or "") == uids[name], \
                f"the books hold GPUs for {key} on {group}, not its live job's (uid {uids.get(name)})"
        for key in books.waiting:
            assert key.split("/", 1)[1] in uids, f"{key} waits in the books but is deleted"
        leftovers = [d for d in self.ray.running_attempts().values() if d["uid"] in self.deleted]
        assert not leftovers, f"drivers of deleted jobs run: {leftovers}"
        owned = [g for g in self.ray.groups() if owner_uid(g) in self.deleted]
        assert not owned, f"groups of deleted jobs are up: {owned}"
        for name, obj in live.items():  # an ended job holds nothing either
            if (obj.get("status") or {}).get("phase") in TERMINAL:
                assert f"{NAMESPACE}/{name}" not in books.waiting | set(books.running), f"{name} ended but is held"

    @invariant()
    def within_capacity(self) -> None:
        books = Books(self.operator.admissions)
        used = books.used["gpu"]
        assert all(0 <= u <= GPUS_PER_POD for u in used), f"a pod's GPUs out of range: {used}"
        held = sum(gpus for _, gpus, _ in books.running.values()) + sum(books.idle.values())
        assert sum(used) == held <= CAPACITY, f"pods {used}, running and idle {held}, capacity {CAPACITY}"
        in_ray = sum(d["gpus"] for d in self.ray.running_attempts().values())
        assert in_ray <= CAPACITY, f"Ray runs drivers on {in_ray} GPUs, capacity {CAPACITY}"


# Small and fixed: CI minutes are scarce (the whole file runs in seconds). No shrinking: a
# try can wait out a settle deadline, minutes in all; a failure prints its steps as drawn.
BooksModel.TestCase.settings = settings(max_examples=8, stateful_step_count=8, deadline=None, derandomize=True,
                                        database=None, phases=[Phase.explicit, Phase.generate],
                                        report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])
test_books_model = BooksModel.TestCase
