"""Real out-of-memory errors, not only the injected one, are classified as out of memory.

The operator re-plans only on the reason ``OutOfMemory``; the test hook
(``kind: oom``) raises the runtime's own ``InjectedOOM``, so it cannot show
that what torch raises on a GPU is recognised. Here the tiny pipeline's
denoiser raises, from inside its forward pass (a forward pre-hook), what a GPU
raises: a real ``torch.OutOfMemoryError`` and the ``RuntimeError`` with CUDA's
"out of memory" message, on a CPU rank. Each must come back from the rank as
``OutOfMemory`` in the stage where it happened; an ordinary error must not.
"""

from __future__ import annotations

import pytest

from helpers import require_module

torch = require_module("torch")
require_module("xfuser")

from videojob_runtime.worker import JobRequest, RankWorker  # noqa: E402

CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
            "1.20 GiB is free.")


def _request(job_id: str) -> JobRequest:
    return JobRequest(job_id=job_id, model_id="tiny-cogvideox", task="t2v", prompt="an oom", width=64, height=64,
                      frames=9, fps=8, steps=2, guidance=6.0, seed=3, frames_dtype="float32", track_memory=True)


@pytest.fixture(scope="module")
def worker():
    """One CPU rank with the tiny pipeline loaded (a first job ran)."""
    rank = RankWorker(0, 1)
    assert rank.run(_request("load"))["ok"]
    return rank


RAISED = {
    "torch.OutOfMemoryError": lambda: torch.OutOfMemoryError(CUDA_OOM),
    "torch.cuda.OutOfMemoryError": lambda: torch.cuda.OutOfMemoryError("out of memory"),
    "RuntimeError CUDA out of memory": lambda: RuntimeError(CUDA_OOM),
    "RuntimeError CUDA error: out of memory": lambda: RuntimeError("CUDA error: out of memory\nCUDA kernel errors "
                                                                   "might be asynchronously reported"),
}


@pytest.mark.parametrize("kind", list(RAISED) + ["ordinary RuntimeError"])
def test_an_error_raised_in_the_denoiser_is_classified_by_what_it_is(worker, kind):
    error = RAISED[kind]() if kind in RAISED else RuntimeError("shape mismatch in attention")

    def fail(module, args, kwargs=None):
        raise error

    handle = worker.pipe.transformer.register_forward_pre_hook(fail)
    try:
        result = worker.run(_request(f"oom-{len(kind)}"))
    finally:
        handle.remove()
    assert not result["ok"], result
    got = result["error"]
    if kind in RAISED:
        assert (got["reason"], got["stage"]) == ("OutOfMemory", "denoise"), got
        assert got["message"] == str(error) and got["peak_bytes"] >= 0, got
    else:
        assert got["reason"] == "Failed" and "shape mismatch" in got["message"], got
    # The rank is still usable afterwards (a world of one is consistent after a failure).
    assert worker.run(_request(f"after-{len(kind)}"))["ok"]
