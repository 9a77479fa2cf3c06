"""Priority preemption: which running jobs give way to a class head (pure, like the scheduler).

Call ``plan_preemptions(scheduler, now)`` after ``scheduler.schedule(now)``.
Per class, the first waiting job in queue order is the head; when it cannot
be placed now, running jobs of its class may be stopped for it:

- victims: running in the head's class, ``preemptible``, of strictly lower
  priority, not already ``preempting``, and not about to finish (more than
  ``max(ABOUT_TO_FINISH_S, ABOUT_TO_FINISH_SHARE * planned seconds)`` left);
- all victims of one head lie in ONE pod, whose free GPUs, idle warm groups
  and victims together hold the head;
- the choice: the fewest GPU-seconds lost, then the fewest victims, then the
  lowest pod index. A victim loses ``gpus * restart_s`` when ``resumable``
  (it checkpoints as it stops), else ``gpus * (seconds it ran + restart_s)``.

Chosen victims are marked ``preempting`` and their ``est_end`` becomes
``now``: no later pass picks them again, the head's reservation points at
their pod (so backfill keeps their GPUs for it), and a head whose class
already has victims in flight that will make room for it preempts nothing
more. The caller stops each victim (it checkpoints at its next step
boundary) and then calls ``scheduler.preempted(key, now)``; a victim that
ends on its own first goes through ``finish`` as usual.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from .scheduler import Ask, Running, Scheduler

ABOUT_TO_FINISH_S = 30.0  # a job with no more than this left is never a victim...
ABOUT_TO_FINISH_SHARE = 0.10  # ...nor one with no more than this share of its planned seconds left
EXACT_MAX_CANDIDATES = 12  # per pod: search every victim set up to this many candidates, else greedy


@dataclass(frozen=True)
class Preemption:
    """Stop ``victim`` (``gpus`` GPUs on ``pod`` of ``klass``) so ``for_key`` can start."""

    victim: str
    for_key: str
    klass: str
    pod: int
    gpus: int
    lost_gpu_seconds: float


def lost_gpu_seconds(run: Running, now: float) -> float:
    """What stopping ``run`` now costs: its restart, plus all it ran when it cannot resume."""
    seconds = run.restart_s if run.resumable else max(now - run.started, 0.0) + run.restart_s
    return run.gpus * seconds


def about_to_finish(run: Running, now: float) -> bool:
    planned = max(run.est_end - run.started, 0.0)
    return run.est_end - now <= max(ABOUT_TO_FINISH_S, ABOUT_TO_FINISH_SHARE * planned)


def may_preempt(run: Running, head: Ask, now: float) -> bool:
    """Whether ``run`` may give way to ``head`` (the rules in the module docstring)."""
    return (run.klass == head.klass and run.preemptible and not run.preempting
            and run.priority < head.priority and not about_to_finish(run, now))


def _cheapest(candidates: list[tuple[float, str, int]], need: int) -> tuple[float, int, tuple[str, ...]] | None:
    """(loss, count, keys) of the victim set freeing at least ``need`` GPUs with the
    least loss, then the fewest victims; None when all of them are not enough.
    ``candidates``: (loss, key, gpus). Exact up to ``EXACT_MAX_CANDIDATES`` (a pod
    holds at most one job per GPU, so in practice always); beyond, greedy by loss,
    then the victims not needed dropped, most expensive first."""
    if sum(g for _, _, g in candidates) < need:
        return None
    if len(candidates) <= EXACT_MAX_CANDIDATES:
        best = None
        for n in range(1, len(candidates) + 1):
            for combo in itertools.combinations(candidates, n):
                if sum(g for _, _, g in combo) >= need:
                    option = (sum(loss for loss, _, _ in combo), n, tuple(sorted(k for _, k, _ in combo)))
                    best = option if best is None or option < best else best
        return best
    chosen: list[tuple[float, str, int]] = []
    for cand in sorted(candidates):
        if sum(g for _, _, g in chosen) >= need:
            break
        chosen.append(cand)
    for cand in sorted(chosen, reverse=True):
        if sum(g for _, _, g in chosen) - cand[2] >= need:
            chosen.remove(cand)
    return sum(loss for loss, _, _ in chosen), len(chosen), tuple(sorted(k for _, k, _ in chosen))


def plan_preemptions(scheduler: Scheduler, now: float) -> list[Preemption]:
    """The preemptions to make now (victims marked ``preempting``), per class head in
    queue order. A class whose first waiting job can be placed now preempts nothing
    (``schedule`` starts it; call this after it)."""
    heads: dict[str, Ask] = {}
    for ask in sorted(scheduler.waiting.values(), key=lambda a: a.order):
        heads.setdefault(ask.klass, ask)
    out: list[Preemption] = []
    for head in heads.values():
        if scheduler._place(head) is not None:
            continue
        c = scheduler.classes[head.klass]
        if c.gpus_per_pod < head.gpus:
            continue
        in_class = [r for r in scheduler.running.values() if r.klass == head.klass]
        room = [c.gpus_per_pod - c.used[pod] + sum(g.gpus for g in scheduler.idle.values()
                                                   if g.klass == head.klass and g.pod == pod)
                for pod in range(c.max_pods)]
        in_flight = [sum(r.gpus for r in in_class if r.pod == pod and r.preempting) for pod in range(c.max_pods)]
        if any(f > 0 and room[p] + f >= head.gpus for p, f in enumerate(in_flight)):
            continue  # victims already stopping make room for it: do not preempt twice for one need
        best: tuple[float, int, int, tuple[str, ...]] | None = None
        for pod in range(c.max_pods):
            candidates = [(lost_gpu_seconds(r, now), r.key, r.gpus) for r in in_class
                          if r.pod == pod and may_preempt(r, head, now)]
            need = head.gpus - room[pod] - in_flight[pod]
            found = _cheapest(candidates, need) if need > 0 else None
            if found is not None and (best is None or (found[0], found[1], pod) < best[:3]):
                best = (found[0], found[1], pod, found[2])
        if best is None:
            continue
        for key in best[3]:
            run = scheduler.running[key]
            run.preempting, run.est_end = True, min(run.est_end, now)
            out.append(Preemption(key, head.key, head.klass, run.pod, run.gpus, lost_gpu_seconds(run, now)))
    return out


__all__ = ["ABOUT_TO_FINISH_S", "ABOUT_TO_FINISH_SHARE", "Preemption", "about_to_finish", "lost_gpu_seconds",
           "may_preempt", "plan_preemptions"]
