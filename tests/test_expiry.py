"""Finished VideoJobs expire (``controller/expiry.py``), and phase counts move in O(1).

Plain functions here; the sweeper deleting expired jobs on the real API server is
in test_operator_books.py, paginated listing in test_apiserver.py.
"""

from __future__ import annotations

import re

import pytest

from videojob.controller.expiry import KEEP, due, finished_at, ttl_of
from videojob.metrics import Metrics

NOW = 1_800_000_000.0


def _stamp(seconds_ago: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(NOW - seconds_ago, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _job(name: str, phase: str, ended_ago: float | None = None, ttl=None, **meta) -> dict:
    status = {"phase": phase}
    if ended_ago is not None:
        status["completionTime"] = _stamp(ended_ago)
    spec = {} if ttl is None else {"ttlSecondsAfterFinished": ttl}
    return {"metadata": {"namespace": "team-a", "name": name, "uid": f"uid-{name}", **meta}, "spec": spec,
            "status": status}


def test_due_takes_finished_jobs_past_their_ttl_oldest_first():
    jobs = [
        _job("now", "Succeeded", ended_ago=1, ttl=0),            # 0: at once
        _job("young", "Failed", ended_ago=50, ttl=60),           # not yet
        _job("old", "Cancelled", ended_ago=500, ttl=60),
        _job("default", "Succeeded", ended_ago=120),             # the operator's default (100 s)
        _job("running", "Running", ended_ago=10_000, ttl=0),     # not finished: never
        _job("queued", "Queued", ttl=0),
        _job("deleting", "Failed", ended_ago=900, ttl=0, deletionTimestamp=_stamp(1)),
        _job("no-end", "Failed", ttl=0),                         # no completionTime nor condition: kept
    ]
    got = due(jobs, default_ttl_s=100, clock=NOW)
    assert [e.name for e in got] == ["old", "default", "now"]
    assert got[0].uid == "uid-old" and got[0].phase == "Cancelled" and got[0].finished_s_ago == pytest.approx(500)


def test_the_operator_default_can_keep_finished_jobs_while_a_job_still_expires():
    jobs = [_job("kept", "Succeeded", ended_ago=10**7), _job("own-ttl", "Succeeded", ended_ago=30, ttl=10)]
    assert [e.name for e in due(jobs, default_ttl_s=KEEP, clock=NOW)] == ["own-ttl"]


def test_end_time_falls_back_to_the_completed_condition():
    status = {"phase": "Failed", "conditions": [
        {"type": "Planned", "lastTransitionTime": _stamp(900)},
        {"type": "Completed", "lastTransitionTime": _stamp(300)}]}
    assert finished_at(status) == pytest.approx(NOW - 300)
    assert finished_at({"phase": "Failed", "completionTime": "not a time"}) is None


@pytest.mark.parametrize("ttl", [-5, True, "60", 1.5])
def test_a_spec_ttl_that_is_not_a_whole_number_of_seconds_falls_back_to_the_default(ttl):
    # The API server's schema refuses these; a backstop for an object written around it.
    assert ttl_of({"spec": {"ttlSecondsAfterFinished": ttl}}, 77) == 77


def test_the_spec_refuses_a_negative_ttl_naming_the_field():
    from videojob.api import InvalidVideoJob, parse_videojob

    doc = {"apiVersion": "videojob.io/v1alpha1", "kind": "VideoJob", "metadata": {"name": "x", "namespace": "a"},
           "spec": {"model": {"name": "tiny-cogvideox"}, "prompt": "p", "ttlSecondsAfterFinished": -1}}
    with pytest.raises(InvalidVideoJob, match="ttlSecondsAfterFinished"):
        parse_videojob(doc)
    doc["spec"]["ttlSecondsAfterFinished"] = 30
    assert parse_videojob(doc).spec.ttl_seconds_after_finished == 30


def _counts(metrics: Metrics) -> dict[str, float]:
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^videojob_jobs\{phase="(\w+)"\} (\S+)$', text, re.M)}


def test_phase_counts_follow_each_move_and_removal():
    metrics = Metrics()
    for i in range(50):
        metrics.set_phase(f"ns/j{i}", "Pending")
    for i in range(20):
        metrics.set_phase(f"ns/j{i}", "Queued")
    for i in range(5):
        metrics.set_phase(f"ns/j{i}", "Running")
        metrics.set_phase(f"ns/j{i}", "Running")  # the same phase again: no change
    metrics.set_phase("ns/j0", "Succeeded")
    metrics.set_phase("ns/j49", None)
    metrics.set_phase("ns/never-seen", None)
    counts = _counts(metrics)
    assert counts["Pending"] == 29 and counts["Queued"] == 15 and counts["Running"] == 4
    assert counts["Succeeded"] == 1 and counts["Failed"] == 0  # every phase shows, zeros included
