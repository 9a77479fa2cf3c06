"""Small flags a job holds for its whole life, cheap enough for 10,000 waiting jobs.

Why: each unfinished job had three ``threading.Event`` (its stop flag for the
lifecycle's thread, its deletion flag, its task's end for the finalizer), each
a Condition, a lock and a deque: about 1.2 KiB; and its parked wait was an
``asyncio.wait_for`` on an ``asyncio.Event``, a Task and a coroutine: about
2.7 KiB (measured with tracemalloc, Python 3.11). Issue 22's memory goal is
500 MiB at 10,000 jobs, so a job's waiting state must cost bytes, not KiB.

- ``SharedFlag``: what ``threading.Event`` offers a lifecycle (``is_set``,
  ``set``, ``wait(timeout)``, ``clear``), with one Condition shared by every
  flag of a ``FlagGroup``: a flag is a boolean; a ``set`` wakes the group's
  waiters (at most the threads that run jobs), who look at their own flag again.
- ``Wake``: an asyncio wake-up for one waiter at a time: ``wait(timeout)``
  awaits a bare future with a timer, no Task.
"""

from __future__ import annotations

import asyncio
import threading
import time


class FlagGroup:
    """The Condition that a set of ``SharedFlag`` share."""

    def __init__(self) -> None:
        self.condition = threading.Condition(threading.Lock())

    def flag(self) -> "SharedFlag":
        return SharedFlag(self)


class SharedFlag:
    """A ``threading.Event`` stand-in of a few dozen bytes (see the module)."""

    __slots__ = ("_group", "_set")

    def __init__(self, group: FlagGroup | None = None):
        self._group = group if group is not None else FlagGroup()
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def __bool__(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._group.condition:
            self._set = True
            self._group.condition.notify_all()

    def clear(self) -> None:
        self._set = False

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or ``timeout`` seconds passed; whether it is set (as ``threading.Event.wait``)."""
        if self._set:
            return True
        condition = self._group.condition
        deadline = None if timeout is None else time.monotonic() + timeout
        with condition:
            while not self._set:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                condition.wait(left)
            return self._set


class Wake:
    """One waiter's wake-up on an event loop: ``set`` from the loop (or through
    ``loop.call_soon_threadsafe``), ``await wait(timeout)`` in one coroutine at a time."""

    __slots__ = ("_set", "_future")

    def __init__(self) -> None:
        self._set = False
        self._future: asyncio.Future | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        future = self._future
        if future is not None and not future.done():
            future.set_result(True)

    def clear(self) -> None:
        self._set = False

    async def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after ``timeout`` seconds without a ``set``."""
        if self._set:
            return True
        loop = asyncio.get_running_loop()
        future = self._future = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _expire, future)
        try:
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            self._future = None


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(False)
