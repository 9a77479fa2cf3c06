"""spec.checkpoint: how often a job saves, from the spec and the plan, and the
combinations the API refuses (naming the field)."""

from __future__ import annotations

import pytest

from videojob.api import InvalidVideoJob, parse_videojob
from videojob.jobrequest import CHECKPOINT_MIN_PLANNED_S, checkpoint_every_steps, checkpoint_key


def _job(checkpoint: dict | None = None, steps: int = 50) -> object:
    spec = {"model": {"name": "tiny-wan"}, "prompt": "p", "sampling": {"steps": steps}}
    if checkpoint is not None:
        spec["checkpoint"] = checkpoint
    return parse_videojob({"apiVersion": "videojob.io/v1alpha1", "kind": "VideoJob",
                           "metadata": {"name": "j", "namespace": "n"}, "spec": spec})


def test_default_is_off_under_a_minute_and_every_tenth_of_the_steps_otherwise():
    assert checkpoint_every_steps(_job(), {"estimatedSeconds": CHECKPOINT_MIN_PLANNED_S - 1}) == 0
    assert checkpoint_every_steps(_job(), {"estimatedSeconds": 600}) == 5
    assert checkpoint_every_steps(_job(steps=4), {"estimatedSeconds": 600}) == 1, "at least every step"


def test_every_steps_wins_and_zero_turns_them_off():
    assert checkpoint_every_steps(_job({"everySteps": 7}), {"estimatedSeconds": 10}) == 7
    assert checkpoint_every_steps(_job({"everySteps": 0}), {"estimatedSeconds": 6000}) == 0
    assert checkpoint_every_steps(_job({"everySteps": 200}, steps=50), {}) == 50


def test_every_seconds_becomes_steps_with_the_plans_step_time():
    # 50 steps in 100 s of denoise: 2 s a step; every 30 s -> every 15 steps.
    assert checkpoint_every_steps(_job({"everySeconds": 30}), {"seconds": {"denoise": 100.0}}) == 15
    # Only the whole estimate known: a step looks longer, so saves come a little sooner.
    assert checkpoint_every_steps(_job({"everySeconds": 30}), {"estimatedSeconds": 150.0}) == 10


@pytest.mark.parametrize("checkpoint, field", [
    ({"everySteps": 2, "everySeconds": 30}, "checkpoint.everySeconds"),
    ({"everySteps": -1}, "checkpoint.everySteps"),
    ({"everySeconds": 1}, "checkpoint.everySeconds"),
    ({"every": 3}, "checkpoint"),
])
def test_bad_checkpoint_settings_name_the_field(checkpoint, field):
    with pytest.raises(InvalidVideoJob) as err:
        _job(checkpoint)
    assert field in str(err.value), str(err.value)


def test_the_directory_key_follows_what_changes_the_frames():
    base = {"model_id": "tiny-wan", "prompt": "p", "seed": 1, "steps": 4}
    assert checkpoint_key(base) == checkpoint_key({**base, "output_name": "other", "job_id": "x"})
    assert checkpoint_key(base) != checkpoint_key({**base, "seed": 2})
    assert checkpoint_key(base) != checkpoint_key({**base, "image": "local://a.png"})


def _plan(model: str, checkpoint: dict | None, steps: int, gpus: int = 8) -> dict:
    from videojob.api import parse_spec
    from videojob.planner.choose import Inventory, plan_spec

    spec = {"model": {"name": model}, "prompt": "p", "sampling": {"steps": steps}}
    if checkpoint is not None:
        spec["checkpoint"] = checkpoint
    result = plan_spec(parse_spec(spec), Inventory(gpus_per_node=gpus))
    assert result.chosen is not None, result.reason
    return result.chosen.to_json()


def test_the_planner_counts_the_checkpoints_in_its_estimate():
    """A job planned over a minute saves about every tenth step by default: the plan says how
    many and what they cost, inside estimatedSeconds; everySteps: 0 costs nothing; the
    driver's interval comes from the same rule and so agrees with the plan's count."""
    from videojob.jobrequest import checkpoints_written

    default = _plan("cogvideox-5b", None, 50, gpus=1)
    assert default["estimatedSeconds"] > CHECKPOINT_MIN_PLANNED_S, default["estimatedSeconds"]
    assert default["checkpoints"] == checkpoints_written(50, 5) == 9
    cost = default["seconds"]["checkpoint"]
    assert 0 < cost < 0.05 * default["seconds"]["denoise"], default["seconds"]
    parts = default["seconds"]
    assert abs(default["estimatedSeconds"] - sum(parts.values())) < 0.3, default
    off = _plan("cogvideox-5b", {"everySteps": 0}, 50, gpus=1)
    assert off["checkpoints"] == 0 and off["seconds"]["checkpoint"] == 0, off["seconds"]
    every = _plan("cogvideox-5b", {"everySteps": 1}, 50, gpus=1)
    assert every["checkpoints"] == 49 and every["seconds"]["checkpoint"] > cost, every["seconds"]
    job = _job(steps=50)
    assert checkpoint_every_steps(job, default) == 5


def test_a_short_job_plans_no_checkpoints():
    tiny = _plan("tiny-wan", None, 4, gpus=1)
    assert tiny["estimatedSeconds"] < CHECKPOINT_MIN_PLANNED_S and tiny["checkpoints"] == 0, tiny
