"""Priority preemption through the real operator and Ray: a low-priority job
fills the only GPU; a high-priority job arrives; the low one checkpoints at its
next step boundary, stops (attempt ``Preempted``, not counted), waits in the
queue, and later resumes from its checkpoint and succeeds with the frames an
uninterrupted run of the same spec writes.

The operator's Controller runs in this process (tests/operator_inprocess.py)
against the real API server and a real Ray head. The low job's first attempt
sleeps 2 s after every step (the test-only stall fault): steps the test can
count, on any machine."""

from __future__ import annotations

import json

import pytest

from helpers import require_module, wait_for

require_module("ray")
require_module("xfuser")

from operator_harness import videojob  # noqa: E402
from operator_inprocess import one_rank, operator_factory, with_fault  # noqa: E402

pytestmark = pytest.mark.cluster
CPU1 = [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 1}]
STEPS = 10


@pytest.fixture
def operators(crd, namespace, tmp_path, ray_head):  # noqa: F811
    with operator_factory(crd, namespace, tmp_path, ray_head, CPU1, start=True) as make:
        yield make


def _step(crd, namespace, name) -> int:  # noqa: F811
    return int(((videojob(crd, namespace, name).get("status") or {}).get("progress") or {}).get("step") or 0)


def _high_preempts_low(op, namespace: str, timeout: float) -> tuple[dict, dict, dict]:
    """`high` (priority 10) arrives while `low` holds the only GPU: both succeed, `low` in
    two attempts, the first preempted by `high`, the second resumed where it stopped.
    (`low`'s status, its first attempt, its second.)"""
    op.create(one_rank("high", steps=2, resources={"priority": 10}))
    high = op.wait("high", timeout=timeout)["status"]
    assert high["phase"] == "Succeeded", json.dumps(high)[-2000:]
    status = op.wait("low", timeout=timeout)["status"]
    assert status["phase"] == "Succeeded", json.dumps(status)[-3000:]
    first, second = status["attempts"]
    assert first["result"] == "Preempted" and first["reason"] == "Preempted", first
    assert f"preempted by {namespace}/high" in first["message"], first["message"]
    assert second["result"] == "Succeeded" and second["resumedFromStep"] == first["stepsComputed"], second
    return status, first, second


def test_a_stalled_low_priority_job_is_preempted_at_once_and_resumes(operators, crd, namespace):  # noqa: F811
    """The story below in `make test`'s time: `low` stalls after its first step (60 s at
    most), so the only GPU is held however fast the machine; `high` arrives, the operator
    asks `low` to stop, the request ends the stall at once (a preemption reaches the
    rank), `low` checkpoints at that boundary, `high` runs, and `low` resumes from the
    step it saved. (The longer story, with steps counted and the frames compared with an
    uninterrupted run, is the slow test below; the bit-identical resume is
    tests/test_driver.py's.)"""
    op = operators(max_attempts=2, retry_backoff_s=0.5)
    low = one_rank("low", steps=3, seed=3, checkpoint={"everySteps": 0})
    op.create(with_fault(low, [1], stage="denoise", kind="stall", step=1, seconds=60))
    wait_for("`low` to pass step 1", lambda: _step(crd, namespace, "low") >= 1, timeout=300)
    status, first, _ = _high_preempts_low(op, namespace, timeout=300)
    assert first["stepsComputed"] == 1, "the preemption ended the stall at step 1's boundary"
    assert status["measured"]["stepsComputed"] == 3, status["measured"]
    said = [message for name, _, reason, message in op.events if name == "low" and reason == "Preempting"]
    assert any(f"preempted by {namespace}/high" in m for m in said), said


# Slow (CI time): `make test` runs the story above, faster.
@pytest.mark.slow
def test_a_high_priority_job_preempts_and_the_victim_resumes(operators, crd, namespace):  # noqa: F811
    op = operators(max_attempts=2, retry_backoff_s=0.5)
    low = one_rank("low", steps=STEPS, seed=3, checkpoint={"everySteps": 0})
    op.create(with_fault(low, [1], stage="denoise", kind="stall", seconds=2))
    at = wait_for("`low` to pass step 2", lambda: (s := _step(crd, namespace, "low")) >= 2 and s, timeout=300)
    status, first, _ = _high_preempts_low(op, namespace, timeout=600)
    stopped_at = first["stepsComputed"]
    assert at <= stopped_at <= at + 6, f"preempted at step {stopped_at}, asked at about step {at}"
    assert status["measured"]["stepsComputed"] == STEPS, status["measured"]

    # The same spec, never interrupted, writes the same frames.
    op.create(one_rank("reference", steps=STEPS, seed=3, checkpoint={"everySteps": 0}))
    reference = op.wait("reference", timeout=600)["status"]
    assert reference["output"]["framesDigest"] == status["output"]["framesDigest"]
    said = [message for name, _, reason, message in op.events if name == "low" and reason == "Preempting"]
    assert any(f"preempted by {namespace}/high" in m for m in said), said
