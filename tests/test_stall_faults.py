"""The injected "stall" fault (``FaultInjection``) waits for an event, its seconds only a cap.

A stall keeps a job busy at a known point until the test acts; it ends early
once a cancel or preemption of the job reached the rank (the vote right after
it then stops the job at once), or once its ``release`` file exists (a test
lets the job go on), so no test waits out a stall it already acted on. In
process: a real ``RankWorker`` (no model is loaded) and its ``JobGate``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import require_module

require_module("torch")

from videojob_runtime.errors import Cancelled, Preempted  # noqa: E402
from videojob_runtime.gate import JobGate  # noqa: E402
from videojob_runtime.request import FaultInjection, JobRequest  # noqa: E402
from videojob_runtime.worker import RankWorker  # noqa: E402

CAP_S = 30.0  # a stall's seconds where the test must not wait them out
WITHIN_S = 5.0  # how soon after its event a stall must end (it polls every 0.05 s; a sixth of CAP_S,
# so the event, not the cap, ended it, with room for a loaded machine)
ACT_AFTER_S = 0.3  # the other thread acts this long after the stall began


def _request(job_id: str, **fault) -> JobRequest:
    return JobRequest(job_id=job_id, model_id="tiny-cogvideox", task="t2v", prompt="a stalled tiny video",
                      width=64, height=64, frames=9, fps=8, steps=3, guidance=6.0, track_memory=False,
                      inject_fault={"stage": "denoise", "kind": "stall", "step": 1, **fault})


def _after_step_1(gate: JobGate, act, deadline_s: float) -> tuple[float, BaseException | None]:
    """Denoise step 1 ends on ``gate`` (the stall, then the vote) in a thread; ``act`` runs
    here ACT_AFTER_S later. (seconds the boundary took, what it raised); fails when the
    boundary is not passed within ``deadline_s``."""
    out: dict = {}

    def boundary():
        started = time.monotonic()
        try:
            gate.step_done(0)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["raised"] = exc
        out["took"] = time.monotonic() - started

    runner = threading.Thread(target=boundary, name="stalled-step", daemon=True)
    runner.start()
    time.sleep(ACT_AFTER_S)  # the stall has begun: the step's boundary does nothing else first
    act()
    runner.join(deadline_s)
    assert not runner.is_alive(), f"the stall did not end within {deadline_s:.1f}s of its event"
    return out["took"], out.get("raised")


@pytest.mark.parametrize("checkpoint", [False, True], ids=["cancel", "preempt"])
def test_a_cancel_ends_the_stall_and_the_next_vote_stops_the_job(checkpoint):
    worker = RankWorker(0, 1)
    req = _request(f"stalled-{checkpoint}", seconds=CAP_S)
    gate = JobGate(worker, req)
    took, raised = _after_step_1(gate, lambda: worker.cancel(req.job_id, checkpoint=checkpoint), WITHIN_S)
    assert ACT_AFTER_S <= took < ACT_AFTER_S + WITHIN_S, f"the step's boundary took {took:.2f}s"
    if checkpoint:
        assert isinstance(raised, Preempted), raised
        assert raised.details["checkpointStep"] == 0, raised.details  # no checkpoints in this job
    else:
        assert type(raised) is Cancelled, raised
    assert (raised.stage, raised.details["step"]) == ("denoise", 1), raised.to_dict()


def test_a_cancel_for_another_job_does_not_end_the_stall():
    worker = RankWorker(0, 1)
    gate = JobGate(worker, _request("mine", seconds=1.0))
    took, raised = _after_step_1(gate, lambda: worker.cancel("someone-else"), 1.0 + WITHIN_S)
    assert raised is None and took >= 1.0, (took, raised)


def test_the_release_file_ends_the_stall_and_the_job_goes_on(tmp_path):
    release = tmp_path / "release"
    worker = RankWorker(0, 1)
    gate = JobGate(worker, _request("released", seconds=CAP_S, release=str(release)))
    took, raised = _after_step_1(gate, release.touch, WITHIN_S)
    assert raised is None, raised
    assert ACT_AFTER_S <= took < ACT_AFTER_S + WITHIN_S, f"the step's boundary took {took:.2f}s"
    assert worker.progress.step == 1 and gate.stage == "denoise"


def test_a_stall_with_neither_lasts_its_seconds(tmp_path):
    worker = RankWorker(0, 1)
    gate = JobGate(worker, _request("plain", seconds=0.3, release=str(tmp_path / "never-made")))
    started = time.monotonic()
    gate.step_done(0)  # bounded by the stall's 0.3 s
    took = time.monotonic() - started
    assert 0.3 <= took < 0.3 + WITHIN_S, took


def test_the_rendezvous_stall_ends_when_released(tmp_path):
    require_module("ray")
    from videojob_runtime.group import _rendezvous_fault

    release = tmp_path / "release"
    fault = FaultInjection(stage="rendezvous", kind="stall", rank=1, seconds=CAP_S, release=str(release))
    started = time.monotonic()
    _rendezvous_fault(fault, 0)  # another rank's fault: no stall here
    assert time.monotonic() - started < WITHIN_S
    timer = threading.Timer(ACT_AFTER_S, release.touch)
    timer.start()
    try:
        _rendezvous_fault(fault, 1)  # bounded by CAP_S
    finally:
        timer.cancel()
    took = time.monotonic() - started
    assert ACT_AFTER_S <= took < ACT_AFTER_S + WITHIN_S, f"the rendezvous stall took {took:.2f}s"


@pytest.mark.parametrize("release,words", [
    ("relative/path", "FaultInjection.release must be an absolute path"),
    (7, "FaultInjection.release must be an absolute path"),
    ("", "FaultInjection.release must be an absolute path"),
])
def test_a_release_that_is_not_an_absolute_path_is_refused(release, words):
    with pytest.raises(ValueError, match=words):
        FaultInjection(stage="denoise", kind="stall", seconds=1, release=release)
    with pytest.raises(ValueError, match=words):  # as a rank receives it
        _request("refused", seconds=1, release=release)


def test_a_release_is_for_stalls_only():
    with pytest.raises(ValueError, match="FaultInjection.release applies to kind 'stall' only"):
        FaultInjection(stage="denoise", kind="error", release="/tmp/x")


def test_the_release_crosses_the_actor_boundary(tmp_path):
    """As the driver sends a request (a plain dict) and a rank reads it back."""
    path = str(Path(tmp_path) / "go")
    req = JobRequest.from_dict(_request("crossing", seconds=5, release=path).to_dict())
    assert req.fault() == FaultInjection(stage="denoise", kind="stall", step=1, seconds=5, release=path)
