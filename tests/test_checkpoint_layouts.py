"""A checkpoint resumes on another layout: written by a group of two ulysses
ranks (real Ray actors, torch.distributed and xfuser), resumed on one rank,
and the other way round. CogVideoX runs under xfuser's pipeline wrapper, whose
loop holds each rank's slice of the latents (the checkpoint gathers them);
Wan shards inside its transformer. The frames must match the uninterrupted
one-rank run within the tolerance the layout matrix allows sequence parallel
(1e-3 of the frames' range)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import require_module, wait_for

require_module("torch")
require_module("xfuser")
require_module("ray")

from videojob_runtime.checkpoint import file_name  # noqa: E402
from videojob_runtime.group import ActorGroup, GroupSpec  # noqa: E402
from videojob_runtime.request import JobRequest  # noqa: E402
from videojob_runtime.worker import RankWorker  # noqa: E402

STEPS = 6
# CogVideoX (the gathered slices) in `make test`; Wan (whole latents) too in `make test-slow`.
MODELS = ("tiny-cogvideox", pytest.param("tiny-wan", marks=pytest.mark.slow))


@pytest.fixture(scope="module")
def group(ray_session):
    g = ActorGroup.start(GroupSpec("vj-test-ckpt-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    yield g
    g.teardown()


@pytest.fixture(scope="module")
def one_rank():
    return RankWorker(0, 1)


def _request(model_id: str, ckdir=None, **extra) -> JobRequest:
    data = dict(job_id=f"layout-{model_id}", model_id=model_id, task="t2v", prompt="a tiny layout change",
                width=64, height=64, frames=9, fps=8, steps=STEPS, guidance=6.0 if "cog" in model_id else 5.0,
                seed=5, frames_dtype="float32", track_memory=False)
    if ckdir is not None:
        data["checkpoint_dir"] = str(ckdir)
    return JobRequest(**{**data, **extra})


def _tolerance(want: np.ndarray) -> float:
    return 1e-3 * (float(want.max() - want.min()) or 1.0)


def _stopped_after_step_4(group: ActorGroup, request: JobRequest) -> None:
    """Run on the group until step 4, then cancel: each rank stalls after step 4 (20 s
    at most; the checkpoint of step 4 is already written), the cancel lands in the stall
    and ends it, and the ranks' vote stops them all at that boundary, as a preemption would."""
    stalled = JobRequest(**{**request.to_dict(),
                            "inject_fault": {"stage": "denoise", "kind": "stall", "step": 4, "seconds": 20}})
    refs = [a.run.remote(stalled.to_dict()) for a in group.actors]
    wait_for("the group to reach step 4", lambda: group.progress()["step"] >= 4, timeout=180)
    group.cancel(request.job_id)
    import ray

    results = ray.get(refs, timeout=180)
    assert all(not r["ok"] and r["error"]["reason"] == "Cancelled" and r["error"].get("step") == 4
               for r in results), results


@pytest.mark.parametrize("model_id", MODELS)
def test_written_by_two_ranks_resumed_on_one(model_id, group, one_rank, tmp_path):
    whole = one_rank.run(_request(model_id))
    assert whole["ok"], whole.get("error")
    ckdir = tmp_path / "ck"
    _stopped_after_step_4(group, _request(model_id, ckdir, checkpoint_every_steps=2))
    assert sorted(p.name for p in ckdir.iterdir()) == [file_name(2), file_name(4)]
    resumed = one_rank.run(_request(model_id, ckdir, checkpoint_every_steps=2))
    assert resumed["ok"], resumed.get("error")
    assert resumed["checkpoints"]["resumedFromStep"] == 4, resumed["checkpoints"]
    diff = float(np.abs(resumed["frames"] - whole["frames"]).max())
    assert diff <= _tolerance(whole["frames"]), f"{diff} over {_tolerance(whole['frames'])}"
    assert not ckdir.exists()


@pytest.mark.parametrize("model_id", MODELS)
def test_written_by_one_rank_resumed_on_two(model_id, group, one_rank, tmp_path):
    whole = one_rank.run(_request(model_id))
    ckdir = tmp_path / "ck"
    failed = one_rank.run(_request(model_id, ckdir, checkpoint_every_steps=2,
                                   inject_fault={"stage": "denoise", "step": 5}))
    assert not failed["ok"] and (ckdir / file_name(4)).exists()
    # Another job id: the group remembers the cancel of the first test's job.
    resumed = group.run(_request(model_id, ckdir, checkpoint_every_steps=2, job_id=f"back-{model_id}"),
                        timeout_s=300)
    assert resumed["ok"], resumed.get("error")
    assert resumed["checkpoints"]["resumedFromStep"] == 4, resumed["checkpoints"]
    diff = float(np.abs(resumed["frames"] - whole["frames"]).max())
    assert diff <= _tolerance(whole["frames"]), f"{diff} over {_tolerance(whole['frames'])}"
    assert not ckdir.exists()
