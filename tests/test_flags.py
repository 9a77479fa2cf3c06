"""controller/flags.py: the cheap flags every unfinished job holds (issue 22's memory goal).

What must hold: ``SharedFlag`` behaves as ``threading.Event`` for its users (a
``wait`` ends when its own flag is set, or times out False, not when another flag
of its group is set); ``Wake`` ends a wait True when set (before or during it) and
False at its timeout; the spawner's ``StopFlag`` calls its callbacks once. And each
costs a fraction of what it replaced (tracemalloc, on this Python).
"""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc

from videojob.controller.flags import FlagGroup, SharedFlag, Wake
from videojob.controller.spawning import StopFlag


def test_a_shared_flag_waits_for_itself_not_for_its_groups_other_flags():
    group = FlagGroup()
    mine, other = group.flag(), group.flag()
    results: list[tuple[bool, float]] = []

    def waiter() -> None:
        start = time.monotonic()
        results.append((mine.wait(5.0), time.monotonic() - start))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)  # let it wait
    other.set()  # wakes the group's waiters, who must look at their own flag again
    time.sleep(0.05)
    assert not results, "another flag of the group ended the wait"
    mine.set()
    thread.join(5.0)
    assert results and results[0][0] is True and results[0][1] < 4.0, results
    assert mine.is_set() and bool(mine) and mine.wait(0) is True
    mine.clear()
    assert not mine.is_set()


def test_a_shared_flags_wait_times_out_false():
    flag = SharedFlag()
    start = time.monotonic()
    assert flag.wait(0.1) is False
    assert 0.09 <= time.monotonic() - start < 2.0


def test_a_wake_ends_true_when_set_before_or_during_its_wait_and_false_at_its_timeout():
    async def scenario() -> tuple[bool, bool, bool, bool]:
        wake = Wake()
        timed_out = await wake.wait(0.05)
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, wake.set)
        during = await wake.wait(5.0)
        before = await wake.wait(5.0)  # still set: at once
        wake.clear()
        threading.Timer(0.05, lambda: loop.call_soon_threadsafe(wake.set)).start()
        from_thread = await wake.wait(5.0)
        return timed_out, during, before, from_thread

    assert asyncio.run(asyncio.wait_for(scenario(), 20)) == (False, True, True, True)


def test_a_stop_flag_calls_its_callbacks_once_and_at_once_when_already_set():
    async def scenario() -> list[str]:
        calls: list[str] = []
        flag = StopFlag()
        gone = lambda: calls.append("forgotten")  # noqa: E731
        flag.when_set(lambda: calls.append("a"))
        flag.when_set(gone)
        flag.forget(gone)
        flag.set()
        flag.set()  # a second set calls nobody again
        flag.when_set(lambda: calls.append("late"))
        assert flag.is_set() and bool(flag)
        await asyncio.wait_for(flag.wait(), 5)
        return calls

    assert asyncio.run(scenario()) == ["a", "late"]


def _bytes_each(make, count: int = 5000) -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [make() for _ in range(count)]
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(kept) == count
    return (after - before) / count


def test_the_flags_cost_a_fraction_of_what_they_replaced():
    group = FlagGroup()
    event = _bytes_each(threading.Event)
    shared = _bytes_each(group.flag)
    wake = _bytes_each(Wake)
    assert shared * 5 < event, f"SharedFlag {shared:.0f} B vs threading.Event {event:.0f} B"
    assert wake * 5 < event, f"Wake {wake:.0f} B vs threading.Event {event:.0f} B"
