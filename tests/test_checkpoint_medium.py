"""Resume at the medium size (configs.MEDIUM_SIZES: published widths, 4 layers,
random weights): a job interrupted after step k and resumed from its checkpoint
gives frames bit-identical to an uninterrupted run (one rank, cache off).

The tiny models (tests/test_checkpoint_resume.py) have scheduler and latent
shapes of their own; these are the real families' at a size a CPU runs.
CogVideoX-2b (its DDIM scheduler) runs in `make test`; Wan with UniPC,
ConsisID and CogVideoX's DPM scheduler are `slow` (`make test-slow`)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers import REPO, require_module

require_module("torch")
require_module("diffusers")

sys.path.insert(0, str(REPO / "benchmarks"))

from checkpoint_bench import Family, make_request, prepare  # noqa: E402
from videojob_runtime.checkpoint import file_name  # noqa: E402
from videojob_runtime.worker import RankWorker  # noqa: E402

CASES = [
    pytest.param(Family("cogvideox-2b", "t2v", None), 4, 3, id="cogvideox-2b-ddim"),
    pytest.param(Family("cogvideox-2b", "t2v", "CogVideoXDPMScheduler"), 6, 5, id="cogvideox-2b-dpm",
                 marks=pytest.mark.slow),
    pytest.param(Family("wan2.1-t2v-1.3b", "t2v", "UniPCMultistepScheduler"), 6, 5, id="wan2.1-unipc",
                 marks=pytest.mark.slow),
    pytest.param(Family("consisid", "identity", None), 6, 5, id="consisid", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family, steps, fail_after", CASES)
def test_a_medium_job_interrupted_resumes_bit_identical(tmp_path, family, steps, fail_after):
    """Saves every 2 steps; fails after ``fail_after``; resumes from the newest save."""
    import torch

    torch.set_num_threads(1)
    inputs, ckdir = tmp_path / "inputs", tmp_path / "checkpoints"
    inputs.mkdir()
    worker = RankWorker(0, 1)
    scheduler = prepare(worker, family, make_request(family, steps, inputs, None), inputs)
    assert scheduler == (family.scheduler or "CogVideoXDDIMScheduler")

    whole = worker.run(make_request(family, steps, inputs, None))
    assert whole["ok"], whole.get("error")
    failed = worker.run(make_request(family, steps, inputs, ckdir, checkpoint_every_steps=2,
                                     inject_fault={"stage": "denoise", "step": fail_after}))
    assert not failed["ok"] and failed["error"].get("step") == fail_after, failed["error"]
    newest = fail_after // 2 * 2
    assert file_name(newest) in [p.name for p in ckdir.iterdir()]

    resumed = worker.run(make_request(family, steps, inputs, ckdir, checkpoint_every_steps=2))
    assert resumed["ok"], resumed.get("error")
    assert resumed["checkpoints"]["resumedFromStep"] == newest and resumed["checkpoints"]["refused"] == []
    assert resumed["frames"].shape == whole["frames"].shape
    assert np.array_equal(resumed["frames"], whole["frames"]), \
        f"max difference {np.abs(resumed['frames'] - whole['frames']).max()}"
    assert not ckdir.exists(), "the checkpoints are removed after success"
