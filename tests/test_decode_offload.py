"""Decode offload on a two-rank group (xfuser's CogVideoX wrapper, gloo on the CPU):
only the rank that decodes moves its denoiser, the frames do not change, and
the next job on the warm group finds the denoiser back."""

from __future__ import annotations

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

ray = require_module("ray")
require_module("xfuser")

from videojob.catalog import get_model  # noqa: E402
from videojob_runtime.group import ActorGroup, GroupSpec  # noqa: E402
from videojob_runtime.request import JobRequest  # noqa: E402


def _request(**kw) -> JobRequest:
    base = dict(job_id="dec", model_id="tiny-cogvideox", task="t2v", prompt="a cat walks on the grass",
                width=64, height=64, frames=9, fps=8, steps=2, guidance=6.0, seed=5, track_memory=False)
    return JobRequest(**{**base, **kw})


@pytest.fixture(scope="module")
def group(ray_session):
    g = ActorGroup.start(GroupSpec("vj-test-decode-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    yield g
    g.teardown()


def _per_rank(group, req: JobRequest) -> list[dict]:
    results = ray.get([a.run.remote(req.to_dict()) for a in group.actors], timeout=300)
    assert all(r["ok"] for r in results), results
    return sorted(results, key=lambda r: r["rank"])


def test_only_the_decoding_rank_moves_its_denoiser(group):
    assert get_model("tiny-cogvideox").decoding_ranks == "last"
    plain = _per_rank(group, _request(job_id="plain"))
    moved = _per_rank(group, _request(job_id="moved", decode_offload=True))
    # xfuser's CogVideoX: the last rank decodes and returns the frames; rank 0 never calls the VAE.
    assert [r.get("frames_shape") is not None for r in moved] == [False, True]
    assert moved[0]["decode_offload"]["enabled"] and not moved[0]["decode_offload"]["parked"]
    assert moved[1]["decode_offload"]["parked"]
    assert moved[1]["frames_digest"] == plain[1]["frames_digest"]
    assert all(r["collectives"] > 0 for r in moved)  # really sequence-parallel, not a one-rank fallback
    after = _per_rank(group, _request(job_id="after"))  # the warm group's next job
    assert after[1]["frames_digest"] == plain[1]["frames_digest"] and after[1]["reused"]
    assert not after[1]["decode_offload"]["parked"]
