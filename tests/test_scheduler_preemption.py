"""Priority preemption over the pure scheduler (``videojob.scheduling.preemption``).

Examples for each rule (who may be a victim, which victims and pod lose the
fewest GPU-seconds, no double preemption, the victim's place and age kept),
and a property test against a brute-force oracle over random fleets.
"""

from __future__ import annotations

import copy
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from videojob.scheduling import Ask, Fallback, Preemption, Scheduler, plan_preemptions
from videojob.scheduling.preemption import ABOUT_TO_FINISH_S, ABOUT_TO_FINISH_SHARE


def fill(s: Scheduler, now: float, *asks: Ask) -> None:
    for ask in asks:
        s.enqueue(ask)
    started = {a.key for a in s.schedule(now)}
    assert started == {a.key for a in asks}, f"expected all to start, started {started}"


def books_agree(s: Scheduler) -> None:
    for name, c in s.classes.items():
        for pod in range(c.max_pods):
            held = sum(r.gpus for r in s.running.values() if r.klass == name and r.pod == pod)
            held += sum(g.gpus for g in s.idle.values() if g.klass == name and g.pod == pod)
            assert c.used[pod] == held <= c.gpus_per_pod, (name, pod, c.used[pod], held)
    assert not set(s.running) & set(s.waiting)


def test_a_head_preempts_the_cheapest_lower_priority_job():
    s = Scheduler({"a": (4, 1)})
    fill(s, 0.0, Ask("slow", "a", 2, seq=1, est_seconds=1000.0, restart_s=60.0),
         Ask("quick", "a", 2, seq=2, est_seconds=1000.0, restart_s=10.0))
    s.enqueue(Ask("urgent", "a", 2, priority=5, seq=3))
    assert s.schedule(100.0) == []
    assert plan_preemptions(s, 100.0) == [Preemption("quick", "urgent", "a", 0, 2, 20.0)]
    assert s.running["quick"].preempting and not s.running["slow"].preempting
    # Its GPUs are the head's from now: the reservation is at once, on its pod.
    assert s.running["quick"].est_end == 100.0
    s.schedule(101.0)
    assert (s.last_reservations["a"].pod, s.last_reservations["a"].at) == (0, 101.0)


def test_never_a_job_of_equal_or_higher_priority():
    s = Scheduler({"a": (2, 2)})
    fill(s, 0.0, Ask("mid", "a", 2, priority=5, seq=1, est_seconds=1000.0),
         Ask("top", "a", 2, priority=7, seq=2, est_seconds=1000.0))
    s.enqueue(Ask("same", "a", 2, priority=5, seq=3))
    s.schedule(10.0)
    assert plan_preemptions(s, 10.0) == []
    s.cancel("same")
    s.enqueue(Ask("above", "a", 2, priority=6, seq=4))
    s.schedule(10.0)
    assert [(p.victim, p.for_key) for p in plan_preemptions(s, 10.0)] == [("mid", "above")]
    assert not s.running["top"].preempting


def test_never_a_job_that_is_not_preemptible():
    s = Scheduler({"a": (2, 2)})
    fill(s, 0.0, Ask("pinned", "a", 2, seq=1, est_seconds=1000.0, restart_s=1.0, preemptible=False),
         Ask("costly", "a", 2, seq=2, est_seconds=1000.0, restart_s=500.0))
    s.enqueue(Ask("urgent", "a", 2, priority=1, seq=3))
    s.schedule(10.0)
    # "pinned" would lose far less, but it may not be preempted.
    assert [p.victim for p in plan_preemptions(s, 10.0)] == ["costly"]
    t = Scheduler({"a": (2, 1)})
    fill(t, 0.0, Ask("pinned", "a", 2, seq=1, est_seconds=1000.0, preemptible=False))
    t.enqueue(Ask("urgent", "a", 2, priority=1, seq=2))
    t.schedule(10.0)
    assert plan_preemptions(t, 10.0) == [] and not t.running["pinned"].preempting


@pytest.mark.parametrize("est, now, victim", [
    (1000.0, 899.0, True),   # 101 s left, more than 10% of 1000
    (1000.0, 900.0, False),  # 100 s left: 10% of its planned seconds, about to finish
    (100.0, 69.0, True),     # 31 s left, more than the 30 s floor (10% would be 10 s)
    (100.0, 70.0, False),    # 30 s left
    (100.0, 150.0, False),   # past its estimate: it should end any moment
])
def test_never_a_job_about_to_finish(est, now, victim):
    assert (ABOUT_TO_FINISH_S, ABOUT_TO_FINISH_SHARE) == (30.0, 0.10)
    s = Scheduler({"a": (2, 1)})
    fill(s, 0.0, Ask("low", "a", 2, seq=1, est_seconds=est))
    s.enqueue(Ask("urgent", "a", 2, priority=1, seq=2))
    s.schedule(now)
    assert [p.victim for p in plan_preemptions(s, now)] == (["low"] if victim else [])


def _two_pods(now: float) -> Scheduler:
    """Pod 0: a resumable 2-GPU job and a non-resumable one (started at 0); pod 1: a
    resumable 4-GPU job. A 4-GPU head needs a whole pod."""
    s = Scheduler({"a": (4, 2)})
    fill(s, 0.0, Ask("r0", "a", 2, seq=1, est_seconds=5000.0, restart_s=60.0),
         Ask("n0", "a", 2, seq=2, est_seconds=5000.0, restart_s=10.0, resumable=False),
         Ask("r1", "a", 4, seq=3, est_seconds=5000.0, restart_s=60.0))
    assert (s.running["r0"].pod, s.running["n0"].pod, s.running["r1"].pod) == (0, 0, 1)
    s.enqueue(Ask("head", "a", 4, priority=1, seq=4))
    assert s.schedule(now) == []
    return s


def test_picks_the_pod_that_loses_the_fewest_gpu_seconds():
    # Early, the non-resumable job has run little: pod 0 loses 2*60 + 2*(10+10) = 160 < 4*60.
    s = _two_pods(10.0)
    assert {(p.victim, p.pod, p.lost_gpu_seconds) for p in plan_preemptions(s, 10.0)} == {
        ("r0", 0, 120.0), ("n0", 0, 40.0)}
    # Later it would lose all it ran: 120 + 2*(100+10) = 340 > 240, pod 1 it is.
    s = _two_pods(100.0)
    assert [(p.victim, p.pod, p.lost_gpu_seconds) for p in plan_preemptions(s, 100.0)] == [("r1", 1, 240.0)]
    assert not s.running["n0"].preempting and not s.running["r0"].preempting


def test_picks_the_cheapest_victim_set_not_the_cheapest_victims_one_by_one():
    s = Scheduler({"a": (4, 1)})
    fill(s, 0.0, Ask("one", "a", 1, seq=1, est_seconds=1000.0, restart_s=10.0),
         Ask("two", "a", 1, seq=2, est_seconds=1000.0, restart_s=10.0),
         Ask("pair", "a", 2, seq=3, est_seconds=1000.0, restart_s=8.0))
    s.enqueue(Ask("head", "a", 2, priority=1, seq=4))
    s.schedule(10.0)
    # Greedy by loss takes one + two (20 GPU-seconds); "pair" alone loses 16.
    assert [(p.victim, p.lost_gpu_seconds) for p in plan_preemptions(s, 10.0)] == [("pair", 16.0)]


def test_equal_loss_prefers_fewer_victims_then_the_lower_pod():
    s = Scheduler({"a": (2, 3)})
    fill(s, 0.0, Ask("x", "a", 1, seq=1, est_seconds=1000.0, restart_s=20.0),
         Ask("y", "a", 1, seq=2, est_seconds=1000.0, restart_s=20.0),  # pod 0: two victims, 80
         Ask("p1", "a", 2, seq=3, est_seconds=1000.0, restart_s=20.0),  # pod 1: one victim, 80
         Ask("p2", "a", 2, seq=4, est_seconds=1000.0, restart_s=20.0))  # pod 2: the same as pod 1
    assert (s.running["x"].pod, s.running["y"].pod, s.running["p1"].pod, s.running["p2"].pod) == (0, 0, 1, 2)
    s.enqueue(Ask("head", "a", 2, priority=1, seq=5))
    s.schedule(10.0)
    assert [(p.victim, p.pod) for p in plan_preemptions(s, 10.0)] == [("p1", 1)]


def test_free_and_idle_gpus_of_the_pod_count_and_no_double_preemption():
    s = Scheduler({"a": (4, 2)})
    fill(s, 0.0, Ask("low", "a", 2, seq=1, est_seconds=1000.0),
         Ask("warm", "a", 1, seq=2, est_seconds=1000.0, pool_key="p"),
         Ask("high", "a", 4, priority=5, seq=3, est_seconds=500.0))  # the head's priority: never its victim
    assert (s.running["high"].pod, s.running["low"].pod, s.running["warm"].pod) == (0, 1, 1)
    s.finish("warm", 5.0, keep_group="g-warm")  # pod 1: 1 free, 1 idle, 2 held by "low"
    s.enqueue(Ask("head", "a", 4, priority=5, seq=4))
    assert s.schedule(10.0) == []
    assert [(p.victim, p.pod) for p in plan_preemptions(s, 10.0)] == [("low", 1)]
    # Later passes, while "low" stops: nothing more is preempted, and "small", which
    # fits pod 1's free + idle GPUs, does not take them from the head: they are
    # reserved for it at once (else it would backfill there, and be preempted in turn).
    s.enqueue(Ask("small", "a", 2, seq=5, est_seconds=2000.0))
    for now in (11.0, 20.0, 60.0):
        assert s.schedule(now) == [] and plan_preemptions(s, now) == []
    # A new head of the class that the same victim makes room for preempts nothing either
    # (it could take "high" on pod 0).
    s.enqueue(Ask("higher", "a", 3, priority=6, seq=6))
    s.schedule(61.0)
    assert plan_preemptions(s, 61.0) == []
    assert [r.key for r in s.running.values() if r.preempting] == ["low"]
    books_agree(s)


def test_a_preempted_job_waits_again_with_its_place_and_age_and_the_head_starts():
    s = Scheduler({"a": (4, 1)})
    original = Ask("victim", "a", 4, seq=s.next_seq(), est_seconds=1000.0)
    fill(s, 0.0, original)
    s.enqueue(Ask("later", "a", 4, seq=s.next_seq(), est_seconds=10.0))  # same priority, arrived after
    s.enqueue(Ask("urgent", "a", 4, priority=3, seq=s.next_seq(), est_seconds=100.0))
    s.schedule(50.0)
    assert [p.victim for p in plan_preemptions(s, 50.0)] == ["victim"]
    assert s.preempted("victim", 60.0) is original
    assert s.preempted("victim", 61.0) is original  # told twice: the same answer, no change
    books_agree(s)
    assert [(a.key, a.pod) for a in s.schedule(62.0)] == [("urgent", 0)]
    assert s.places() == {"victim": 1, "later": 2}
    assert s.waiting["victim"].seq < s.waiting["later"].seq and s.allocated("a") == 4
    s.finish("urgent", 162.0)
    assert [a.key for a in s.schedule(162.0)] == ["victim"]
    run = s.running["victim"]
    assert not run.preempting and run.started == 162.0 and run.est_end == 1162.0


def test_a_spilled_victim_waits_again_in_its_own_class():
    s = Scheduler({"small": (1, 1), "big": (4, 1)})
    fill(s, 0.0, Ask("blocker", "small", 1, seq=1, est_seconds=5000.0, priority=9))
    spiller = Ask("spilled", "small", 1, seq=2, est_seconds=3000.0, fallbacks=(Fallback("big", 4, 1000.0),))
    fill(s, 1.0, spiller)
    assert (s.running["spilled"].klass, s.running["spilled"].ask) == ("big", spiller)
    s.enqueue(Ask("urgent", "big", 4, priority=1, seq=3))
    s.schedule(10.0)
    assert [(p.victim, p.klass, p.gpus) for p in plan_preemptions(s, 10.0)] == [("spilled", "big", 4)]
    assert s.preempted("spilled", 20.0) is spiller and s.waiting["spilled"].klass == "small"
    assert [a.key for a in s.schedule(20.0)] == ["urgent"]
    books_agree(s)


def test_a_victim_that_finishes_on_its_own_is_fine():
    s = Scheduler({"a": (4, 1)})
    fill(s, 0.0, Ask("victim", "a", 4, seq=1, est_seconds=1000.0))
    s.enqueue(Ask("urgent", "a", 4, priority=1, seq=2))
    s.schedule(10.0)
    assert [p.victim for p in plan_preemptions(s, 10.0)] == ["victim"]
    s.finish("victim", 12.0)  # it ended before its driver saw the stop
    books_agree(s)
    assert [a.key for a in s.schedule(12.0)] == ["urgent"] and "victim" not in s.waiting
    with pytest.raises(ValueError, match="victim: neither running nor waiting"):
        s.preempted("victim", 13.0)


def test_reserved_jobs_carry_their_ask_or_are_never_victims():
    s = Scheduler({"a": (2, 2)})
    known = Ask("known", "a", 2, priority=2, seq=7, restart_s=5.0, resumable=False)
    s.reserve("known", "a", 2, 0.0, est_seconds=1000.0, ask=known)
    s.reserve("unknown", "a", 2, 0.0, est_seconds=1000.0)
    run = s.running["known"]
    assert (run.priority, run.restart_s, run.resumable, run.started, run.ask) == (2, 5.0, False, 0.0, known)
    assert not s.running["unknown"].preemptible
    s.enqueue(Ask("urgent", "a", 2, priority=3, seq=8))
    s.schedule(10.0)
    assert [(p.victim, p.lost_gpu_seconds) for p in plan_preemptions(s, 10.0)] == [("known", 30.0)]
    with pytest.raises(ValueError, match="without its Ask"):
        s.preempted("unknown", 11.0)
    assert "unknown" in s.running and s.allocated("a") == 4
    with pytest.raises(ValueError, match="restart_s must be at least 0"):
        s.enqueue(Ask("bad", "a", 1, restart_s=-1.0))


# -- property: the plan against a brute-force oracle ------------------------------

job = st.tuples(st.integers(1, 4), st.integers(0, 3), st.sampled_from([50.0, 400.0, 3000.0]),
                st.sampled_from([0.0, 10.0, 60.0]), st.booleans(), st.booleans(), st.floats(0.0, 100.0))


@settings(max_examples=150, deadline=None)
@given(pods=st.integers(1, 3), jobs=st.lists(job, min_size=1, max_size=10),
       head_gpus=st.integers(1, 4), head_priority=st.integers(0, 4), now=st.floats(100.0, 500.0))
def test_the_plan_is_allowed_cheapest_and_lets_the_head_start(pods, jobs, head_gpus, head_priority, now):
    s = Scheduler({"a": (4, pods)})
    for i, (gpus, prio, est, restart, resumable, preemptible, at) in enumerate(sorted(jobs, key=lambda j: j[-1])):
        s.enqueue(Ask(f"j{i}", "a", gpus, priority=prio, seq=s.next_seq(), est_seconds=est, restart_s=restart,
                      resumable=resumable, preemptible=preemptible))
        s.schedule(at)
    s.enqueue(Ask("head", "a", head_gpus, priority=head_priority, seq=s.next_seq(), est_seconds=60.0))
    s.schedule(now)
    if not s.waiting:
        return
    head = min(s.waiting.values(), key=lambda a: a.order)
    before = copy.deepcopy(s.running)
    plans = plan_preemptions(s, now)

    def loss(r):
        return r.gpus * (r.restart_s if r.resumable else now - r.started + r.restart_s)

    def room(pod):
        return 4 - s.classes["a"].used[pod] + sum(g.gpus for g in s.idle.values() if g.pod == pod)

    options = []  # the oracle: every allowed victim set of every pod that makes room
    for pod in range(pods):
        allowed = [r for r in before.values() if r.pod == pod and r.preemptible and r.priority < head.priority
                   and r.est_end - now > max(30.0, 0.1 * (r.est_end - r.started))]
        for n in range(1, len(allowed) + 1):
            for combo in itertools.combinations(allowed, n):
                if room(pod) + sum(r.gpus for r in combo) >= head.gpus:
                    options.append((sum(loss(r) for r in combo), n, pod))
    if not options:
        assert plans == []
        return
    assert {p.for_key for p in plans} == {head.key} and len({p.pod for p in plans}) == 1
    best = min(options)
    assert sum(p.lost_gpu_seconds for p in plans) == pytest.approx(best[0])
    assert (len(plans), plans[0].pod) == best[1:]
    assert plan_preemptions(s, now) == [] and plan_preemptions(s, now + 1.0) == []
    for p in plans:
        s.preempted(p.victim, now + 1.0)
    books_agree(s)
    assert all(s.waiting[p.victim] == before[p.victim].ask for p in plans)  # (before: deep copies)
    assert head.key in {a.key for a in s.schedule(now + 1.0)}
