"""Checkpoints through the real operator and Ray: a rank lost after step 5 of 6
(its process exits) does not throw the steps away. The next attempt resumes
from the checkpoint of step 4, the status records it, and the video is the one
an uninterrupted run of the same spec writes (equal frame digests).

The operator's Controller runs in this process (tests/operator_inprocess.py)
against the real API server and a real Ray head; the fault is the test-only
kind the runtime honours when the operator allows it."""

from __future__ import annotations

import json

import pytest

from helpers import require_module

require_module("ray")
require_module("xfuser")

from operator_inprocess import one_rank, operator_factory, with_fault  # noqa: E402

pytestmark = pytest.mark.cluster
CPU1 = [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 1}]


@pytest.fixture
def operators(crd, namespace, tmp_path, ray_head):  # noqa: F811
    with operator_factory(crd, namespace, tmp_path, ray_head, CPU1, start=True) as make:
        yield make


def test_a_lost_rank_resumes_from_its_checkpoint(operators, roots, namespace):  # noqa: F811
    op = operators(max_attempts=3, retry_backoff_s=0.5)
    checkpoint = {"everySteps": 2}
    op.create(with_fault(one_rank("resumed", steps=6, checkpoint=checkpoint), [1], stage="denoise", kind="exit",
                         step=5))
    op.create(one_rank("uninterrupted", steps=6, checkpoint=checkpoint))
    resumed = op.wait("resumed", timeout=600)["status"]
    whole = op.wait("uninterrupted", timeout=600)["status"]
    assert resumed["phase"] == "Succeeded" and whole["phase"] == "Succeeded", json.dumps(resumed)[-2000:]
    first, second = resumed["attempts"]
    assert first["result"] == "Lost" and first["resumedFromStep"] == 0, first
    assert second["result"] == "Succeeded" and second["resumedFromStep"] == 4, second
    assert second["stepsComputed"] == 2, second
    assert resumed["measured"]["stepsComputed"] == first["stepsComputed"] + 2 < 6 + 6, resumed["measured"]
    assert whole["attempts"][0]["resumedFromStep"] == 0 and whole["measured"]["stepsComputed"] == 6
    assert whole["measured"]["checkpointBytes"] > 0 and whole["measured"]["checkpointSeconds"] >= 0
    assert resumed["output"]["framesDigest"] == whole["output"]["framesDigest"], \
        "the resumed video differs from the uninterrupted one"
    outputs = roots["outputs"]
    left = [str(p) for p in outputs.rglob(".videojob-checkpoints")]
    assert left == [], f"checkpoints left after success: {left}"
