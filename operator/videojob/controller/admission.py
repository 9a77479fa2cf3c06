"""The operator's scheduler: the pure ``Scheduler`` behind a lock and a clock.

Each job's daemon asks ``request`` until it is admitted; whichever daemon
runs a scheduling pass, the admissions it makes for other jobs wait here
until those jobs' daemons collect them. Warm groups: a job that succeeded
leaves its group loaded (``finish(keep_group=...)``); ``expired`` hands back
the idle groups past the TTL, for the operator to tear down.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from typing import Any, Callable

from ..inventory import ClusterInventory
from ..scheduling import Admission, Ask, Scheduler
from ..scheduling.preemption import Preemption, plan_preemptions

log = logging.getLogger("videojob.admission")


def pool_key(model: str, source: str | None, plan: dict[str, Any]) -> str:
    """What a warm group must match to be reused: model, its source, layout, class."""
    keys = ("gpuClass", "gpus", "ulysses", "ring", "cfg", "offload", "vaeTiling", "vaeSlicing", "cache",
            "fp8Weights", "decodeOffload")
    data = {"model": model, "source": source or "", **{k: plan.get(k) for k in keys}}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


class Admissions:
    def __init__(self, inventory: ClusterInventory, idle_ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.inventory = inventory
        self.scheduler = Scheduler({c.name: (c.gpus_per_pod, c.max_pods) for c in inventory.classes}, idle_ttl_s)
        self.clock = clock
        self._granted: dict[str, Admission] = {}
        self._models: dict[str, str] = {}  # idle group -> model, for the pool metrics
        self._dirty, self._last_pass = True, float("-inf")
        self._places: dict[str, int] = {}
        self._queued_by_class: dict[str, int] = {}  # at the last pass (counting costs O(queue))
        self._preempting: dict[str, Preemption] = {}  # victim -> why, until it is admitted again
        self._listeners: dict[str, Callable[[], None]] = {}  # parked job -> wake it (admitted)
        self._changed = threading.Event()  # the books changed: the admission loop's cue
        self._lock = threading.Lock()

    # -- a job's view ----------------------------------------------------------

    def request(self, ask: Ask, pass_now: bool = True) -> tuple[Admission | None, int | None, str]:
        """(admission, queue position, what it waits for); enqueues on first call. Without
        ``pass_now`` (a parked job) the admission loop's next ``tick`` does the pass, and the
        position is None until a pass placed the job (no sort of the whole queue per job)."""
        with self._lock:
            granted = self._granted.pop(ask.key, None)
            if granted is not None:
                return granted, 0, ""
            if ask.key in self.scheduler.running:
                run = self.scheduler.running[ask.key]
                return Admission(ask.key, run.klass, run.pod, run.gpus, run.group), 0, ""
            if ask.key not in self.scheduler.waiting:
                self.scheduler.enqueue(ask)
                self._touch()
            now = self.clock()
            # A pass costs O(queue): run one when the books changed, else at most once a
            # second (reservations move with time), not once per waiting job's poll.
            if pass_now and (self._dirty or now - self._last_pass >= 1.0):
                self._pass(now)
            granted = self._granted.pop(ask.key, None)
            if granted is not None:
                return granted, 0, ""
            place = self._places.get(ask.key)
            if place is None and not pass_now:
                return None, None, ""
            position, why = self.scheduler.position(ask.key, now, place)
            return None, position, why

    def _pass(self, now: float) -> None:
        self._dirty, self._last_pass = False, now
        for admission in self.scheduler.schedule(now):
            self._granted[admission.key] = admission
            for group in (*admission.evict, admission.reuse):  # no longer idle: not in the pool metrics
                self._models.pop(group, None)
            wake = self._listeners.pop(admission.key, None)
            if wake is not None:
                wake()
            self._preempting.pop(admission.key, None)  # a preempted job runs again
            self._log("admitted", admission.key, admission.klass,
                      f"pod={admission.pod} gpus={admission.gpus} reuse={admission.reuse or '-'} "
                      f"evict={','.join(admission.evict) or '-'} backfilled={admission.backfilled}")
        for p in plan_preemptions(self.scheduler, now):
            self._preempting[p.victim] = p
            self._log("preempting", p.victim, p.klass,
                      f"for={p.for_key} pod={p.pod} gpus={p.gpus} lostGPUSeconds={p.lost_gpu_seconds:.0f}")
        self._places = self.scheduler.places()
        counts: dict[str, int] = {}
        for ask in self.scheduler.waiting.values():
            counts[ask.klass] = counts.get(ask.klass, 0) + 1
        self._queued_by_class = counts

    # -- the admission loop (parked jobs) -------------------------------------

    def _touch(self) -> None:
        self._dirty = True
        self._changed.set()

    def wait_for_change(self, timeout_s: float) -> bool:
        """Until the books change (a job asked, ended, or was cancelled), at most ``timeout_s``."""
        changed = self._changed.wait(timeout_s)
        self._changed.clear()
        return changed

    def tick(self) -> None:
        """One turn of the admission loop: a scheduling pass when the books changed (or
        a second passed: reservations move with time). Parked jobs poll nobody; this
        admits them and wakes each through its ``listen`` callback."""
        with self._lock:
            now = self.clock()
            if self._dirty or now - self._last_pass >= 1.0:
                self._pass(now)

    def listen(self, key: str, wake: Callable[[], None]) -> bool:
        """Call ``wake`` (once, under the books' lock: it must only schedule) when ``key`` is
        admitted; False, and no call, when it already is (or is not queued: ask again)."""
        with self._lock:
            if key in self._granted or key not in self.scheduler.waiting:
                return False
            self._listeners[key] = wake
            return True

    def unlisten(self, key: str) -> None:
        with self._lock:
            self._listeners.pop(key, None)

    def place(self, key: str) -> int | None:
        """``key``'s place in the queue at the last pass (None: not queued)."""
        with self._lock:
            return self._places.get(key) if key in self.scheduler.waiting else None

    def progress(self, key: str, step: int, steps: int) -> None:
        """A running job's denoising progress: its expected end follows it (the planner's
        estimate is a guess; a job past it would look about to finish for ever, never
        preemptible, and reservations behind it would be wrong). The time per step counts
        from its admission, load included: an over-estimate of what is left."""
        with self._lock:
            run = self.scheduler.running.get(key)
            if run is None or run.preempting or step <= 0 or steps <= 0:
                return
            now = self.clock()
            run.est_end = now + (now - run.started) / step * max(steps - step, 0)

    def preempt_requested(self, key: str) -> bool:
        """Whether ``key``'s running attempt must stop for a job of higher priority."""
        with self._lock:
            return key in self._preempting

    def preempted_by(self, key: str) -> str | None:
        with self._lock:
            p = self._preempting.get(key)
            return p.for_key if p is not None else None

    def running(self, key: str, klass: str, gpus: int, est_seconds: float, group: str | None,
                pool: str | None, ask: Ask | None = None, started_at: object = None) -> None:
        """A job found running (operator start, or an adopted driver); ``ask``: its
        priority and preemption fields (without it, it is never preempted); ``started_at``:
        its attempt's startedAt (status time), from which its expected end counts."""
        from .context import parse_time  # here: context imports this module

        started = parse_time(started_at) if started_at is not None else None
        ago = max(0.0, time.time() - started) if started is not None else 0.0
        with self._lock:
            self._touch()
            self.scheduler.reserve(key, klass, gpus, self.clock(), est_seconds, group, pool, ask=ask,
                                   started_ago_s=ago)

    def adopt_idle(self, group: str, klass: str, gpus: int, pool: str, model: str) -> bool:
        with self._lock:
            self._touch()
            ok = self.scheduler.adopt_idle(group, klass, gpus, pool, self.clock())
            if ok:
                self._models[group] = model
            return ok

    def _withdraw_preemptions_for(self, key: str) -> None:
        """``key`` left the queue (deleted): the victims chosen for it need not stop. A victim
        whose ranks were already asked still stops at its next step boundary (and waits
        again); one not asked yet (still starting: its preempt driver answered GroupNotFound)
        is not asked again (``Watching``), and may be chosen again for another job."""
        for victim, p in list(self._preempting.items()):
            if p.for_key != key:
                continue
            del self._preempting[victim]
            run = self.scheduler.running.get(victim)
            if run is not None:
                run.preempting = False
            self._log("unpreempting", victim, p.klass, f"for={key} (it left the queue)")

    def finish(self, key: str, keep_group: str | None = None, model: str = "") -> None:
        with self._lock:
            run = self.scheduler.running.get(key)
            self._touch()
            self.scheduler.finish(key, self.clock(), keep_group)
            self._preempting.pop(key, None)  # ended on its own: no preemption is owed any more
            if keep_group and keep_group in self.scheduler.idle:
                self._models[keep_group] = model
            if run is not None:
                self._log("released", key, run.klass, f"kept={keep_group or '-'}")

    def cancel(self, key: str) -> None:
        with self._lock:
            self._granted.pop(key, None)
            self._listeners.pop(key, None)
            self._preempting.pop(key, None)
            self._withdraw_preemptions_for(key)
            run = self.scheduler.running.get(key)
            self._touch()
            self.scheduler.cancel(key)
            if run is not None:
                self._log("released", key, run.klass, "kept=-")

    def _log(self, what: str, key: str, klass: str, detail: str) -> None:
        """One line per change of the books (the tests read the allocation timeline from these)."""
        s = self.scheduler
        log.info("admission: %s %s class=%s %s allocated=%d/%d idle=%d", what, key, klass, detail,
                 s.allocated(klass), s.capacity(klass), s.idle_gpus(klass))

    def attach(self, key: str, group: str) -> None:
        """The group ``key``'s attempt runs on, recorded before its driver is
        submitted: the sweeper, which reads the books after it listed Ray's groups,
        then always sees a group that exists in Ray as someone's."""
        with self._lock:
            self.scheduler.attach(key, group)

    def forget_group(self, group: str) -> bool:
        """An idle group that is gone (torn down, or found missing). True when it was
        idle here (and is forgotten now): checked and forgotten under one lock, so a
        group that a job was just admitted onto is never forgotten (nor torn down)."""
        with self._lock:
            idle = self.scheduler.idle.get(group)
            if idle is None:
                return False
            self._touch()
            self.scheduler.evicted(group)
            self._models.pop(group, None)
            self._log("evicted", group, idle.klass, "")
            return True

    def expired(self) -> list[str]:
        with self._lock:
            idle = dict(self.scheduler.idle)
            self._touch()
            old = self.scheduler.expire(self.clock())
            for group in old:
                self._models.pop(group, None)
                self._log("expired", group, idle[group].klass, "")
            return old

    def ping(self) -> None:
        """Take and release the lock: /healthz's proof that the books are not wedged."""
        with self._lock:
            pass

    def hold_for_ever(self) -> None:
        """Tests only (fault injection): take the lock and never give it back."""
        self._lock.acquire()
        threading.Event().wait()

    # -- views -----------------------------------------------------------------

    def groups_in_use(self) -> set[str]:
        with self._lock:
            return ({r.group for r in self.scheduler.running.values() if r.group}
                    | set(self.scheduler.idle) | {a.reuse for a in self._granted.values() if a.reuse})

    def holders(self) -> dict[str, str]:
        """Every job key the books hold and how: "waiting", "granted" (admitted, not yet
        running) or "running" (an attempt's GPUs). What the books must equal once a job is
        deleted or ended: nothing of it."""
        with self._lock:
            held = {key: "waiting" for key in self.scheduler.waiting}
            held.update({key: "granted" for key in self._granted})
            held.update({key: "running" for key in self.scheduler.running})
            return held

    def idle_groups(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.scheduler.idle)

    def snapshot(self) -> dict[str, Any]:
        """The books in numbers, O(classes + idle groups): every job calls it when they
        change (the per-class queue counts are the last pass's; a sum over the queue per
        call was a tenth of the operator's CPU with 5,000 queued)."""
        with self._lock:
            s = self.scheduler
            per_class = {}
            for c in self.inventory.classes:
                cap = s.capacity(c.name)
                used = s.allocated(c.name)
                per_class[c.name] = {"capacity": cap, "allocated": used, "free": cap - used,
                                     "idle": s.idle_gpus(c.name),
                                     "queued": self._queued_by_class.get(c.name, 0)}
            models: dict[str, int] = {}
            for group in s.idle:
                model = self._models.get(group, "unknown")
                models[model] = models.get(model, 0) + 1
            return {"classes": per_class, "idleGroupsByModel": models, "queued": len(s.waiting),
                    "running": len(s.running)}


__all__ = ["Admissions", "pool_key"]
