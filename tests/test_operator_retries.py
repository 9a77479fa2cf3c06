"""Retries through the real operator: attempts used up, the out-of-memory margin
compounding, the backoff doubling, and Ray unreachable then back.

The operator's Controller runs in this process (tests/operator_inprocess.py)
against the real API server and a real Ray head of this module; faults are the
test-only kind the runtime honours when the operator allows them (the
``videojob.io/inject-fault`` annotation): a rank's process exits (a lost
actor) or the rank runs out of memory. One-rank jobs: the cheapest attempts.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from helpers import require_module, wait_for

require_module("ray")
require_module("xfuser")

from operator_harness import videojob  # noqa: E402
from operator_inprocess import InProcess, Outage, one_rank, operator_factory, with_fault  # noqa: E402

pytestmark = pytest.mark.cluster
CPU1 = [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 1}]


@pytest.fixture
def operators(crd, namespace, tmp_path, ray_head):  # noqa: F811
    """A factory of in-process operators; each is stopped afterwards."""
    with operator_factory(crd, namespace, tmp_path, ray_head, CPU1, start=True) as make:
        yield make


def _metric(op: InProcess, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", op.metrics(), re.M)
    return float(found.group(1)) if found else 0.0


def test_used_up_attempts_fail_with_every_story_and_the_backoff_doubles(operators):
    """Every attempt loses its rank (its process exits): after MAX_ATTEMPTS (3) the
    job fails, its message tells each attempt's story; between attempts the
    operator waits retry_backoff_s, then twice that."""
    backoff = 1.5
    op = operators(max_attempts=3, retry_backoff_s=backoff)
    op.create(with_fault(one_rank("doomed"), [1, 2, 3], stage="load", kind="exit"))
    status = op.wait("doomed", timeout=600)["status"]
    assert status["phase"] == "Failed", json.dumps(status, indent=1)[-3000:]
    attempts = status["attempts"]
    assert [a["result"] for a in attempts] == ["Lost"] * 3, attempts
    assert all(a["reason"] == "ActorDied" for a in attempts), [a["reason"] for a in attempts]
    completed = next(c for c in status["conditions"] if c["type"] == "Completed")
    assert (completed["status"], completed["reason"]) == ("False", "Failed"), completed
    message = status["message"]
    assert "(no attempts left of 3)" in message, message
    for n in (1, 2, 3):
        assert re.search(rf"attempt {n} \(1 CPU rank[^)]*on cpu1\): Lost ActorDied", message), message
    # The backoff: said in the status, and waited (lower bounds only: a loaded machine is slower, never faster).
    patches = op.patches_of("doomed")
    queued = [(t, p) for t, p, _ in patches if p.get("phase") == "Queued" and "retrying in" in p.get("message", "")]
    assert [re.search(r"retrying in (\S+) s \((\d) attempt", p["message"]).groups() for _, p in queued] == \
        [("1.5", "2"), ("3", "1")], [p["message"] for _, p in queued]
    for (queued_at, patch), delay in zip(queued, (backoff, 2 * backoff)):
        started = len(patch["attempts"]) + 1
        next_start = next(t for t, p, _ in patches if t > queued_at and len(p.get("attempts") or []) == started)
        assert next_start - queued_at >= delay, f"attempt {started} began {next_start - queued_at:.2f}s after " \
                                                f"the retry was announced, before its {delay:g} s backoff"


def test_two_out_of_memory_failures_compound_the_margin(operators):
    """800 MiB per rank: the tiny job's first layout needs 586 MiB. After one OOM the
    planner assumes 1.25x (640 MiB usable: only the other 586 MiB layout is left
    to try); after the second, 1.25^2 = 1.56x (512 MiB), where nothing fits, so the
    job fails saying so. With the margin not compounded (1.25x again), VAE tiling
    (520 MiB) would have been tried: the planner says so below."""
    from videojob.api import parse_videojob
    from videojob.planner.classes import plan_classes

    classes = [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 1, "gpuMemory": "800Mi"}]
    op = operators(classes, max_attempts=3, oom_margin=1.25)
    doc = with_fault(one_rank("squeezed"), [1, 2], stage="load", kind="oom")
    obj = op.create(doc)
    status = op.wait("squeezed", timeout=600)["status"]
    assert status["phase"] == "Failed", json.dumps(status, indent=1)[-3000:]
    first, second = status["attempts"]
    assert (first["result"], second["result"]) == ("OutOfMemory", "OutOfMemory"), status["attempts"]
    assert first["plan"]["summary"] != second["plan"]["summary"], "the re-plan chose another layout"
    completed = next(c for c in status["conditions"] if c["type"] == "Completed")
    assert completed["reason"] == "OutOfMemory", completed
    assert "no stricter layout fits" in status["message"], status["message"]
    assert "no attempts left" not in status["message"], "it failed for want of attempts, not of a layout"
    # The planner as the operator calls it: 1.25 after one OOM gave the second layout;
    # without compounding, the third attempt would have had a layout.
    spec = parse_videojob(obj).spec
    tried = {("cpu1", first["plan"]["summary"]), ("cpu1", second["plan"]["summary"])}
    once = plan_classes(spec, op.controller.inventory, margin=1.25, exclude={("cpu1", first["plan"]["summary"])})
    assert once.chosen is not None and once.chosen.to_json()["summary"] == second["plan"]["summary"]
    flat = plan_classes(spec, op.controller.inventory, margin=1.25, exclude=tried)
    assert flat.chosen is not None, "the scenario does not tell compounding apart from a flat margin"


def _admitted(obj: dict) -> dict:
    return next(c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == "Admitted")


# Slow (CI time): `make test` covers Ray unreachable with
# test_operator::test_ray_trouble_is_a_retrying_condition_not_a_crash[unreachable].
@pytest.mark.slow
def test_ray_unreachable_then_back_the_job_completes(operators, crd, namespace, ray_head, tmp_path):  # noqa: F811
    """Ray's dashboard is away when the job arrives, comes back, then goes away again
    while the job runs: the job shows RayUnavailable (never Failed) and completes
    once Ray is back, with one attempt and one submission; once Ray answers again
    the status no longer says it is unavailable."""
    outage = Outage(ray_head.dashboard_port)
    op = operators(dashboard_url=outage.url, ray_http_timeout_s=3.0)
    try:
        # `patient` stalls after its first step (not "many steps": their time depends on the
        # load), so it still runs when Ray goes away the second time; released (30 s at most)
        # once Ray is back.
        release = tmp_path / "release-patient"
        op.create(with_fault(one_rank("patient", steps=2), [1], stage="denoise", kind="stall", step=1, seconds=30,
                             release=str(release)))
        found = wait_for("a RayUnavailable condition while Ray is away", lambda: next(
            (p for _, p, _ in op.patches_of("patient")
             if any(c["reason"] == "RayUnavailable" for c in p.get("conditions") or [])), None), timeout=120)
        condition = next(c for c in found["conditions"] if c["reason"] == "RayUnavailable")
        assert condition["status"] == "Unknown" and "retrying every 1 s" in condition["message"], condition
        assert found.get("phase") != "Failed", found
        outage.up()
        running = wait_for("the job to run once Ray is back", lambda: (
            (o := videojob(crd, namespace, "patient")).get("status", {}).get("progress") or {}).get("step", 0) >= 1
            and o, timeout=300)
        admitted_while_running = _admitted(running)
        errors = _metric(op, "videojob_ray_errors_total")
        outage.down()
        wait_for("the operator to meet Ray away while the job runs",
                 lambda: _metric(op, "videojob_ray_errors_total") > errors, timeout=120)
        assert videojob(crd, namespace, "patient")["status"]["phase"] == "Running"
        outage.up()
        release.touch()
        status = op.wait("patient", timeout=400)["status"]
    finally:
        outage.down()
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)[-3000:]
    assert [a["result"] for a in status["attempts"]] == ["Succeeded"], status["attempts"]
    # Ray's job table may be pruned of finished drivers: count what the operator submitted.
    # 0 is right too: a POST that timed out (3 s, on a loaded machine) after Ray took it
    # is found on the retry and adopted, not submitted again.
    submitted = _metric(op, "videojob_ray_submissions_total")
    assert submitted <= 1, f"the driver was submitted {submitted:g} times"
    # A defect found here (left to the controller's owner): the Admitted condition written
    # while Ray was away is never set back, so a running, then succeeded, job says Ray is away.
    assert admitted_while_running["reason"] != "RayUnavailable", \
        f"Ray answered and the job runs, but its status still says: {admitted_while_running}"
    assert _admitted({"status": status})["status"] == "True", f"stale at the end: {_admitted({'status': status})}"
