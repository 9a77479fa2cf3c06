"""Jobs without a thread each: queued jobs wait as coroutines, one admission loop admits them.

Why: each VideoJob's lifecycle used to be a sync kopf daemon, a thread from
the pool kopf's deletion handlers share, for the job's whole life. Past the
pool's size the extra jobs never entered the queue and finalizers waited
behind them; threads and memory grew with the backlog.

Now a job's task (``spawning.py``) is a coroutine (``run``) that hands the
lifecycle to this runner's own thread pool only while the job has work to do
(planning, submitting, watching a driver, ending). A job that must wait for
GPUs leaves its thread (``JobLifecycle.run(park=True)`` returns True) and its
coroutine waits without one for:

- its admission: the admission loop (``admission_loop``, one thread, a
  scheduling pass per ``poll_interval_s`` when the books changed) wakes it
  through ``Admissions.listen``;
- a move of its place in the queue, looked at every
  ``max(queue_status_interval_s, poll_interval_s)``, so its status shows it
  (beyond the first ``LIVE_PLACES`` places, a move of a tenth or more, and
  then only as ``PlaceBudget`` allows: ``FAR_PLACE_WRITES_PER_S`` for all of
  them, so a long queue's place writes do not grow with it);
- its stop (deletion or shutdown): its task's flag, mirrored to the thread's
  (a callback on the spawner's ``StopFlag``; no task a job: ``flags.py``).

In kueue admission mode a job whose Workload waits parks the same way and is
woken by the Workload watch (``WorkloadCache.listen``) when that Workload
changes, or after ``KUEUE_RECHECK_S`` at the latest (every
``kueue_poll_interval_s`` where there is no watch).

Deletion handlers run on kopf's own executor, which queued jobs no longer
occupy.

Threads: a job holds one while it runs (its watch of the driver) and, briefly,
while it plans, parks or is woken. The brief work is at most
``STARTING_AT_ONCE`` jobs at a time (a job stops counting once it is past the
queue, ``JobLifecycle.on_admitted``): 10,000 jobs created at once are planned
and parked by that many threads, not one each (measured: 2,118 threads
at 10,000 jobs before this bound; docs/scheduling.md). Waiting for one of
those slots (``Gate``), an admitted job goes before new jobs, and new jobs
before jobs that only show a new place, so a burst does not stall the queue.
The admission loop's passes are spaced out when they are slow (``pass_gap``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .admission import Admissions
from .flags import FlagGroup, SharedFlag, Wake
from .lifecycle import JobLifecycle

log = logging.getLogger("videojob.controller")


class JobRunner:
    """Runs lifecycles on ``threads`` threads at most; parked jobs hold none."""

    def __init__(self, admissions: Admissions, threads: int, poll_interval_s: float, place_interval_s: float,
                 kueue_poll_interval_s: float = 5.0):
        self.admissions = admissions
        self.workloads = None  # kueue.WorkloadCache in kueue mode with a watch (set at the operator's start)
        self.kueue_poll_interval_s = kueue_poll_interval_s
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="videojob-job")
        self.poll_interval_s = poll_interval_s
        self.place_interval_s = max(place_interval_s, poll_interval_s)
        self.parked = 0  # jobs waiting without a thread now (a gauge's source)
        self._lock = threading.Lock()
        self._starting = Gate(STARTING_AT_ONCE)  # jobs planning, parking or woken, at once
        self.far_places = PlaceBudget(FAR_PLACE_WRITES_PER_S, self.place_interval_s)
        self.flags = FlagGroup()  # the jobs' stop flags that lifecycle threads wait on (flags.py)

    async def run(self, lifecycle: JobLifecycle, stopped) -> None:
        """The job from wherever it is to its end, or until ``stopped`` (kopf's daemon flag)."""
        loop = asyncio.get_running_loop()
        flag = self.flags.flag()  # what the lifecycle's thread waits on
        woken = Wake()

        def on_stop() -> None:
            flag.set()
            woken.set()

        mirroring = None
        if hasattr(stopped, "when_set"):  # the spawner's StopFlag: a callback, no task a job
            stopped.when_set(on_stop)
            halt = stopped  # the stop, for waits on this loop
        else:  # another flag with ``await stopped.wait()`` (kopf's, a test's)
            halt = asyncio.Event()

            async def mirror() -> None:
                await stopped.wait()
                on_stop()
                halt.set()

            mirroring = asyncio.create_task(mirror(), name=f"stop-{lifecycle.key}")
        turn = NEW
        try:
            while not flag.is_set():
                # In line to show a new place, it still listens for its admission (MOVED kept the
                # listener): admitted meanwhile, it goes to the front line (Gate.acquire_unless).
                try:
                    if not await self._starting.acquire_unless(turn, halt, woken if turn == MOVED else None):
                        return  # stopped while it waited for a slot
                finally:
                    if turn == MOVED:
                        self.admissions.unlisten(lifecycle.key)
                held = [True]

                def release() -> None:  # once: at the admission (from the thread) or at the return
                    if held[0]:
                        held[0] = False
                        self._starting.release()

                lifecycle.on_admitted = lambda: loop.call_soon_threadsafe(release)
                try:
                    # In a copy of this coroutine's context: kopf.event (the phase events) finds
                    # kopf's posting queue through context variables, as in kopf's own executor.
                    parked = await _until_the_thread_ends(loop.run_in_executor(
                        self.pool, contextvars.copy_context().run, lifecycle.run, flag, True), flag)
                finally:
                    lifecycle.on_admitted = None
                    release()
                if not parked:
                    return
                turn = await self._wait_for_turn(lifecycle, loop, woken, flag)
        except asyncio.CancelledError:
            flag.set()  # kopf gave up waiting: the thread (if any) stops at its next look
            raise
        finally:
            if mirroring is not None:
                mirroring.cancel()
            else:
                stopped.forget(on_stop)

    async def _wait_for_turn(self, lifecycle: JobLifecycle, loop, woken: Wake, flag: SharedFlag) -> int:
        """Until the job is admitted, its place moved, or it is stopped; returns the
        turn it then takes at the gate (``WOKEN`` or ``MOVED``)."""
        key = lifecycle.key
        woken.clear()
        if flag.is_set():
            return WOKEN  # stopped before this wait began
        workload = lifecycle.parked_workload()
        if workload is not None:
            await self._wait_for_workload(workload, loop, woken, flag)
            return WOKEN
        if not self.admissions.listen(key, lambda: loop.call_soon_threadsafe(woken.set)):
            return WOKEN  # admitted already, or no longer queued: its lifecycle looks again
        shown = lifecycle.shown_place()  # the place its status shows (None: none yet)
        with self._lock:
            self.parked += 1
        parked_at = time.monotonic()
        moved = False
        try:
            while not flag.is_set():
                # Placed since it parked, or moved and due to be shown again (its lifecycle writes a
                # place at most every queue_status_interval_s: earlier, it would only park again).
                place = self.admissions.place(key)
                if place not in (None, shown) and (shown is None or (
                        time.monotonic() - parked_at >= self.place_interval_s and worth_showing(shown, place)
                        and (near(shown, place) or self.far_places.take()))):
                    moved = True  # its listener stays while it waits at the gate (run unlistens)
                    return MOVED
                # Nothing shown yet: look again at the next pass; else at the place interval.
                wait = self.poll_interval_s if shown is None else self.place_interval_s
                if await woken.wait(wait):
                    return WOKEN  # admitted (or stopped)
            return WOKEN  # stopped
        finally:
            if not moved:
                self.admissions.unlisten(key)
            with self._lock:
                self.parked -= 1

    async def _wait_for_workload(self, workload: tuple[str, str, str | None], loop, woken: Wake,
                                 flag: SharedFlag) -> None:
        """Until the Workload the job waits for changes (Kueue admitted, evicted or
        deleted it), the recheck is due, or the job is stopped."""
        namespace, name, seen = workload
        cache = self.workloads
        if cache is None:  # no watch: look again every poll interval
            await self._sleep_unless(woken, self.kueue_poll_interval_s)
            return
        cache.listen(namespace, name, lambda: loop.call_soon_threadsafe(woken.set))
        with self._lock:
            self.parked += 1
        try:
            known, item = cache.get(namespace, name)
            if known and (item is None or (item.get("metadata") or {}).get("resourceVersion") != seen):
                return  # it changed between the job's last read and this listen
            await self._sleep_unless(woken, max(KUEUE_RECHECK_S, self.kueue_poll_interval_s))
        finally:
            cache.unlisten(namespace, name)
            with self._lock:
                self.parked -= 1

    @staticmethod
    async def _sleep_unless(woken: Wake, seconds: float) -> None:
        await woken.wait(seconds)

    def stop(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


async def _until_the_thread_ends(work: asyncio.Future, flag: SharedFlag):
    """The lifecycle thread's result. Cancelled (the finalizer's grace is over, or the operator
    exits), the task still ends only when the thread has: a cancelled await is not a stopped
    thread, and one that went on writing books and status after its finalizer completed could
    write them for a job made again under the same name (issue 36). The flag makes the thread
    stop at its next look; a second cancel gives up waiting."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        flag.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({work})
        raise


WOKEN, NEW, MOVED = 0, 1, 2  # the gate's turns, first served first: an admitted job, a new one, a place to show


class Gate:
    """A semaphore whose waiters are served by turn, then in arrival order. An
    admitted job must not wait behind thousands of new jobs to be planned (measured:
    with one FIFO, 10,000 new jobs stalled the queue's drain while they were planned),
    and a new job not behind jobs that only rewrite their place in the queue."""

    def __init__(self, slots: int):
        self.free = slots
        self._waiters: tuple[collections.deque, ...] = (collections.deque(), collections.deque(),
                                                        collections.deque())

    async def acquire(self, turn: int = NEW) -> None:
        if self.free > 0 and not any(self._waiters[t] for t in range(turn + 1)):
            self.free -= 1
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters[turn].append(future)
        try:
            await future  # the releaser handed its slot over
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # handed over as it was cancelled: pass it on
            elif future in self._waiters[turn]:
                self._waiters[turn].remove(future)
            raise

    async def acquire_unless(self, turn: int, halt: asyncio.Event, promote: Wake | None = None) -> bool:
        """``acquire``, given up if ``halt`` is set first; True when the slot is held. A
        deleted job leaves the line at once: its finalizer waits for its task, and 1,000
        deleted jobs behind thousands of place rewrites each held a finalizer thread until
        cancelled (measured: 69 s to delete 1,000 of 10,000 queued). ``promote``: set while
        it waits, the waiter moves to the end of the ``WOKEN`` line (a job in line to show a
        new place that was admitted meanwhile: its GPUs are booked, it must not wait behind
        a burst of new jobs)."""
        if halt.is_set():
            return False
        if self.free > 0 and not any(self._waiters[t] for t in range(turn + 1)):
            self.free -= 1
            return True
        future = asyncio.get_running_loop().create_future()
        self._waiters[turn].append(future)
        halted = asyncio.ensure_future(halt.wait())
        promoted = asyncio.ensure_future(promote.wait()) if promote is not None and turn > WOKEN else None
        try:
            while not future.done():
                await asyncio.wait({future, halted} | ({promoted} if promoted else set()),
                                   return_when=asyncio.FIRST_COMPLETED)
                if future.done():
                    break
                if halted.done():
                    self._waiters[turn].remove(future)
                    return False
                if promoted is not None and promoted.done():
                    self._waiters[turn].remove(future)
                    turn = WOKEN
                    self._waiters[turn].append(future)
                    promoted = None
            return True
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # handed over as it was cancelled: pass it on
            elif future in self._waiters[turn]:
                self._waiters[turn].remove(future)
            raise
        finally:
            halted.cancel()
            if promoted is not None:
                promoted.cancel()

    def release(self) -> None:
        for waiters in self._waiters:
            while waiters:
                future = waiters.popleft()
                if not future.done():
                    future.set_result(None)
                    return
        self.free += 1

    def waiting(self) -> tuple[int, int, int]:
        return tuple(len(w) for w in self._waiters)  # type: ignore[return-value]


KUEUE_RECHECK_S = 60.0  # a parked kueue job looks at its Workload at least this often (a watch event lost)


LIVE_PLACES = 100  # queue places shown as they move; further back, moves of 10% or more


def worth_showing(shown: int, place: int) -> bool:
    """Whether a job whose status shows place ``shown`` is woken to show ``place``: near
    the front at every move, further back only when it moved by a tenth. With 10,000
    queued, each admission moves every place by one; a status write per job and move
    would be thousands of writes a second (measured: the 10,000-job run then drained
    at 2 jobs/s)."""
    return near(shown, place) or abs(place - shown) * 10 >= shown


def near(shown: int, place: int) -> bool:
    """Near the front, where every move is shown."""
    return place <= LIVE_PLACES or shown <= LIVE_PLACES


FAR_PLACE_WRITES_PER_S = 5.0  # status writes of places beyond LIVE_PLACES, for all jobs together


class PlaceBudget:
    """A token bucket for the far places' rewrites (on the event loop only).

    Why: with the tenth rule alone, each far job rewrites its place about
    log(place/100)/log(10/9) times while the queue drains (44 times from place
    10,000): writes grow as n log n with the queue (~37,000 of the 10,000-job
    run's 74,896 status writes, estimated). With this budget they are at most
    ``rate`` a second however long the queue; a job refused now looks again
    at its next place interval, and the front ``LIVE_PLACES`` are not limited."""

    def __init__(self, rate_per_s: float, burst_s: float, clock=time.monotonic):
        self.rate, self.capacity, self.clock = rate_per_s, max(1.0, rate_per_s * burst_s), clock
        self.tokens, self.at = self.capacity, clock()
        self.taken = self.refused = 0

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            self.taken += 1
            return True
        self.refused += 1
        return False


STARTING_AT_ONCE = 32  # jobs doing their brief work (plan, park, a wake) at once; running ones apart
PASS_GAP_S = 0.1  # least seconds between two passes (a pass sorts the whole queue)
PASS_SHARE = 0.3  # at most this share of a CPU goes to passes: with a long queue they are spaced out


def admission_loop(admissions: Admissions, alive: threading.Event, interval_s: float) -> None:
    """The one loop that admits parked jobs (``Admissions.tick``), until ``alive`` clears: a pass
    soon after the books change (a job ended: the next one starts at once), else every ``interval_s``."""
    while alive.is_set():
        admissions.wait_for_change(interval_s)
        started = time.monotonic()
        try:
            admissions.tick()
        except Exception:  # noqa: BLE001 - a pass that failed is tried again at the next turn
            log.exception("the admission loop's scheduling pass failed; trying again in %.1f s", interval_s)
        time.sleep(pass_gap(time.monotonic() - started, interval_s))


def pass_gap(pass_s: float, interval_s: float) -> float:
    """Seconds to wait after a turn that took ``pass_s``: ``PASS_GAP_S``, or longer when
    passes are slow (thousands queued), so they take at most ``PASS_SHARE`` of a CPU and
    leave the rest to the jobs; never past the poll interval."""
    return min(max(PASS_GAP_S, pass_s * (1 - PASS_SHARE) / PASS_SHARE), interval_s)
