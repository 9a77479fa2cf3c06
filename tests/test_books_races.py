"""The books against races between a job's thread and its deletion, a preemption, a restart
(issue 36), with the real lifecycles and ``Admissions`` over an API server and a Ray in this
process (tests/memory_operator.py): each story stops a thread at the line where the race
happens, so it runs in milliseconds and the same way every time."""
from __future__ import annotations

import functools
import threading

import pytest

from helpers import wait_for

from memory_operator import ManualClock, StartingRay, memory_controller
from operator_inprocess import one_rank

ONE_CPU = [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 1}]


def _job(jobs, name: str) -> tuple[str, str]:
    doc = one_rank(name)
    doc["metadata"]["namespace"] = "ns"
    obj = jobs.create(doc)
    return obj["metadata"]["name"], obj["metadata"]["uid"]


@pytest.mark.parametrize("park", [True, False], ids=["parked", "polling"])
def test_a_job_deleted_while_its_thread_asks_for_gpus_is_not_queued_again(tmp_path, park):
    """Issue 36, 1: the finalizer sets `deleting` and cancels the job's place; a thread that was
    already on its way to `request()` enqueued it again and parked, the next pass granted it,
    and its GPUs were held by nothing until a restart (parked); or it was granted at once and
    went on to submit a driver for a deleted job (polling)."""
    controller, jobs, ray = memory_controller(tmp_path, ONE_CPU)
    name, uid = _job(jobs, "ghost")
    lifecycle = controller.lifecycle("ns", name, uid)
    admissions = controller.admissions
    request = admissions.request

    def deleted_first(ask, pass_now=True):  # the finalizer runs just before the thread's request
        controller.delete("ns", name, uid, {})
        return request(ask, pass_now)

    admissions.request = deleted_first
    parked = lifecycle.run(threading.Event(), park=park)
    admissions.request = request
    admissions.tick()  # the admission loop's next pass
    assert not parked, "a deleted job parked in the queue"
    assert admissions.holders() == {}, f"a deleted job is in the books: {admissions.holders()}"
    assert ray.submitted == 0, "a driver was submitted for a deleted job"


# The books' stories move in milliseconds: looked at every 20 ms, for 10 s at most.
_wait_for = functools.partial(wait_for, timeout=10.0, interval=0.02)


class _Threads:
    """Job lifecycles on threads, as the job runner runs them; stopped at the end of the test."""

    def __init__(self, controller):
        self.controller, self.threads = controller, []

    def run(self, name: str, uid: str) -> None:
        stopped = threading.Event()
        lifecycle = self.controller.lifecycle("ns", name, uid)
        thread = threading.Thread(target=lifecycle.run, args=(stopped,), name=f"job-{name}", daemon=True)
        thread.start()
        self.threads.append((thread, stopped))

    def stop(self) -> None:
        for _, stopped in self.threads:
            stopped.set()
        for thread, _ in self.threads:
            thread.join(timeout=10)
        assert not any(t.is_alive() for t, _ in self.threads), "a job thread did not stop"


def _priority(doc: dict, priority: int) -> dict:
    doc["spec"]["resources"] = {**doc["spec"].get("resources", {}), "priority": priority}
    return doc


def test_a_preemption_that_finds_its_victim_still_starting_is_sent_again(tmp_path):
    """Issue 36, 2: the preempt driver of a victim whose group is not up yet answers GroupNotFound;
    it was never read, the victim stayed "preempting" and ran to its end while the job it was
    chosen for waited (with every other preemption of its class). Now it is sent again until
    one asks the ranks, and the victim ends Preempted."""
    ray, clock = StartingRay(), ManualClock()
    controller, jobs, _ = memory_controller(tmp_path, ONE_CPU, ray=ray)
    controller.admissions.clock = clock
    threads = _Threads(controller)
    try:
        group = _low_running(tmp_path, controller, jobs, clock, threads)
        high = jobs.create({**_priority(one_rank("high"), 10), "metadata": {"name": "high", "namespace": "ns"}})
        threads.run("high", high["metadata"]["uid"])
        _wait_for("a preempt driver for the low job", lambda: ray.preempts)
        assert ray.preempts[0][1:] == (group, False), "the first preempt driver should find no group"
        ray.up(group)  # the victim's group is ready now
        _wait_for("the low job preempted", lambda: [a.get("result") for a in
                                                     jobs.get("ns", "low")["status"]["attempts"]] == ["Preempted"])
        _wait_for("the high job running", lambda: controller.admissions.holders().get("ns/high") == "running")
        assert [found for _, _, found in ray.preempts][-1] is True
    finally:
        threads.stop()


def _low_running(tmp_path, controller, jobs, clock, threads) -> str:
    """`low` (priority 0) running on the only GPU, past step 1 after 100 s; its group's name."""
    low = jobs.create({**_priority(one_rank("low"), 0), "metadata": {"name": "low", "namespace": "ns"}})
    threads.run("low", low["metadata"]["uid"])
    group = _wait_for("the low job's attempt", lambda: (jobs.get("ns", "low").get("status", {}).get("attempts")
                                                       or [{}])[-1].get("group"))
    clock.advance(100)  # step 1 took 100 s: far from its end, so a victim (not about to finish)
    running = controller.admissions.scheduler.running
    _wait_for("the low job's expected end to follow its progress", lambda: running["ns/low"].est_end > clock.now + 60)
    return group


def test_a_running_job_adopted_after_a_restart_can_still_be_preempted(tmp_path):
    """Issue 36, 3: the restarted operator's books count a running job from its status (no Ask:
    never a victim); its lifecycle, adopting the driver, brought the Ask, which `reserve`
    ignored for a key already running. A job of higher priority waited for its whole run."""
    ray, clock = StartingRay(), ManualClock()
    first, jobs, _ = memory_controller(tmp_path, ONE_CPU, ray=ray)
    first.admissions.clock = clock
    threads = _Threads(first)
    group = _low_running(tmp_path, first, jobs, clock, threads)
    threads.stop()  # the operator goes away; the driver runs on
    second, _, _ = memory_controller(tmp_path, ONE_CPU, ray=ray, jobs=jobs)
    second.admissions.clock = clock
    second.rebuild()
    assert second.admissions.holders() == {"ns/low": "running"}
    threads = _Threads(second)
    try:
        threads.run("low", jobs.get("ns", "low")["metadata"]["uid"])
        clock.advance(100)
        running = second.admissions.scheduler.running
        _wait_for("the adopted job's expected end to follow its progress",
                  lambda: running["ns/low"].est_end > clock.now + 60)
        ray.up(group)
        high = jobs.create({**_priority(one_rank("high"), 10), "metadata": {"name": "high", "namespace": "ns"}})
        threads.run("high", high["metadata"]["uid"])
        _wait_for("the adopted low job preempted", lambda: [a.get("result") for a in
                                                            jobs.get("ns", "low")["status"]["attempts"]] == ["Preempted"])
        _wait_for("the high job running", lambda: second.admissions.holders().get("ns/high") == "running")
    finally:
        threads.stop()


def test_a_lost_attempts_gpus_are_released_only_after_its_group_is_gone(tmp_path):
    """Issue 36, 6: a lost attempt freed its GPUs in the books first and tore its group down
    after, so the next job was admitted onto GPUs the old group still held. Now the teardown
    is confirmed first; a teardown that does not remove the group leaves it to the sweeper."""
    ray, clock = StartingRay(), ManualClock()
    controller, jobs, _ = memory_controller(tmp_path, ONE_CPU, ray=ray, max_attempts=1)
    controller.admissions.clock = clock
    books_at_teardown: list[str | None] = []
    ray.on_teardown = lambda group: books_at_teardown.append(controller.admissions.holders().get("ns/low"))
    threads = _Threads(controller)
    try:
        group = _low_running(tmp_path, controller, jobs, clock, threads)
        ray.up(group)
        ray.lose(group)
        _wait_for("the low job failed", lambda: jobs.get("ns", "low")["status"].get("phase") == "Failed")
        assert ray.teardowns == [group] and group not in ray.groups_up
        assert books_at_teardown == ["running"], "the GPUs were released before the group's teardown"
        assert controller.admissions.holders() == {}
    finally:
        threads.stop()


def test_the_sweeper_reclaims_a_group_the_books_do_not_use_even_when_its_job_lives_on(tmp_path):
    """Issue 36, 6: a group left by a teardown that failed belongs to a job that is queued
    again under a new group name: the sweeper kept it for ever (its owner was not finished).
    Any group the books do not use is reclaimed."""
    ray = StartingRay()
    controller, jobs, _ = memory_controller(tmp_path, ONE_CPU, ray=ray)
    obj = jobs.create({**one_rank("again"), "metadata": {"name": "again", "namespace": "ns"}})
    jobs.patch_status("ns", "again", {"phase": "Queued", "attempts": [{"number": 1, "result": "Failed"}]})
    old = f"vj-{obj['metadata']['uid']}-a1"
    ray.up(old)
    swept = controller.sweep()
    assert swept["ownerless"] == [old] and ray.teardowns == [old]


def test_a_deleted_jobs_lifecycle_does_not_touch_a_job_made_again_under_its_name(tmp_path):
    """Issue 36, 8: the old thread's reads and writes went by namespace and name; they refuse
    another object of that name now (the finalizer also waits for the thread to end:
    tests/test_spawning.py; the real server's refusal of the write: tests/test_apiserver.py)."""
    from videojob.controller.kube import Gone

    controller, jobs, _ = memory_controller(tmp_path, ONE_CPU)
    name, old_uid = _job(jobs, "namesake")
    old = controller.lifecycle("ns", name, old_uid)
    old.book.load()
    jobs.remove("ns", name)
    _job(jobs, "namesake")  # made again: another uid
    with pytest.raises(Gone):
        old.book.load()
    with pytest.raises(Gone):
        old.book.update({"phase": "Failed", "message": "the old thread's last word"})
    assert "phase" not in (jobs.get("ns", name).get("status") or {})


def test_a_failure_the_lifecycle_does_not_handle_is_said_in_the_jobs_status(tmp_path):
    """Issue 36, 9: a permanent error (403 on Workloads, any exception in the job's task) was
    retried for ever with nothing in the job's status; now the status says what and that it is
    tried again, with a backoff that doubles up to a cap."""
    import asyncio

    from kubernetes.client.rest import ApiException

    from videojob.controller.spawning import BACKOFF_CAP_S, StopFlag

    controller, jobs, _ = memory_controller(tmp_path, ONE_CPU)
    name, uid = _job(jobs, "forbidden")

    def refused(ask, pass_now=True):
        raise ApiException(status=403, reason="Forbidden")

    controller.admissions.request = refused

    async def run_once():
        await controller.run_job("ns", name, uid, StopFlag())

    with pytest.raises(ApiException):
        asyncio.run(run_once())
    condition = next(c for c in jobs.get("ns", name)["status"]["conditions"] if c["type"] == "Admitted")
    assert condition["reason"] == "OperatorError" and "ServiceAccount lacks a permission" in condition["message"]
    spawner = controller.spawner
    assert [spawner.retry_in(n) for n in (1, 2, 3)] == [spawner.backoff_s, 2 * spawner.backoff_s,
                                                         4 * spawner.backoff_s]
    assert spawner.retry_in(50) == BACKOFF_CAP_S
