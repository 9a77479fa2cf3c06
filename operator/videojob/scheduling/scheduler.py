"""Gang admission over GPU classes, with backfill and warm groups: a pure class.

No Kubernetes, no Ray, no clock of its own (every call takes ``now``), so the
operator, the property tests and the fleet simulation run the same code.

The model: each class has ``max_pods`` pods of ``gpus_per_pod`` GPUs. A job
asks for ``gpus`` of one class and gets them all in ONE pod, or waits.

Policy:
- Queue order: higher priority first; first come first served within a
  priority (``seq``, the arrival order).
- Per class, the first job in queue order that cannot start now is that
  class's head. It gets a reservation: the earliest time a pod of its class
  will have its GPUs, from the running jobs' estimated ends (idle warm groups
  count as free: they are evicted when needed).
- A job behind a head starts now (backfills) only if it fits now and does not
  delay the head: it runs on another pod than the head's reserved one, or it
  is expected to end by the reservation, or the reserved pod keeps enough GPUs
  for the head even with it. Jobs of other classes never wait for a head of
  another class (they do not share GPUs).
- Warm groups: a finished job's group may stay loaded (``keep``) and idle;
  it holds its GPUs. A job whose ``pool_key`` (model, layout, class) matches
  an idle group reuses it. When a job needs GPUs held by idle groups, the
  least recently used ones in the chosen pod are evicted; idle groups older
  than the TTL are evicted by ``expire``.
- Spill (load-aware): a job may carry ``fallbacks``, its plans for other
  classes in preference order (its own class is the preferred one). The rule:
  a job that cannot start now in its own class (neither at once nor as a
  backfill) starts now on the first fallback class where its layout needs no
  more offload than its preferred one (``offload_rank``), no job of that class
  is waiting, it fits a pod now (free or idle-evictable GPUs, as for any job),
  and it is expected to finish sooner: ``now + fallback est_seconds <
  reservation in its own class + its est_seconds`` (the reservation as a head
  would get it). From then on it is simply a job running in that class
  (``Admission.klass``, ``spilled=True``); otherwise it waits in its own class.
- Preemption (``preemption.plan_preemptions``, after ``schedule``): a class
  head may take the GPUs of lower-priority running jobs; ``preempted`` puts
  each victim's own Ask back in the queue, with its place and age.

What holds (the property tests check each):
- capacity: a pod never holds more than its GPUs, each job in one pod;
- priority within a class: on a class's GPUs, a job starts before an earlier
  waiting job of that class only as a backfill that keeps the head's
  reservation. A spilled job counts as a job of the class it runs in, and it
  lands only in a class with no job waiting at that moment of the pass; since
  it is then running, jobs later in the same pass already see its GPUs taken,
  and none of them is of that class anyway (the queue is walked once);
- no job waits forever: every pass starts each class head that fits now, and
  spilling only removes jobs from queues.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Fallback:
    """Another class a job could run on, with its layout there (see Spill)."""

    klass: str
    gpus: int
    est_seconds: float
    pool_key: str | None = None
    offload_rank: int = 0  # the layout's offload mode's index (higher: more offload)


@dataclass(frozen=True)
class Ask:
    """A job waiting for GPUs."""

    key: str
    klass: str
    gpus: int
    priority: int = 0
    seq: int = 0  # arrival order: first come first served within a priority
    est_seconds: float = 60.0  # the planner's estimate, for reservations and backfill
    pool_key: str | None = None  # model + layout + class: what a warm group must match
    offload_rank: int = 0  # of the layout in ``klass``: a fallback may not need more offload
    fallbacks: tuple[Fallback, ...] = ()  # other classes' plans, in preference order (see Spill)
    preemptible: bool = True  # may give way to a higher priority (preemption.py)
    restart_s: float = 60.0  # what a restart costs it (load + re-plan), for the preemption loss
    resumable: bool = True  # checkpoints when preempted: loses only restart_s (else all it ran too)

    @property
    def order(self) -> tuple:
        return (-self.priority, self.seq, self.key)


@dataclass
class Running:
    key: str
    klass: str
    pod: int
    gpus: int
    group: str | None
    pool_key: str | None
    est_end: float
    priority: int = 0
    preemptible: bool = True
    restart_s: float = 60.0
    resumable: bool = True
    started: float = 0.0
    preempting: bool = False  # chosen as a victim (preemption.py): stopping, not to be chosen again
    ask: Ask | None = None  # as it was enqueued (its own class, seq, fallbacks): what waits again if preempted


@dataclass
class IdleGroup:
    group: str
    klass: str
    pod: int
    gpus: int
    pool_key: str
    last_used: float


@dataclass(frozen=True)
class Admission:
    """Start ``key`` on ``pod`` of ``klass``; ``reuse``: the warm group it runs on
    (no weight load); ``evict``: idle groups to remove first (in this order).
    ``spilled``: ``klass`` is one of the job's fallbacks (run that class's
    layout, ``gpus`` GPUs), not the class it asked for."""

    key: str
    klass: str
    pod: int
    gpus: int
    reuse: str | None = None
    evict: tuple[str, ...] = ()
    backfilled: bool = False
    spilled: bool = False
    workload: str | None = None  # kueue mode: the Workload that admitted it


@dataclass(frozen=True)
class Reservation:
    klass: str
    pod: int
    at: float


@dataclass
class _Class:
    name: str
    gpus_per_pod: int
    max_pods: int
    used: list[int] = field(default_factory=list)  # GPUs held per pod (running + idle)

    def __post_init__(self):
        self.used = [0] * self.max_pods


class Scheduler:
    def __init__(self, classes: dict[str, tuple[int, int]], idle_ttl_s: float = 600.0):
        """``classes``: name -> (GPUs per pod, max pods)."""
        self.classes = {name: _Class(name, per_pod, pods) for name, (per_pod, pods) in classes.items()}
        for c in self.classes.values():
            if c.gpus_per_pod < 1 or c.max_pods < 1:
                raise ValueError(f"class {c.name}: GPUs per pod and max pods must be at least 1")
        self.idle_ttl_s = idle_ttl_s
        self.waiting: dict[str, Ask] = {}
        self.running: dict[str, Running] = {}
        self.idle: dict[str, IdleGroup] = {}
        self._seq = itertools.count(1)
        self.last_reservations: dict[str, Reservation] = {}

    # -- capacity views --------------------------------------------------------

    def capacity(self, klass: str | None = None) -> int:
        classes = [self.classes[klass]] if klass else self.classes.values()
        return sum(c.gpus_per_pod * c.max_pods for c in classes)

    def allocated(self, klass: str | None = None) -> int:
        """GPUs held by running jobs and idle warm groups."""
        classes = [self.classes[klass]] if klass else self.classes.values()
        return sum(sum(c.used) for c in classes)

    def idle_gpus(self, klass: str | None = None) -> int:
        return sum(g.gpus for g in self.idle.values() if klass is None or g.klass == klass)

    def next_seq(self) -> int:
        return next(self._seq)

    # -- changes ---------------------------------------------------------------

    def enqueue(self, ask: Ask) -> None:
        c = self.classes.get(ask.klass)
        if c is None:
            raise ValueError(f"{ask.key}: no GPU class {ask.klass!r}")
        if not 1 <= ask.gpus <= c.gpus_per_pod:
            raise ValueError(f"{ask.key}: {ask.gpus} GPUs never fit one {ask.klass} pod of {c.gpus_per_pod}")
        seen = {ask.klass}
        for fb in ask.fallbacks:
            f = self.classes.get(fb.klass)
            if f is None:
                raise ValueError(f"{ask.key}: fallback to no GPU class {fb.klass!r}")
            if fb.klass in seen:
                raise ValueError(f"{ask.key}: fallback class {fb.klass} is its own class or given twice")
            if not 1 <= fb.gpus <= f.gpus_per_pod:
                raise ValueError(f"{ask.key}: fallback of {fb.gpus} GPUs never fits one {fb.klass} pod "
                                 f"of {f.gpus_per_pod}")
            seen.add(fb.klass)
        if ask.restart_s < 0:
            raise ValueError(f"{ask.key}: restart_s must be at least 0, not {ask.restart_s}")
        if ask.key in self.running:
            return
        self.waiting[ask.key] = ask

    def reserve(self, key: str, klass: str, gpus: int, now: float, est_seconds: float = 60.0,
                group: str | None = None, pool_key: str | None = None, ask: Ask | None = None,
                started_ago_s: float = 0.0) -> int:
        """Record a job that already runs (found when the operator starts). Returns its pod.
        ``ask``: its Ask, for its priority and preemption fields and to wait again if
        preempted; without it the job is never chosen as a victim. ``started_ago_s``: how
        long its attempt has run (its status's startedAt): its expected end counts from its
        start, not from the operator's (a long job otherwise looks about to finish after a
        restart: never preemptible, and reservations behind it wrong)."""
        if key in self.running:
            run = self.running[key]
            if ask is not None and run.ask is None:
                # Counted at the operator's start from its status alone; its lifecycle, adopting
                # the driver, brings its Ask: from now on it is preemptible as it was before.
                run.priority, run.preemptible, run.restart_s, run.resumable, run.ask = (
                    ask.priority, ask.preemptible, ask.restart_s, ask.resumable, ask)
            return run.pod
        self.waiting.pop(key, None)
        c = self.classes[klass]
        pod = self._fit_pod(c, gpus)
        if pod is None:  # more running than the inventory says: count it on the least used pod
            pod = min(range(c.max_pods), key=lambda p: c.used[p])
        c.used[pod] += gpus
        extra = (dict(priority=ask.priority, preemptible=ask.preemptible, restart_s=ask.restart_s,
                      resumable=ask.resumable, ask=ask) if ask is not None else dict(preemptible=False))
        started = now - max(0.0, started_ago_s)
        self.running[key] = Running(key, klass, pod, gpus, group, pool_key, started + est_seconds, started=started,
                                    **extra)
        return pod

    def adopt_idle(self, group: str, klass: str, gpus: int, pool_key: str, now: float) -> bool:
        """Record an idle warm group found at start; False when no pod has room for it,
        or when a running job holds it (a job that reused the group: its GPUs are
        that job's, and it is not idle)."""
        c = self.classes.get(klass)
        if c is None or group in self.idle or any(r.group == group for r in self.running.values()):
            return False
        pod = self._fit_pod(c, gpus)
        if pod is None:
            return False
        c.used[pod] += gpus
        self.idle[group] = IdleGroup(group, klass, pod, gpus, pool_key, now)
        return True

    def attach(self, key: str, group: str) -> None:
        """Name the group a running job's attempt runs on (written before its driver
        exists): from then on the group is the job's in the books."""
        run = self.running.get(key)
        if run is not None:
            run.group = group

    def cancel(self, key: str) -> None:
        """Forget a job (deleted): its queue place or its GPUs (its group goes with it)."""
        self.waiting.pop(key, None)
        run = self.running.pop(key, None)
        if run is not None:
            self.classes[run.klass].used[run.pod] -= run.gpus

    def finish(self, key: str, now: float, keep_group: str | None = None) -> None:
        """A job ended; with ``keep_group`` its group stays loaded and idle on the same GPUs."""
        run = self.running.pop(key, None)
        self.waiting.pop(key, None)
        if run is None:
            return
        if keep_group and run.pool_key:
            self.idle[keep_group] = IdleGroup(keep_group, run.klass, run.pod, run.gpus, run.pool_key, now)
        else:
            self.classes[run.klass].used[run.pod] -= run.gpus

    def preempted(self, key: str, now: float) -> Ask:
        """A running job's driver stopped to give way (preempted, or evicted): its GPUs
        are freed as by ``finish`` (no group kept) and its original Ask waits again,
        with its seq and priority, so it keeps its place and age. Returns that Ask
        (the waiting one when told twice). ValueError: neither running nor waiting,
        or recorded by ``reserve`` without its Ask (nothing to wait again)."""
        run = self.running.get(key)
        if run is None:
            if key in self.waiting:
                return self.waiting[key]
            raise ValueError(f"{key}: neither running nor waiting, nothing to preempt")
        if run.ask is None:
            raise ValueError(f"{key}: recorded without its Ask (reserve(ask=...)), it cannot wait again")
        self.finish(key, now)
        self.waiting[key] = run.ask
        return run.ask

    def evicted(self, group: str) -> None:
        idle = self.idle.pop(group, None)
        if idle is not None:
            self.classes[idle.klass].used[idle.pod] -= idle.gpus

    def expire(self, now: float) -> list[str]:
        """Idle groups past the TTL, removed from the books (the caller tears them down)."""
        old = [g.group for g in self.idle.values() if now - g.last_used >= self.idle_ttl_s]
        for group in old:
            self.evicted(group)
        return old

    # -- decisions -------------------------------------------------------------

    def _fit_pod(self, c: _Class, gpus: int) -> int | None:
        """Best fit: the pod with the least room left that still holds ``gpus``."""
        fitting = [p for p in range(c.max_pods) if c.gpus_per_pod - c.used[p] >= gpus]
        return min(fitting, key=lambda p: (c.gpus_per_pod - c.used[p], p)) if fitting else None

    def _place(self, ask: Ask, avoid_pod: int | None = None) -> tuple[int, tuple[str, ...], str | None] | None:
        """(pod, groups to evict, warm group to reuse) to start ``ask`` now, or None."""
        c = self.classes[ask.klass]
        warm = [g for g in self.idle.values() if g.pool_key == ask.pool_key and ask.pool_key is not None
                and g.klass == ask.klass and g.gpus == ask.gpus and g.pod != avoid_pod]
        if warm:
            best = max(warm, key=lambda g: g.last_used)
            return best.pod, (), best.group
        free_pods = [p for p in range(c.max_pods) if p != avoid_pod and c.gpus_per_pod - c.used[p] >= ask.gpus]
        if free_pods:
            pod = min(free_pods, key=lambda p: (c.gpus_per_pod - c.used[p], p))
            return pod, (), None
        options = []
        for pod in range(c.max_pods):
            if pod == avoid_pod:
                continue
            idle = sorted((g for g in self.idle.values() if g.klass == ask.klass and g.pod == pod),
                          key=lambda g: g.last_used)
            free, chosen = c.gpus_per_pod - c.used[pod], []
            for g in idle:
                if free >= ask.gpus:
                    break
                chosen.append(g)
                free += g.gpus
            if free >= ask.gpus:
                newest = max(g.last_used for g in chosen) if chosen else float("-inf")
                options.append((newest, len(chosen), pod, tuple(g.group for g in chosen)))
        if not options:
            return None
        _, _, pod, evict = min(options)
        return pod, evict, None

    def _reservation(self, ask: Ask, now: float) -> Reservation:
        """When and where the head ``ask`` is expected to start: the earliest a pod
        of its class has ``ask.gpus`` free, as running jobs end (idle groups count as free)."""
        c = self.classes[ask.klass]
        best: Reservation | None = None
        for pod in range(c.max_pods):
            free = c.gpus_per_pod - c.used[pod] + sum(g.gpus for g in self.idle.values()
                                                       if g.klass == ask.klass and g.pod == pod)
            at = now
            if free < ask.gpus:
                ends = sorted((max(r.est_end, now), r.gpus) for r in self.running.values()
                              if r.klass == ask.klass and r.pod == pod)
                for end, gpus in ends:
                    free += gpus
                    at = end
                    if free >= ask.gpus:
                        break
            if free >= ask.gpus and (best is None or at < best.at):
                best = Reservation(ask.klass, pod, at)
        if best is None:  # enqueue refuses jobs larger than a pod, so this is a bug
            raise RuntimeError(f"{ask.key}: no pod of {ask.klass} can ever hold {ask.gpus} GPUs")
        return best

    def _start(self, ask: Ask, pod: int, evict: tuple[str, ...], reuse: str | None, now: float,
               backfilled: bool, spilled: bool = False) -> Admission:
        c = self.classes[ask.klass]
        for group in evict:
            self.evicted(group)
        if reuse is not None:
            idle = self.idle.pop(reuse)
            c.used[idle.pod] -= idle.gpus
        c.used[pod] += ask.gpus
        original = self.waiting.pop(ask.key)  # a spilled ``ask`` is the fallback's; this is its own
        self.running[ask.key] = Running(ask.key, ask.klass, pod, ask.gpus, reuse, ask.pool_key,
                                        now + ask.est_seconds, ask.priority, ask.preemptible, ask.restart_s,
                                        ask.resumable, now, ask=original)
        return Admission(ask.key, ask.klass, pod, ask.gpus, reuse, evict, backfilled, spilled)

    def schedule(self, now: float) -> list[Admission]:
        """Start what may start now, in queue order; returns the admissions made."""
        admitted: list[Admission] = []
        heads: dict[str, tuple[Ask, Reservation]] = {}
        waiting = Counter(a.klass for a in self.waiting.values())  # per class, at this point of the pass

        def start(ask: Ask, placed: tuple, backfilled: bool = False, spilled: bool = False) -> None:
            waiting[self.waiting[ask.key].klass] -= 1
            admitted.append(self._start(ask, *placed, now=now, backfilled=backfilled, spilled=spilled))

        for ask in sorted(self.waiting.values(), key=lambda a: a.order):
            head = heads.get(ask.klass)
            placed = self._place(ask)
            if head is None:
                if placed is not None:
                    start(ask, placed)
                    continue
            elif placed is not None:
                head_ask, reserved = head
                ends_in_time = now + ask.est_seconds <= reserved.at
                if placed[0] != reserved.pod or ends_in_time or self._leaves_room(reserved, head_ask, ask, placed):
                    start(ask, placed, backfilled=True)
                    continue
                other = self._place(ask, avoid_pod=reserved.pod)
                if other is not None:
                    start(ask, other, backfilled=True)
                    continue
            spill = self._spill(ask, now, waiting)
            if spill is not None:
                start(*spill, spilled=True)
            elif head is None:
                heads[ask.klass] = (ask, self._reservation(ask, now))
        self.last_reservations = {k: r for k, (_, r) in heads.items()}
        return admitted

    def _spill(self, ask: Ask, now: float, waiting: Counter) -> tuple[Ask, tuple] | None:
        """(the job as it runs on the first fallback class the Spill rule allows now,
        ``_place``'s answer there), or None. ``waiting``: jobs still waiting per
        class at this point of the pass."""
        at = None
        for fb in ask.fallbacks:
            if fb.offload_rank > ask.offload_rank or waiting[fb.klass] > 0:
                continue
            moved = replace(ask, klass=fb.klass, gpus=fb.gpus, est_seconds=fb.est_seconds, pool_key=fb.pool_key,
                            offload_rank=fb.offload_rank, fallbacks=())
            placed = self._place(moved)
            if placed is None:
                continue
            if at is None:
                at = self._reservation(ask, now).at
            if now + fb.est_seconds < at + ask.est_seconds:
                return moved, placed
        return None

    def _leaves_room(self, reserved: Reservation, head: Ask, ask: Ask,
                     placed: tuple[int, tuple[str, ...], str | None]) -> bool:  # noqa: ARG002
        """Whether the reserved pod still has the head's GPUs at the reservation
        with ``ask`` running there until its estimated end."""
        c = self.classes[head.klass]
        pod = reserved.pod
        free = c.gpus_per_pod - c.used[pod] + sum(g.gpus for g in self.idle.values()
                                                   if g.klass == head.klass and g.pod == pod)
        free += sum(r.gpus for r in self.running.values()
                    if r.klass == head.klass and r.pod == pod and max(r.est_end, 0) <= reserved.at)
        # Whether it runs on fresh GPUs, a reused warm group's or evicted ones,
        # all of which were counted free above, it holds ``ask.gpus`` at the reservation.
        return free - ask.gpus >= head.gpus

    # -- what a waiting job sees -----------------------------------------------

    def places(self) -> dict[str, int]:
        """Every waiting job's 1-based place in its class's queue (one sort for all)."""
        out: dict[str, int] = {}
        counts: dict[str, int] = {}
        for ask in sorted(self.waiting.values(), key=lambda a: a.order):
            counts[ask.klass] = counts.get(ask.klass, 0) + 1
            out[ask.key] = counts[ask.klass]
        return out

    def position(self, key: str, now: float, place: int | None = None) -> tuple[int, str]:
        """(1-based place in its class's queue, what it waits for); (0, '') when not waiting.
        ``place``: from ``places()`` when the caller has it (saves a sort per job)."""
        ask = self.waiting.get(key)
        if ask is None:
            return 0, ""
        if place is None:
            same = sorted((a for a in self.waiting.values() if a.klass == ask.klass), key=lambda a: a.order)
            place = next(i for i, a in enumerate(same) if a.key == key) + 1
        c = self.classes[ask.klass]
        free = max(c.gpus_per_pod - u for u in c.used) if c.used else 0
        if place > 1:
            why = f"{place - 1} job(s) ahead for class {ask.klass}; then {ask.gpus} GPU(s) in one {ask.klass} pod"
        else:
            why = f"{ask.gpus} GPU(s) in one {ask.klass} pod (most free in a pod now: {free})"
        reserved = self.last_reservations.get(ask.klass)
        if place == 1 and reserved is not None and reserved.at > now:
            why += f", expected in ~{reserved.at - now:.0f} s"
        return place, why


__all__ = ["Admission", "Ask", "Fallback", "IdleGroup", "Reservation", "Running", "Scheduler"]
