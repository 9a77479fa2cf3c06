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
