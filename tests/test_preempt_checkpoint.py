"""Preemption at a step boundary: a cancel that asks for a checkpoint (level 2)
saves the step the job stops at, every rank taking part, and the job ends
``Preempted`` with ``checkpointStep``; the next attempt resumes from it with
frames bit-identical to an uninterrupted run. A plain cancel saves nothing.

In-process: one RankWorker (real diffusers pipeline, tiny random weights).
On Ray: a group of two ulysses ranks (tiny CogVideoX under xfuser's wrapper,
so the save all-gathers the latents), preempted by the real driver
(``python -m videojob_runtime.driver --preempt``) run as a subprocess against
the test's Ray; the group stays usable for the next job.

Each job stalls after step 4 (an injected fault: the ranks wait at that
boundary, 20 s at most, until the cancel reaches them) so the cancel lands
there whatever the machine's load."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from helpers import REPO, require_module, wait_for

require_module("torch")
require_module("diffusers")

from videojob.driver_protocol import result_of  # noqa: E402
from videojob_runtime.checkpoint import file_name  # noqa: E402
from videojob_runtime.request import JobRequest  # noqa: E402
from videojob_runtime.worker import RankWorker  # noqa: E402

STEPS = 6
STALL = {"stage": "denoise", "kind": "stall", "step": 4, "seconds": 20}


def _request(job_id: str, ckdir=None, **extra) -> JobRequest:
    data = dict(job_id=job_id, model_id="tiny-cogvideox", task="t2v", prompt="a preempted tiny video", width=64,
                height=64, frames=9, fps=8, steps=STEPS, guidance=6.0, seed=13, frames_dtype="float32",
                track_memory=False, checkpoint_every_steps=0)
    if ckdir is not None:
        data["checkpoint_dir"] = str(ckdir)
    return JobRequest(**{**data, **extra})


def _stopped_in_the_stall(worker: RankWorker, req: JobRequest, checkpoint: bool) -> dict:
    """Run ``req`` (stalled after step 4) in a thread; cancel it from here while it stalls."""
    out: dict = {}
    runner = threading.Thread(target=lambda: out.update(worker.run(req)), name="job")
    runner.start()
    try:
        wait_for(f"job {req.job_id} to reach step 4",
                 lambda: worker.progress.job_id == req.job_id and worker.progress.step >= 4, timeout=180)
        assert worker.cancel(req.job_id, checkpoint=checkpoint) == req.job_id
    finally:
        runner.join(timeout=300)
    assert not runner.is_alive(), "the job did not stop"
    return out


@pytest.fixture(scope="module")
def worker():
    return RankWorker(0, 1)


def test_a_preempted_job_saves_its_step_and_resumes_bit_identical(worker, tmp_path):
    import diffusers

    from videojob_runtime.pipelines import inner_pipeline

    # CogVideoX's DPM scheduler: the loop carries old_pred_original_sample between steps.
    worker.load(_request("whole"))
    inner = inner_pipeline(worker.pipe)
    inner.scheduler = diffusers.CogVideoXDPMScheduler.from_config(inner.scheduler.config)
    whole = worker.run(_request("whole"))
    assert whole["ok"], whole.get("error")

    ckdir = tmp_path / "ck"
    stopped = _stopped_in_the_stall(worker, _request("pre", ckdir, inject_fault=STALL), checkpoint=True)
    assert not stopped["ok"] and stopped["consistent"] is True, stopped
    error = stopped["error"]
    assert error["reason"] == "Preempted" and error["stage"] == "denoise", error
    assert error["step"] == 4 and error["checkpointStep"] == 4, error
    # checkpoint_every_steps=0: nothing was scheduled, the preemption saved it.
    assert sorted(p.name for p in ckdir.iterdir()) == [file_name(4)]
    assert worker.broken is None and worker.health()["busy"] is False

    # Preempted before it starts (the cancel waits for the job): nothing new is saved,
    # it names the newest valid checkpoint on disk.
    worker.cancel("early", checkpoint=True)
    early = worker.run(_request("early", ckdir))
    assert early["error"]["reason"] == "Preempted" and early["error"]["stage"] == "load", early["error"]
    assert early["error"]["checkpointStep"] == 4 and early["consistent"] is True, early["error"]

    resumed = worker.run(_request("resumed", ckdir))
    assert resumed["ok"], resumed.get("error")
    assert resumed["checkpoints"]["resumedFromStep"] == 4 and resumed["checkpoints"]["refused"] == []
    assert np.array_equal(resumed["frames"], whole["frames"]), \
        f"max difference {np.abs(resumed['frames'] - whole['frames']).max()}"
    assert not ckdir.exists(), "the checkpoints are removed after success"


def test_a_plain_cancel_saves_nothing(worker, tmp_path):
    ckdir = tmp_path / "ck"
    stopped = _stopped_in_the_stall(worker, _request("plain", ckdir, inject_fault=STALL), checkpoint=False)
    error = stopped["error"]
    assert error["reason"] == "Cancelled" and error["step"] == 4 and "checkpointStep" not in error, error
    assert not ckdir.exists(), "a cancel without checkpoint must not write one"


def test_a_job_without_checkpoints_is_preempted_at_step_0():
    worker = RankWorker(0, 1)
    worker.cancel("nock", checkpoint=True)
    stopped = worker.run(_request("nock"))
    assert stopped["error"]["reason"] == "Preempted" and stopped["error"]["checkpointStep"] == 0, stopped["error"]


# -- a group of two ranks, preempted by the driver ----------------------------------


@pytest.fixture(scope="module")
def group(ray_session):
    require_module("xfuser")
    require_module("ray")
    from videojob_runtime.group import ActorGroup, GroupSpec

    g = ActorGroup.start(GroupSpec("vj-test-preempt-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    yield g
    g.teardown()


def _driver(ray_session, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": ray_session["address"]}
    return subprocess.run([sys.executable, "-m", "videojob_runtime.driver", *args], capture_output=True, text=True,
                          timeout=180, cwd=REPO, env=env)


def test_the_driver_preempts_a_group_which_stays_usable(group, ray_session, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from videojob_runtime.driver import _summary

    whole = group.run(_request("g-whole"), timeout_s=300)
    assert whole["ok"], whole.get("error")

    ckdir = tmp_path / "ck"
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(group.run, _request("g-pre", ckdir, inject_fault=STALL), 300)
        wait_for("the group to reach step 4",
                 lambda: (p := group.progress())["job_id"] == "g-pre" and p["step"] >= 4, timeout=180)
        done = _driver(ray_session, "--preempt", group.spec.name, "--job", "g-pre", "--world", "2")
        result = running.result(timeout=300)
    record = result_of(done.stdout)
    assert done.returncode == 0 and record and record["ok"], f"{done.stdout}\n{done.stderr[-3000:]}"
    assert record["asked"] == [0, 1] and [r["job"] for r in record["ranks"]] == ["g-pre", "g-pre"], record

    assert not result["ok"] and result["error"]["reason"] == "Preempted", result["error"]
    assert result["error"]["checkpointStep"] == 4 and result["error"]["groupTornDown"] is False, result["error"]
    for rank in result["ranks"]:
        assert rank["error"]["reason"] == "Preempted" and rank["consistent"] is True, rank
        assert rank["error"]["step"] == 4 and rank["error"]["checkpointStep"] == 4, rank
    assert sorted(p.name for p in ckdir.iterdir()) == [file_name(4)]
    # The job's driver reports it as it gets it: reason and checkpointStep in its result record.
    summary = _summary(result, "local://x", tmp_path)
    assert summary["ok"] is False and summary["error"]["reason"] == "Preempted"
    assert summary["error"]["checkpointStep"] == 4 and summary["error"]["step"] == 4

    assert all(not h["broken"] and not h["busy"] for h in group.health())
    resumed = group.run(_request("g-resumed", ckdir), timeout_s=300)
    assert resumed["ok"], resumed.get("error")
    assert resumed["checkpoints"]["resumedFromStep"] == 4, resumed["checkpoints"]
    assert np.array_equal(resumed["frames"], whole["frames"]), \
        f"max difference {np.abs(resumed['frames'] - whole['frames']).max()}"


def test_preempting_a_group_that_is_not_there_is_a_result_not_a_traceback(ray_session):
    require_module("ray")
    done = _driver(ray_session, "--preempt", "vj-test-no-such-group", "--job", "j", "--world", "2")
    record = result_of(done.stdout)
    assert done.returncode == 1 and record, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert record["ok"] is False and record["error"]["reason"] == "GroupNotFound", record
    assert "vj-test-no-such-group" in record["error"]["message"] and "Traceback" not in done.stderr


def test_the_cancel_level_is_agreed_as_a_max_on_the_ranks_device():
    from videojob_runtime import distributed

    seen = []

    def all_reduce(tensor, op=None):
        seen.append((tensor.device.type, str(op)))
        if tensor.device.type == "cpu":
            tensor.fill_(2)  # a peer asked for a checkpoint

    assert distributed.agree_max(1, "cpu", all_reduce=all_reduce) == 2
    assert len(seen) == 1 and seen[0][0] == "cpu" and "MAX" in seen[0][1], seen
