"""The jobs' tasks started from kopf's events (controller/spawning.py): what kopf's daemons did.

One task per unfinished job and uid, never two; never again once it returned;
stopped by its deletion and by the operator's exit; run again after a failure;
the finalizer waits for it, cancelling it after the grace period.
"""
from __future__ import annotations

import asyncio

from videojob.controller.spawning import Spawner, StopFlag


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


class Jobs:
    """A ``run_job`` that records its calls and runs until stopped, or ``finish`` says so."""

    def __init__(self, fail_first: int = 0, ignore_stop: bool = False):
        self.calls: list[tuple[str, str]] = []
        self.finish: dict[str, asyncio.Event] = {}
        self.fail_first, self.ignore_stop = fail_first, ignore_stop
        self.cancelled: list[str] = []

    async def __call__(self, namespace: str, name: str, uid: str, stopped: StopFlag) -> None:
        self.calls.append((name, uid))
        if self.fail_first:
            self.fail_first -= 1
            raise RuntimeError("the API server refused")
        done = self.finish.setdefault(uid, asyncio.Event())
        waits = [asyncio.ensure_future(done.wait())]
        if not self.ignore_stop:
            waits.append(asyncio.ensure_future(stopped.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.cancelled.append(uid)
            raise
        finally:
            for w in waits:
                w.cancel()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_one_task_per_job_and_none_again_after_it_returned():
    async def body():
        jobs = Jobs()
        spawner = Spawner(jobs)
        for _ in range(3):  # the listing, then status writes: events of a running job start nothing
            spawner.notice("ns", "a", "u1", wanted=True, deleting=False, gone=False)
        await settle()
        assert jobs.calls == [("a", "u1")] and spawner.running == 1
        jobs.finish["u1"].set()
        await settle()
        assert spawner.running == 0
        # kueue mode still "wants" a finished job: it is not run again (kopf's forever-stopped daemon)
        spawner.notice("ns", "a", "u1", wanted=True, deleting=False, gone=False)
        await settle()
        assert jobs.calls == [("a", "u1")]
        # deleted and made again under the same name: a new uid runs
        spawner.notice("ns", "a", "u1", wanted=True, deleting=False, gone=True)
        spawner.notice("ns", "a", "u2", wanted=True, deleting=False, gone=False)
        await settle()
        assert jobs.calls == [("a", "u1"), ("a", "u2")]
        await spawner.close()

    run(body())


def test_finished_and_deleting_jobs_start_nothing():
    async def body():
        jobs = Jobs()
        spawner = Spawner(jobs)
        spawner.notice("ns", "done", "u1", wanted=False, deleting=False, gone=False)
        spawner.notice("ns", "going", "u2", wanted=True, deleting=True, gone=False)
        await settle()
        assert jobs.calls == [] and spawner.running == 0

    run(body())


def test_deletion_stops_the_task_and_the_finalizer_waits_for_it():
    async def body():
        jobs = Jobs()
        spawner = Spawner(jobs)
        spawner.notice("ns", "a", "u1", wanted=True, deleting=False, gone=False)
        await settle()
        # kopf calls the finalizer from its executor: a thread
        result = await asyncio.to_thread(spawner.wait_stopped, "ns", "a", "u1", 10.0)
        assert result is True and spawner.running == 0 and jobs.cancelled == []
        # stopped, not finished: a later event of the same uid (its deletion's) starts nothing
        spawner.notice("ns", "a", "u1", wanted=True, deleting=True, gone=False)
        await settle()
        assert jobs.calls == [("a", "u1")]

    run(body())


def test_a_task_that_ignores_its_flag_is_cancelled_after_the_grace():
    async def body():
        jobs = Jobs(ignore_stop=True)
        spawner = Spawner(jobs, grace_s=0.2)
        spawner.notice("ns", "a", "u1", wanted=True, deleting=False, gone=False)
        await settle()
        assert await asyncio.to_thread(spawner.wait_stopped, "ns", "a", "u1", 5.0) is True
        assert jobs.cancelled == ["u1"] and spawner.running == 0

    run(body())


def test_a_failed_task_runs_again_after_the_backoff_until_stopped():
    async def body():
        jobs = Jobs(fail_first=2)
        spawner = Spawner(jobs, backoff_s=0.05)
        spawner.notice("ns", "a", "u1", wanted=True, deleting=False, gone=False)
        deadline = asyncio.get_running_loop().time() + 10
        while len(jobs.calls) < 3:
            assert asyncio.get_running_loop().time() < deadline, f"runs so far: {jobs.calls}"
            await asyncio.sleep(0.02)
        assert spawner.running == 1  # the third run is the one that waits
        await spawner.close()
        assert spawner.running == 0

    run(body())


def test_close_stops_every_task_and_starts_no_more():
    async def body():
        jobs = Jobs()
        spawner = Spawner(jobs, grace_s=1.0)
        for i in range(20):
            spawner.notice("ns", f"j{i}", f"u{i}", wanted=True, deleting=False, gone=False)
        await settle()
        assert spawner.running == 20
        await spawner.close()
        assert spawner.running == 0 and jobs.cancelled == []
        spawner.notice("ns", "late", "u99", wanted=True, deleting=False, gone=False)
        await settle()
        assert ("late", "u99") not in jobs.calls

    run(body())


def test_stop_flag_reads_as_kopfs():
    async def body():
        flag = StopFlag()
        assert not flag
        flag.set()
        assert flag
        await asyncio.wait_for(flag.wait(), timeout=1)

    run(body())


def test_wait_stopped_for_an_unknown_job_returns_at_once():
    spawner = Spawner(Jobs())
    assert spawner.wait_stopped("ns", "nobody", "u0", 1.0) is True


def test_kopfs_per_event_success_line_is_dropped_and_others_kept(caplog):
    """kopf logs "Handler ... succeeded." for every watch event of every job: the operator's
    filter drops exactly that line of its event handler (kopf's own object logger here)."""
    import logging

    import kopf
    from kopf._core.actions import loggers

    from videojob.controller.handlers import EVENT_HANDLER_ID, QuietEventHandler

    quiet = QuietEventHandler()
    logging.getLogger("kopf.objects").addFilter(quiet)
    try:
        body = kopf.Body({"apiVersion": "v1", "kind": "X", "metadata": {"namespace": "ns", "name": "a", "uid": "u"}})
        logger = loggers.LocalObjectLogger(body=body, settings=kopf.OperatorSettings())
        with caplog.at_level(logging.INFO, logger="kopf.objects"):
            logger.info(f"Handler {EVENT_HANDLER_ID!r} succeeded.")  # as kopf's execution.py writes it
            logger.info("Handler 'finalize' succeeded.")
            logger.error(f"Handler {EVENT_HANDLER_ID!r} failed with an exception")
        messages = [r.getMessage() for r in caplog.records]
        assert messages == ["Handler 'finalize' succeeded.", f"Handler {EVENT_HANDLER_ID!r} failed with an exception"]
    finally:
        logging.getLogger("kopf.objects").removeFilter(quiet)


def test_the_finalizer_waits_for_the_lifecycle_thread_not_only_its_task():
    """Issue 36, 8: cancelling the task cancelled its await of the lifecycle's thread, not the
    thread: the finalizer completed while the thread went on writing books and status (by
    namespace and name: a job made again under the same name got them). The task, and so the
    finalizer's wait, now ends when the thread has."""
    import threading
    import time

    from videojob.controller.admission import Admissions
    from videojob.controller.runner import JobRunner
    from videojob.inventory import parse_inventory

    class Busy:
        """A lifecycle whose thread is in the middle of a slow write when it is stopped."""

        key, on_admitted = "ns/a", None

        def __init__(self):
            self.started, self.ended_at = threading.Event(), None

        def run(self, stopped, park=False):
            self.started.set()
            time.sleep(1.0)  # a status write that takes a while: it does not look at `stopped`
            self.ended_at = time.monotonic()
            return False

    inventory = parse_inventory({"device": "cpu", "classes": [
        {"name": "c", "gpusPerPod": 1, "maxPods": 1, "gpuMemory": "8Gi", "hostMemory": "16Gi", "gpuType": "generic"}]})
    runner = JobRunner(Admissions(inventory, 0), threads=2, poll_interval_s=0.05, place_interval_s=0.05)
    lifecycle = Busy()

    async def body():
        spawner = Spawner(lambda ns, name, uid, stopped: runner.run(lifecycle, stopped), grace_s=0.1)
        spawner.notice("ns", "a", "u1", wanted=True, deleting=False, gone=False)
        assert await asyncio.to_thread(lifecycle.started.wait, 5)
        assert await asyncio.to_thread(spawner.wait_stopped, "ns", "a", "u1", 10.0) is True
        returned = time.monotonic()
        assert lifecycle.ended_at is not None and lifecycle.ended_at <= returned, \
            "the finalizer went on while the job's thread still ran"
        await spawner.close()

    try:
        run(body())
    finally:
        runner.stop()
