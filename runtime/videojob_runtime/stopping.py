"""The driver's records and its stop: what must work whatever the main thread is doing.

Records go to stdout as ``@@videojob {json}`` lines (``driver_protocol``),
one write each, every one carrying the protocol this driver speaks.

Stop (``POST /api/jobs/{id}/stop``): Ray's job supervisor sends SIGTERM and
SIGKILLs 3 s later. The stop signals are blocked in every thread from the
start (the threads Ray creates inherit the mask) and taken by one thread with
``sigwait``, so the stop does not wait for the main thread, whatever Ray call
it is blocked in. That thread kills the group's actors and removes its
placement group by name (also while ``ActorGroup.start`` is still creating
them), removes the attempt's staged inputs, prints a ``Cancelled`` result and
exits 143, within ``stop_budget_s()``. From then on nothing the main thread
prints reaches stdout.

Nothing here imports ray at import time: the signal mask must be set first.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from typing import Any

from videojob.driver_protocol import PROTOCOL, record

log = logging.getLogger("videojob.driver")

NAMESPACE = "videojob"  # group.NAMESPACE (not imported here: that would import ray before the mask is set)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_STOPPED = 128 + signal.SIGTERM
# Ray's job supervisor SIGKILLs a stopped driver RAY_JOB_STOP_WAIT_TIME_S (default 3) seconds
# after SIGTERM; the driver inherits the supervisor's environment, so it knows the value and
# tears down within it, one second to spare. The chart and the embedded head set 10 s: on a
# busy node removing a placement group alone took longer than the default allows.
RAY_STOP_WAIT_DEFAULT_S = 3


def stop_budget_s() -> float:
    """Seconds the stopper may spend tearing the group down before it must exit."""
    try:
        wait = int(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", RAY_STOP_WAIT_DEFAULT_S))
    except ValueError:
        wait = RAY_STOP_WAIT_DEFAULT_S
    return max(1.0, wait - 1.0)


class _Out:
    """stdout records, one write each; after a stop began only the stopper's get through."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stopping = False
        self.result_printed = False

    def emit(self, kind: str, *, _stopper: bool = False, **fields: Any) -> bool:
        line = record(kind, protocol=PROTOCOL, **fields) + "\n"
        with self.lock:
            if self.stopping and not _stopper:
                return False
            sys.stdout.write(line)
            sys.stdout.flush()
            self.result_printed = self.result_printed or kind == "result"
            return True


OUT = _Out()


class _State:
    """What the stopper needs to know about the main thread's progress."""

    def __init__(self) -> None:
        self.stage = "init"
        self.ray_ready = False
        self.group_name: str | None = None  # set before the group is looked up or started
        self.world = 0
        self.job_id: str | None = None
        self.progress: dict[str, Any] | None = None
        self.staging_dir: str | None = None  # this attempt's staged inputs (removed on the way out)


STATE = _State()


# -- stop --------------------------------------------------------------------------


def remove_group(name: str, world: int = 0, settle_s: float = 0.0) -> dict[str, Any]:
    """Kill every actor of group ``name`` (ranks ``0..world-1`` and any other
    ``NAME-rank<i>`` alive in the namespace) and remove its placement group,
    by name, whatever state they are in; missing ones are skipped. The
    placement group goes first, so an actor created meanwhile cannot be placed.
    ``settle_s`` > 0: until the names are released (at most that long), kill
    again whatever appears: while a stop tears the group down, the driver's main
    thread may still be creating ranks (found under load: two ranks created
    after the first pass stayed PENDING_CREATION, detached, for ever)."""
    removed: dict[str, Any] = {"placementGroup": False, "actors": []}
    # Removing the placement group kills the actors placed in it: these are the ones that were there.
    found = _actor_names(name, 0)
    for _ in range(2):  # a second pass for what the main thread created during the first
        _kill_pass(name, world, removed)
    if settle_s > 0:
        deadline = time.monotonic() + settle_s
        while group_present(name) and time.monotonic() < deadline:
            time.sleep(0.1)
            _kill_pass(name, world, removed)
        removed["gone"] = not group_present(name)
    removed["actors"] = sorted(found | set(removed["actors"]))
    return removed


def _kill_pass(name: str, world: int, removed: dict[str, Any]) -> None:
    """Remove group ``name``'s placement group and kill its named ranks, once."""
    import ray
    from ray.util.placement_group import remove_placement_group

    try:
        pg = ray.util.get_placement_group(f"{name}-pg")
    except ValueError:
        pg = None
    if pg is not None:
        try:
            remove_placement_group(pg)
            removed["placementGroup"] = True
        except Exception as exc:  # noqa: BLE001 - already removed
            log.debug("placement group %s-pg: %s", name, exc)
    for actor_name in sorted(_actor_names(name, world)):
        try:
            handle = ray.get_actor(actor_name, namespace=NAMESPACE)
        except Exception:  # noqa: BLE001 - gone; or dying, its class already dropped from the GCS (Ray asserts)
            continue
        try:
            ray.kill(handle, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - already dead
            log.debug("actor %s: %s", actor_name, exc)
            continue
        if actor_name not in removed["actors"]:
            removed["actors"].append(actor_name)


def _actor_names(name: str, world: int) -> set[str]:
    import ray

    pattern = re.compile(re.escape(name) + r"-rank\d+")
    names = {f"{name}-rank{r}" for r in range(world)}
    try:
        names |= {n for n in ray.util.list_named_actors() if pattern.fullmatch(n)}
    except Exception as exc:  # noqa: BLE001 - the ranks we know of are still killed
        log.warning("could not list the named actors: %s", exc)
    return names


def group_present(name: str) -> bool:
    """Whether an actor or the placement group of group ``name`` still exists in Ray."""
    import ray

    pattern = re.compile(re.escape(name) + r"-rank\d+")
    if any(pattern.fullmatch(n) for n in ray.util.list_named_actors()):
        return True
    try:
        pg = ray.util.get_placement_group(f"{name}-pg")
    except ValueError:
        return False
    table = ray.util.placement_group_table(pg)
    return table.get("state") not in (None, "REMOVED")


class Stopper(threading.Thread):
    """Takes SIGTERM/SIGINT with ``sigwait`` (they are blocked everywhere else):
    tears the group down, prints the Cancelled result, exits 143."""

    def __init__(self) -> None:
        super().__init__(name="videojob-stopper", daemon=True)

    def run(self) -> None:
        signum = signal.sigwait(STOP_SIGNALS)
        self.stop(signal.Signals(signum).name)

    def stop(self, signame: str) -> None:
        started = time.monotonic()
        with OUT.lock:
            OUT.stopping = True
            done = OUT.result_printed
        if done:  # the job had ended (its group torn down or kept) and said so: just go
            log.warning("%s after the result: exiting", signame)
            logging.shutdown()
            os._exit(EXIT_STOPPED)
        stage = stop_stage()
        log.warning("%s: stopping in stage %s, group %s", signame, stage, STATE.group_name)
        removed: dict[str, Any] = {}
        torn_down = STATE.group_name is None  # nothing was created yet
        if STATE.group_name is not None and STATE.ray_ready:
            # Kill, then wait (within the budget) to see it gone: ``removed["gone"]``.
            budget = stop_budget_s()
            settle = max(0.0, budget - 1.0)
            worker = threading.Thread(
                target=lambda: removed.update(remove_group(STATE.group_name, STATE.world, settle_s=settle)),
                name="videojob-teardown", daemon=True)
            worker.start()
            worker.join(budget)
            torn_down = not worker.is_alive()
            if not torn_down:
                log.error("tearing group %s down took longer than %.1fs: the operator must remove it "
                          "(--teardown)", STATE.group_name, budget)
        if STATE.staging_dir:  # the finally that would remove it never runs after os._exit
            shutil.rmtree(STATE.staging_dir, ignore_errors=True)
        error: dict[str, Any] = {"reason": "Cancelled", "stage": stage,
                                 "message": f"stopped by the operator ({signame})", "groupTornDown": torn_down}
        if STATE.progress and STATE.progress.get("step"):
            error["step"] = STATE.progress["step"]
        OUT.emit("result", _stopper=True, ok=False, error=error, jobId=STATE.job_id, groupName=STATE.group_name,
                 removed=removed, stopSeconds=round(time.monotonic() - started, 3))
        logging.shutdown()
        os._exit(EXIT_STOPPED)


def stop_stage() -> str:
    if STATE.stage == "run" and STATE.progress:
        return STATE.progress.get("stage") or "run"
    return STATE.stage


def install_stop_handling() -> Stopper:
    """Block the stop signals in this (main) thread, before any other thread
    exists, and start the thread that waits for them."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    stopper = Stopper()
    stopper.start()
    return stopper


def finish(code: int) -> int:
    """The main thread's exit code, unless a stop began: then the stopper ends the process."""
    if OUT.stopping:
        while True:
            time.sleep(1)
    return code
