"""One task per unfinished VideoJob, started from kopf's watch events.

Why not ``kopf.daemon``: for every object of a resource that has a daemon
handler, kopf keeps the object's latest body for as long as it exists, whether
its daemon runs or ended long ago: about 30 KiB a VideoJob (measured: a queued
job's body as Python objects), so 10,000 waiting and 20,000 finished jobs held
~900 MiB. An ``on.event`` handler keeps nothing: ``Spawner.notice`` starts the
job's task when kopf first sees it unfinished, and the job's lifecycle reads
what it needs from the API server itself.

What kopf's daemons did and this keeps:

- a task per job, started at the first event (the initial listing at a start,
  or the creation), at most one per uid, never again once it returned;
- a stop flag set when the job's deletion begins, and at the operator's exit;
  the finalizer (``wait_stopped``) holds the deletion until the task ended,
  cancelling it after a grace period, as kopf's ``cancellation_timeout``;
- a task that raised is run again after ``backoff_s`` (kopf's ``backoff``), doubled for
  each failure in a row, at most ``BACKOFF_CAP_S``; the job's status says why (``Controller.run_job``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .flags import FlagGroup, SharedFlag

log = logging.getLogger("videojob.spawning")


class StopFlag(asyncio.Event):
    """What the job runner awaits (``await stopped.wait()``) and tests (``if stopped``),
    as it did kopf's ``DaemonStopped``; ``when_set`` callbacks run (on the loop) when it is
    set, so the runner mirrors the stop to its thread's flag without a task a job."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []

    def __bool__(self) -> bool:
        return self.is_set()

    def set(self) -> None:
        first = not self.is_set()
        super().set()
        if first:
            for callback in list(self._callbacks):
                callback()

    def when_set(self, callback: Callable[[], None]) -> None:
        """``callback()`` when the flag is set (at once if it is)."""
        self._callbacks.append(callback)
        if self.is_set():
            callback()

    def forget(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)


@dataclass
class _Task:
    uid: str
    flag: StopFlag
    task: asyncio.Task | None = None
    ended: SharedFlag = field(default_factory=SharedFlag)  # the finalizer's thread waits on it (flags.py)


BACKOFF_CAP_S = 300.0  # the longest wait between two runs of a job whose lifecycle keeps failing
RunJob = Callable[[str, str, str, StopFlag], Awaitable[None]]  # (namespace, name, uid, stopped)


class Spawner:
    """The jobs' tasks on kopf's event loop (see the module)."""

    def __init__(self, run_job: RunJob, backoff_s: float = 5.0, grace_s: float = 5.0):
        self.run_job, self.backoff_s, self.grace_s = run_job, backoff_s, grace_s
        self._tasks: dict[str, _Task] = {}  # namespace/name -> the job's task while it runs
        self._done: set[str] = set()  # uids whose task returned: never started again (until the job is gone)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._ended = FlagGroup()  # the tasks' ends, which finalizer threads wait on

    @property
    def running(self) -> int:
        return len(self._tasks)

    def notice(self, namespace: str, name: str, uid: str, *, wanted: bool, deleting: bool, gone: bool) -> None:
        """An event about a job (on kopf's loop). ``wanted``: its lifecycle should run (it is
        not finished); ``deleting``: its deletion began; ``gone``: it was deleted."""
        self._loop = asyncio.get_running_loop()
        key = f"{namespace}/{name}"
        current = self._tasks.get(key)
        if current is not None and current.uid != uid:  # a job of the same name, deleted and made again
            current.flag.set()
            current = None
        if gone:
            self._done.discard(uid)
        if deleting or gone:
            if current is not None:
                current.flag.set()
            return
        if current is not None or self._closing or not wanted or uid in self._done:
            return
        entry = _Task(uid=uid, flag=StopFlag(), ended=self._ended.flag())
        entry.task = asyncio.create_task(self._run(namespace, name, entry), name=f"videojob-{key}")
        self._tasks[key] = entry

    def retry_in(self, failures: int) -> float:
        """Seconds before the next run after ``failures`` failed runs in a row: ``backoff_s``,
        doubled each time, at most ``BACKOFF_CAP_S`` (an error that lasts, such as RBAC the
        operator lacks, is tried again until it is fixed, without a log line every few seconds)."""
        return min(BACKOFF_CAP_S, self.backoff_s * 2 ** max(0, failures - 1))

    async def _run(self, namespace: str, name: str, entry: _Task) -> None:
        key = f"{namespace}/{name}"
        failures = 0
        try:
            while True:
                try:
                    await self.run_job(namespace, name, entry.uid, entry.flag)
                    break
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - as kopf did for a daemon: logged, run again after a backoff
                    failures += 1
                    log.exception("%s: the job's lifecycle failed; again in %g s", key, self.retry_in(failures))
                    try:
                        await asyncio.wait_for(entry.flag.wait(), timeout=self.retry_in(failures))
                        break  # stopped meanwhile
                    except asyncio.TimeoutError:
                        continue
            if not entry.flag.is_set():
                self._done.add(entry.uid)
        finally:
            if self._tasks.get(key) is entry:
                del self._tasks[key]
            entry.ended.set()

    def wait_stopped(self, namespace: str, name: str, uid: str, timeout_s: float) -> bool:
        """From the finalizer's thread: stop the job's task and wait until it ended (cancelled
        after ``grace_s``); False if it still runs after ``timeout_s``."""
        entry = self._tasks.get(f"{namespace}/{name}")
        if entry is None or entry.uid != uid or self._loop is None:
            return True
        self._loop.call_soon_threadsafe(entry.flag.set)
        if entry.ended.wait(min(self.grace_s, timeout_s)):
            return True
        if entry.task is not None:
            self._loop.call_soon_threadsafe(entry.task.cancel)
        return entry.ended.wait(max(0.0, timeout_s - self.grace_s))

    async def close(self) -> None:
        """The operator exits: every task is asked to stop, and cancelled after ``grace_s``."""
        self._closing = True
        entries = list(self._tasks.values())
        for entry in entries:
            entry.flag.set()
        tasks = [e.task for e in entries if e.task is not None]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=self.grace_s)
