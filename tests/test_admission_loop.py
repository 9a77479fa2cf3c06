"""The admission loop and the job runner (controller/runner.py) at small scale.

Jobs here are stand-ins for ``JobLifecycle`` that ask the real ``Admissions``
exactly as a parked lifecycle does (``request(ask, pass_now=False)``, park
when not admitted), run on the real ``JobRunner`` on an asyncio loop, and
hold their GPUs until released. What must hold:

- no double booking: GPUs held never exceed the capacity, at any admission;
- priority order: as GPUs free one job's worth at a time, the waiting jobs
  start highest priority first, then first come first served;
- a job deleted while queued is never admitted and its waiter ends;
- queued jobs hold no thread: 300 of them park with the pool's threads idle;
- a burst of new jobs is planned by at most ``STARTING_AT_ONCE`` threads at a
  time (besides running jobs'), however large the pool; waiting for one, an
  admitted job goes first, then new jobs, then place moves (``Gate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import pytest

from videojob.controller.admission import Admissions
from videojob.controller.flags import Wake
from videojob.controller.runner import (MOVED, NEW, PASS_GAP_S, PASS_SHARE, STARTING_AT_ONCE, WOKEN, Gate, JobRunner,
                                        PlaceBudget, admission_loop, near, pass_gap, worth_showing)
from videojob.inventory import parse_inventory
from videojob.scheduling import Ask

INVENTORY = parse_inventory({"device": "cpu", "classes": [
    {"name": "cpu4", "gpusPerPod": 4, "maxPods": 1, "gpuMemory": "8Gi", "hostMemory": "16Gi",
     "gpuType": "generic"}]})


class Flag:
    """kopf's async daemon flag: ``await stopped.wait()``."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()


class Book:
    """Who holds GPUs now; every admission checked against the capacity."""

    def __init__(self, capacity: int):
        self.capacity, self.held, self.started, self.peak = capacity, {}, [], 0
        self.lock = threading.Lock()

    def take(self, key: str, gpus: int) -> None:
        with self.lock:
            assert key not in self.held, f"{key} admitted twice"
            self.held[key] = gpus
            self.started.append(key)
            self.peak = max(self.peak, sum(self.held.values()))
            assert sum(self.held.values()) <= self.capacity, f"double booking: {self.held}"


class StandIn:
    """A lifecycle that asks like a parked ``JobLifecycle`` and then holds its GPUs."""

    def __init__(self, admissions: Admissions, book: Book, name: str, gpus: int, priority: int, seq: int):
        self.key, self.admissions, self.book = f"ns/{name}", admissions, book
        self.ask = Ask(self.key, "cpu4", gpus, priority, seq, preemptible=False)
        self.threads_seen: set[int] = set()
        self.release = threading.Event()
        self.runs = 0
        self.shown: int | None = None
        self.think_s = 0.0  # how long its first look takes (planning, a status write)
        self.on_admitted = None  # set by the runner, called past the queue (as JobLifecycle does)

    def shown_place(self) -> int | None:
        return self.shown

    def parked_workload(self) -> None:  # kueue mode's park (none here)
        return None

    def run(self, stopped: threading.Event, park: bool = False) -> bool:
        self.runs += 1
        self.threads_seen.add(threading.get_ident())
        if stopped.is_set():
            return False
        if self.runs == 1 and self.think_s:
            time.sleep(self.think_s)
        admission, place, _ = self.admissions.request(self.ask, pass_now=not park)
        if admission is None:
            self.shown = place if place is not None else self.shown  # what a status write would show
            return True  # parked
        self.book.take(self.key, admission.gpus)
        if self.on_admitted is not None:
            self.on_admitted()
        while not (stopped.is_set() or self.release.wait(0.01)):
            pass
        with self.book.lock:
            self.book.held.pop(self.key)
        self.admissions.finish(self.key)
        return False


def _wait(what: str, condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def running(threads: int):
    """An asyncio loop in a thread (kopf's), the admission loop, and a runner of
    ``threads`` threads at most; stopped after."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    admissions = Admissions(INVENTORY, idle_ttl_s=0)
    alive = threading.Event()
    alive.set()
    threading.Thread(target=admission_loop, args=(admissions, alive, 0.02), daemon=True).start()
    runner = JobRunner(admissions, threads=threads, poll_interval_s=0.02, place_interval_s=0.05)
    try:
        yield loop, admissions, runner
    finally:
        alive.clear()
        runner.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.fixture
def loop_thread():
    with running(threads=8) as parts:
        yield parts


def _start(loop, runner, job):
    flag = Flag()
    future = asyncio.run_coroutine_threadsafe(runner.run(job, flag), loop)
    return flag, future


def test_no_double_booking_and_priority_order(loop_thread):
    loop, admissions, runner = loop_thread
    book = Book(capacity=4)
    first = StandIn(admissions, book, "first", 4, 0, 0)
    flags = {"first": _start(loop, runner, first)}
    _wait("the first job to hold the whole pod", lambda: book.held.get("ns/first") == 4)
    # Then, while it runs: low, mid, high and a second low, each a whole pod.
    jobs = {name: StandIn(admissions, book, name, 4, prio, seq)
            for seq, (name, prio) in enumerate([("low", 0), ("mid", 5), ("high", 9), ("low2", 0)], start=1)}
    for name, job in jobs.items():
        flags[name] = _start(loop, runner, job)
    _wait("four parked jobs", lambda: runner.parked == 4)
    previous = first
    for expected in ("high", "mid", "low", "low2"):
        previous.release.set()
        _wait(f"{expected} to start", lambda e=expected: f"ns/{e}" in book.held)
        assert len(book.held) == 1, book.held
        previous = jobs[expected]
    previous.release.set()
    for name, (_, future) in flags.items():
        future.result(timeout=10)
    assert book.started == ["ns/first", "ns/high", "ns/mid", "ns/low", "ns/low2"] and book.peak == 4
    assert not admissions.scheduler.waiting and not admissions.scheduler.running


def _held_pod(loop, admissions, runner):
    """A job holding the whole pod: (the book, the job, its runner's future)."""
    book = Book(capacity=4)
    holder = StandIn(admissions, book, "holder", 4, 0, 0)
    _, holding = _start(loop, runner, holder)
    _wait("the holder to run", lambda: "ns/holder" in book.held)
    return book, holder, holding


def test_a_job_deleted_while_queued_is_never_admitted(loop_thread):
    loop, admissions, runner = loop_thread
    book, holder, holding = _held_pod(loop, admissions, runner)
    doomed = StandIn(admissions, book, "doomed", 4, 9, 1)
    flag, future = _start(loop, runner, doomed)
    _wait("the doomed job to park", lambda: runner.parked == 1)
    # What the finalizer and kopf do: the books forget it, then the daemon's flag is set.
    admissions.cancel(doomed.key)
    loop.call_soon_threadsafe(flag.event.set)
    future.result(timeout=10)
    holder.release.set()
    holding.result(timeout=10)
    for _ in range(3):  # scheduling passes with the pod free: nothing may admit it now
        admissions.tick()
    assert "ns/doomed" not in book.started and runner.parked == 0
    assert not admissions.scheduler.waiting


def test_queued_jobs_hold_no_thread(loop_thread):
    loop, admissions, runner = loop_thread
    book, holder, holding = _held_pod(loop, admissions, runner)
    queued = [StandIn(admissions, book, f"q{i}", 1, 0, i + 1) for i in range(300)]
    started = [_start(loop, runner, job) for job in queued]
    _wait("300 parked jobs", lambda: runner.parked == 300, timeout=60)
    threads = [t for t in threading.enumerate() if t.name.startswith("videojob-job")]
    assert len(threads) <= 8  # the pool's bound, not one per job
    busy = sum(1 for job in queued if job.runs and job.key in book.held)
    assert busy == 0
    holder.release.set()
    holding.result(timeout=10)
    _wait("four one-GPU jobs to start", lambda: len(book.held) == 4)
    for job in queued:
        job.release.set()
    for _, future in started:
        future.result(timeout=60)
    assert len(book.started) == 301 and book.peak == 4
    # Each job's lifecycle ran a few times at most (parked, woken by admission or a moved place).
    assert max(job.runs for job in queued) <= 40


def test_a_burst_of_new_jobs_is_planned_by_a_bounded_number_of_threads():
    """400 jobs arrive at once, each first look taking 20 ms, on a pool that may grow to
    1,000 threads: at most STARTING_AT_ONCE of them look at a time (plus the running
    holder's thread), so the pool stays that small (it grew to 2,118 threads at 10,000 jobs)."""
    with running(threads=1000) as (loop, admissions, runner):
        book, holder, holding = _held_pod(loop, admissions, runner)
        burst = [StandIn(admissions, book, f"b{i}", 1, 0, i + 1) for i in range(400)]
        for job in burst:
            job.think_s = 0.02
        started = [_start(loop, runner, job) for job in burst]
        _wait("400 parked jobs", lambda: runner.parked == 400, timeout=120)
        # Every thread this runner's pool made: the bound, the holder's, and a few more where
        # a look was handed over before the thread that ended the last one said it was idle.
        threads = len(runner.pool._threads)
        assert threads <= STARTING_AT_ONCE + 8, f"{threads} threads for a burst of 400 jobs"
        holder.release.set()
        holding.result(timeout=10)
        for job in burst:
            job.release.set()
        for _, future in started:
            future.result(timeout=120)
        assert len(book.started) == 401 and book.peak <= 4


def test_places_are_shown_as_they_move_near_the_front_and_by_tenths_further_back():
    assert worth_showing(5, 4) and worth_showing(100, 99) and worth_showing(101, 100)
    assert not worth_showing(5000, 4999) and not worth_showing(5000, 4501)
    assert worth_showing(5000, 4500) and worth_showing(5000, 6000)


def test_the_gate_serves_admitted_jobs_before_new_ones_and_new_ones_before_place_moves():
    """With the gate's slots taken, waiters are served by turn (WOKEN, NEW, MOVED), then in
    arrival order; a waiter cancelled while it waits, or as a slot was handed to it, loses
    no slot."""

    async def scenario() -> list[str]:
        gate, served = Gate(1), []
        await gate.acquire(NEW)  # the one slot, taken

        async def waiter(name: str, turn: int) -> None:
            await gate.acquire(turn)
            served.append(name)
            await asyncio.sleep(0)
            gate.release()

        tasks = [asyncio.create_task(waiter(name, turn)) for name, turn in (
            ("moved-1", MOVED), ("new-1", NEW), ("new-2", NEW), ("woken-1", WOKEN), ("moved-2", MOVED),
            ("woken-2", WOKEN))]
        doomed = asyncio.create_task(waiter("cancelled", WOKEN))
        await asyncio.sleep(0.01)  # every waiter queued at the gate
        assert gate.waiting() == (3, 2, 2)
        doomed.cancel()
        gate.release()  # the slot goes to woken-1, then each releaser hands it on
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        assert gate.free == 1 and gate.waiting() == (0, 0, 0), "a slot leaked"
        # Handed over and cancelled before it ran: the slot moves on, not lost.
        await gate.acquire(NEW)
        late = asyncio.create_task(gate.acquire(NEW))
        await asyncio.sleep(0.01)
        gate.release()
        late.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await late
        assert gate.free == 1, "the slot handed to a cancelled waiter was lost"
        return served

    assert asyncio.run(scenario()) == ["woken-1", "woken-2", "new-1", "new-2", "moved-1", "moved-2"]


def test_passes_are_spaced_out_when_they_are_slow():
    assert pass_gap(0.001, 1.0) == PASS_GAP_S  # a short queue: the least gap
    assert pass_gap(0.3, 1.0) == pytest.approx(0.3 * (1 - PASS_SHARE) / PASS_SHARE)  # passes <= PASS_SHARE of a CPU
    assert pass_gap(5.0, 1.0) == 1.0  # never past the poll interval
    assert pass_gap(0.001, 0.05) == 0.05  # a test's short interval is kept


def test_far_place_rewrites_are_bounded_by_a_budget_for_all_jobs():
    clock = [0.0]
    budget = PlaceBudget(rate_per_s=5.0, burst_s=10.0, clock=lambda: clock[0])
    # a burst of one place interval, then refused until time passes
    assert sum(budget.take() for _ in range(200)) == 50
    assert budget.refused == 150
    clock[0] += 1.0
    assert sum(budget.take() for _ in range(200)) == 5  # 5 a second
    clock[0] += 1000.0
    assert sum(budget.take() for _ in range(200)) == 50  # never more than the burst saved up
    # whatever the queue's length: a drain of 10,000 places over 450 s writes at most burst + rate * seconds
    clock[0], budget = 0.0, PlaceBudget(rate_per_s=5.0, burst_s=10.0, clock=lambda: clock[0])
    written = 0
    for second in range(450):
        clock[0] = float(second)
        written += sum(budget.take() for _ in range(10_000 // 10))  # every far job asks every 10 s
    assert written <= 50 + 5 * 450
    # the front is not limited: near() is asked first, the budget only beyond LIVE_PLACES
    assert near(120, 100) and near(100, 99) and not near(5000, 4000)


def test_a_stopped_job_leaves_the_gates_line_at_once_and_no_slot_is_lost():
    async def scenario():
        gate = Gate(1)
        await gate.acquire(NEW)  # the one slot is busy
        halt = asyncio.Event()
        waiting = asyncio.create_task(gate.acquire_unless(MOVED, halt))
        other = asyncio.create_task(gate.acquire_unless(NEW, asyncio.Event()))
        await asyncio.sleep(0.01)
        assert gate.waiting() == (0, 1, 1)
        halt.set()
        assert await asyncio.wait_for(waiting, timeout=1) is False  # not behind the busy slot
        assert gate.waiting()[2] == 0
        gate.release()
        assert await asyncio.wait_for(other, timeout=1) is True  # the slot went to the one still waiting
        gate.release()
        assert gate.free == 1
        # halted as the slot is handed over: passed on, not lost
        await gate.acquire(NEW)
        halt2 = asyncio.Event()
        racing = asyncio.create_task(gate.acquire_unless(WOKEN, halt2))
        await asyncio.sleep(0.01)
        gate.release()
        halt2.set()
        held = await asyncio.wait_for(racing, timeout=1)
        if held:
            gate.release()
        assert gate.free == 1, "a slot leaked"
        # halted before it asked: no slot taken
        assert await gate.acquire_unless(NEW, halt) is False and gate.free == 1
        # the caller cancelled while it waited: nothing held
        await gate.acquire(NEW)
        cancelled = asyncio.create_task(gate.acquire_unless(NEW, asyncio.Event()))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        gate.release()
        await asyncio.sleep(0.01)
        assert gate.free == 1 and gate.waiting() == (0, 0, 0)

    asyncio.run(scenario())


def test_the_books_preempt_for_a_higher_priority_and_let_idle_groups_expire(caplog):
    """The real Admissions on a clock the test moves: a higher-priority job that cannot be
    placed marks the running lower-priority one for preemption (and says so in the books'
    log); the victim's kept group is evicted for it; an idle group past the TTL expires
    and the books let its GPUs go. (The operator's own run of this story, with Ray and
    the sweeper, is tests/test_operator_books.py's and test_operator_preemption.py's, in
    `make test-slow`; tests/coverage-audit.json shows what only they reach.)"""
    caplog.set_level(logging.INFO, logger="videojob.admission")
    now = [1000.0]
    books = Admissions(INVENTORY, idle_ttl_s=30.0, clock=lambda: now[0])
    low = Ask("ns/low", "cpu4", 4, priority=0, seq=0, est_seconds=3600.0, pool_key="m-low")
    assert books.request(low)[0].gpus == 4
    high = Ask("ns/high", "cpu4", 4, priority=10, seq=1, est_seconds=60.0, pool_key="m-high")
    admission, position, _ = books.request(high)
    assert admission is None and position == 1
    assert books.preempt_requested("ns/low") and books.preempted_by("ns/low") == "ns/high"
    assert not books.preempt_requested("ns/high")
    assert "admission: preempting ns/low class=cpu4 for=ns/high pod=0 gpus=4" in caplog.text
    now[0] += 5.0
    books.request(high)  # a second pass preempts nothing more: the victim is already stopping
    assert caplog.text.count("admission: preempting") == 1

    books.finish("ns/low", keep_group="g-low", model="m-low")  # the victim stopped, its group kept
    admission = books.request(high)[0]
    assert admission is not None and admission.evict == ("g-low",), admission
    assert books.forget_group("g-low") is False, "an evicted group is no longer idle in the books"
    assert "g-low" not in books._models, "issue 36, 9: an evicted group's model was kept for ever"
    books.finish("ns/high", keep_group="g-high", model="m-high")
    assert set(books.idle_groups()) == {"g-high"}
    now[0] += 29.0
    assert books.expired() == []
    now[0] += 2.0
    assert books.expired() == ["g-high"]
    assert books.idle_groups() == {} and books.groups_in_use() == set()
    assert "admission: expired g-high class=cpu4  allocated=0/4 idle=0" in caplog.text


def test_a_job_found_running_after_a_restart_counts_from_its_start_and_stays_preemptible():
    """The books' expected end of a job found running (operator start, adopted driver) counts
    from its attempt's startedAt, not from the restart: a job at step 40 of 50 after 1000 s
    has ~250 s left and a higher-priority job preempts it; counted from the restart it looked
    about to finish (0 s left), never a victim."""
    from videojob.controller.context import parse_time

    now = [5000.0]
    books = Admissions(INVENTORY, idle_ttl_s=0, clock=lambda: now[0])
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1000))
    low = Ask("ns/low", "cpu4", 4, priority=0, seq=0, est_seconds=600.0, pool_key="m-low")
    books.running("ns/low", "cpu4", 4, 600.0, "g-low", "m-low", ask=low, started_at=started_at)
    run = books.scheduler.running["ns/low"]
    assert abs((now[0] - run.started) - (time.time() - parse_time(started_at))) < 5
    books.progress("ns/low", 40, 50)
    assert 200 < run.est_end - now[0] < 300, run.est_end - now[0]
    high = Ask("ns/high", "cpu4", 4, priority=10, seq=1, est_seconds=60.0, pool_key="m-high")
    assert books.request(high)[0] is None
    assert books.preempted_by("ns/low") == "ns/high"


def test_a_preemption_is_withdrawn_with_the_job_it_was_for():
    """A victim not yet stopped need not stop for a job deleted meanwhile: it is free to
    finish (and to be chosen again, for another job)."""
    books = Admissions(INVENTORY, idle_ttl_s=0, clock=lambda: 1000.0)
    books.request(Ask("ns/low", "cpu4", 4, priority=0, seq=0, est_seconds=3600.0, pool_key="m"))
    books.request(Ask("ns/high", "cpu4", 4, priority=10, seq=1, est_seconds=60.0, pool_key="m"))
    assert books.preempted_by("ns/low") == "ns/high"
    books.cancel("ns/high")
    assert not books.preempt_requested("ns/low") and not books.scheduler.running["ns/low"].preempting


def test_a_job_in_line_to_show_its_place_goes_to_the_front_line_once_admitted():
    """Issue 36, 5: a job woken to show a new place (MOVED) waits last at the gate; admitted
    while it waits, its GPUs are booked and it waited behind a whole burst of new jobs. Its
    listener now stays (the wake promotes it to the WOKEN line), and it is served first."""

    async def scenario() -> list[str]:
        gate, served, wake, halt = Gate(1), [], Wake(), asyncio.Event()
        await gate.acquire(NEW)  # the one slot, taken

        async def moved() -> None:
            assert await gate.acquire_unless(MOVED, halt, promote=wake)
            served.append("moved")
            gate.release()

        async def new(name: str) -> None:
            await gate.acquire(NEW)
            served.append(name)
            gate.release()

        tasks = [asyncio.create_task(moved())] + [asyncio.create_task(new(f"new-{i}")) for i in range(3)]
        await asyncio.sleep(0.01)
        assert gate.waiting() == (0, 3, 1)
        wake.set()  # the admission loop admitted it: its listener
        await asyncio.sleep(0.01)
        assert gate.waiting() == (1, 3, 0), "not moved to the front line"
        gate.release()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        assert gate.free == 1 and gate.waiting() == (0, 0, 0), "a slot leaked"
        return served

    assert asyncio.run(scenario()) == ["moved", "new-0", "new-1", "new-2"]


def test_a_job_whose_place_moved_still_hears_its_admission(loop_thread):
    """The runner side of the above: MOVED returns with the job's listener kept, so the
    admission that comes while it waits at the gate wakes it."""
    loop, admissions, runner = loop_thread
    admissions.running("ns/holder", "cpu4", 4, 60.0, None, None)
    job = StandIn(admissions, Book(4), "moved", 1, priority=0, seq=1)
    assert job.run(threading.Event(), park=True) and admissions.request(job.ask, pass_now=True)[1] == 1
    job.shown = 1
    admissions.request(Ask("ns/first", "cpu4", 1, 10, 0, preemptible=False), pass_now=True)  # ahead of it now
    assert admissions.place(job.key) == 2
    woken, flag = Wake(), runner.flags.flag()
    turn = asyncio.run_coroutine_threadsafe(runner._wait_for_turn(job, loop, woken, flag), loop).result(10)
    assert turn == MOVED
    admissions.finish("ns/holder")  # the GPUs free: the admission loop admits it
    _wait("the admission to wake the job that waits to show its place", woken.is_set, timeout=10)
    admissions.unlisten(job.key)
