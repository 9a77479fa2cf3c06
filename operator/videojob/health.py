"""Liveness: heartbeats of the loops the operator cannot work without.

/healthz answers 503, naming each heartbeat older than ``stall_s``
(VIDEOJOB_HEALTH_STALL_S), so the kubelet restarts a wedged operator:

- ``kopf event loop``: an asyncio task on kopf's loop stamps every ``beat_s``;
  a blocked loop watches nothing and runs no handler or daemon start.
- ``admissions``: a thread takes and releases the Admissions lock every
  ``beat_s`` and stamps after it; a lock held for ever admits and frees
  nothing.
- ``sweeper``: the sweeper stamps while it waits for its next sweep and after
  each step of a sweep (every job listed, every call to Ray or the API server),
  with a limit of its own (``limit_s``): a step may wait out its call's timeout
  and retries (an unreachable Ray, a busy API server) without the operator
  being restarted for it, but a sweeper stuck for good (it was, on a
  connection dropped silently, before every call had a timeout: issue 36)
  no longer reclaims groups or expires jobs unseen.

An idle operator passes: the beats do not need any job. A process resumed
after SIGSTOP finds every stamp old; its beats are due at once, so a check
that finds them stale waits up to ``grace_s`` for them before it says 503.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Callable

log = logging.getLogger("videojob.health")

KOPF_LOOP = "kopf event loop"
ADMISSIONS = "admissions"
SWEEPER = "sweeper"


class Health:
    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic):
        if not stall_s > 0:
            raise ValueError(f"stall_s must be positive, got {stall_s!r}")
        self.stall_s = float(stall_s)
        self.beat_s = min(5.0, self.stall_s / 4)
        self.grace_s = min(2.0, self.stall_s / 2)
        self.clock = clock
        self._beats: dict[str, float] = {}  # only the heartbeats started are checked
        self._limits: dict[str, float] = {}  # a heartbeat's own limit, where longer than stall_s
        self._stopped = threading.Event()
        self._tasks: list[asyncio.Task] = []

    def beat(self, name: str, limit_s: float | None = None) -> None:
        """Stamp ``name``; ``limit_s``: it is stale only after that long (at least ``stall_s``)."""
        if limit_s is not None:
            self._limits[name] = max(self.stall_s, float(limit_s))
        self._beats[name] = self.clock()

    def limit(self, name: str) -> float:
        return self._limits.get(name, self.stall_s)

    def stale(self) -> list[tuple[str, float]]:
        """(heartbeat, seconds since it last beat) for each older than its limit."""
        now = self.clock()
        return [(name, now - at) for name, at in sorted(self._beats.items()) if now - at > self.limit(name)]

    def check(self) -> tuple[bool, str]:
        """(healthy, the body /healthz answers)."""
        stale = self.stale()
        deadline = self.clock() + self.grace_s
        while stale and self.clock() < deadline and not self._stopped.is_set():
            time.sleep(0.05)  # just resumed (SIGSTOP, a long GC)? Its beats are due now.
            stale = self.stale()
        if not stale:
            now = self.clock()
            ages = ", ".join(f"{name} {now - at:.0f}s ago" for name, at in sorted(self._beats.items()))
            return True, f"ok (last heartbeats: {ages or 'none yet'})\n"
        lines = [f"stale: {name}: no progress for {age:.0f}s (limit {self.limit(name):g}s, "
                 f"from VIDEOJOB_HEALTH_STALL_S)" for name, age in stale]
        return False, "\n".join(lines) + "\n"

    # -- the heartbeats --------------------------------------------------------

    def start_loop_heartbeat(self) -> asyncio.Task:
        """On the running loop (kopf's): a task that stamps KOPF_LOOP every ``beat_s``."""
        self.beat(KOPF_LOOP)
        task = asyncio.get_running_loop().create_task(self._loop_beats(), name="videojob-health-heartbeat")
        self._tasks.append(task)  # a reference, or the loop may collect the task
        return task

    async def _loop_beats(self) -> None:
        while not self._stopped.is_set():
            self.beat(KOPF_LOOP)
            await asyncio.sleep(self.beat_s)

    def start_probe(self, name: str, probe: Callable[[], None]) -> threading.Thread:
        """A thread that calls ``probe`` (blocking while what it checks is wedged), then
        stamps ``name``, every ``beat_s``."""
        self.beat(name)

        def run() -> None:
            while not self._stopped.is_set():
                probe()
                self.beat(name)
                self._stopped.wait(self.beat_s)

        thread = threading.Thread(target=run, name=f"videojob-health-{name}", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """The heartbeats end at their next beat (no cross-thread cancel of the loop's task)."""
        self._stopped.set()


def install_fault_signals(hold_admissions: Callable[[], None]) -> None:
    """Tests only (VIDEOJOB_ALLOW_FAULT_INJECTION): wedge the operator on a signal,
    on the running loop (kopf's). SIGUSR1: a thread takes the Admissions lock and
    keeps it (``hold_admissions`` never returns); SIGUSR2: block kopf's event loop.
    Neither is undone: the test kills the process."""
    loop = asyncio.get_running_loop()

    def admissions() -> None:
        log.warning("fault injection (SIGUSR1): holding the Admissions lock for ever")
        threading.Thread(target=hold_admissions, name="videojob-fault-admissions", daemon=True).start()

    def block_loop() -> None:
        log.warning("fault injection (SIGUSR2): blocking kopf's event loop for ever")
        while True:
            time.sleep(3600)

    loop.add_signal_handler(signal.SIGUSR1, admissions)
    loop.add_signal_handler(signal.SIGUSR2, block_loop)
