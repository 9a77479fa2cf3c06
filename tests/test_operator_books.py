"""The operator's books (``Admissions``) against what really happens in Ray.

The Controller runs in this process (tests/operator_inprocess.py) over the
real API server and a real Ray head of this module, so each status write can
be checked against the books at that moment, and the operator can be stopped
and started again at a chosen point. What is checked:

- a group that cannot be placed (NoPlacement, from the real driver) frees its
  GPUs in the books and in the videojob_gpus_* metrics while re-queued;
- a restart with queued jobs, a running job and a warm group rebuilds the
  books without counting the group twice, and admits the higher priority first;
- a job spills to another class when its own is busy, and warm groups expire
  after their TTL inside the running operator;
- the sweeper removes a group nobody owns and leaves the operator's own;
- the sweeper deletes finished jobs past their ttlSecondsAfterFinished (the job's
  own or the operator's default) and no other, and never a job made again under
  the same name.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid

import pytest

from helpers import require_module, wait_for

require_module("ray")
require_module("xfuser")

from operator_harness import create, videojob  # noqa: E402
from operator_inprocess import InProcess, one_rank, operator_factory, with_fault  # noqa: E402
from test_operator import SLOW_VIDEO  # noqa: E402

pytestmark = pytest.mark.cluster
CPU1 = [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 1}]


@pytest.fixture
def operators(crd, namespace, tmp_path, ray_head):  # noqa: F811
    """A factory of in-process operators; afterwards each is stopped and every group in Ray removed."""
    with operator_factory(crd, namespace, tmp_path, ray_head, CPU1, remove_groups=True) as make:
        yield make


def _groups(ray_client) -> set[str]:  # noqa: F811
    from videojob.controller.groups import groups_in_ray

    return set(groups_in_ray(ray_client))


def _gauge(metrics: str, name: str, klass: str) -> float:
    found = re.search(rf'^{name}\{{gpu_class="{klass}"\}} (\S+)$', metrics, re.M)
    assert found, f"{name} for {klass} not in /metrics"
    return float(found.group(1))


def _first_running(op: InProcess, name: str) -> float:
    return next(t for t, p, _ in op.patches_of(name) if p.get("phase") == "Running")


def test_no_placement_frees_the_gpus_in_the_books_and_the_metrics(operators, ray_client):  # noqa: F811
    """Each rank asks for 4 CPUs of a 2-CPU Ray head: the real driver reports
    NoPlacement; while re-queued the class's GPU is free in the books and in
    /metrics; at the limit the job fails, holding nothing."""
    # Longer than one attempt (a driver's start plus the 2 s placement wait, ~5 s) by a
    # margin for a loaded machine, so the job is re-queued at least once before the limit.
    limit = 15.0
    op = operators(cpus_per_rank=4.0, placement_timeout_s=2, placement_max_wait_s=2,
                   placement_requeue_limit_s=limit, retry_backoff_s=0.5, max_attempts=1)
    op.sample_metrics = {"Queued"}
    op.start()
    started = time.monotonic()
    obj = op.create(one_rank("unplaceable"))
    status = op.wait("unplaceable", timeout=400)["status"]
    took = time.monotonic() - started
    assert status["phase"] == "Failed", json.dumps(status, indent=1)[-3000:]
    completed = next(c for c in status["conditions"] if c["type"] == "Completed")
    assert completed["reason"] == "NoPlacement", completed
    assert took >= limit, f"failed after {took:.1f}s, before the {limit:g} s requeue limit"
    assert {a["result"] for a in status["attempts"]} == {"Requeued"} and len(status["attempts"]) >= 2
    assert all(a["reason"] == "NoPlacement" for a in status["attempts"]), status["attempts"]
    held = [books["classes"]["cpu1"]["allocated"] for _, p, books in op.patches_of("unplaceable")
            if p.get("phase") == "Running"]
    assert held and all(n == 1 for n in held), f"an admitted attempt holds its GPU in the books: {held}"
    requeued = [(p, m) for _, p, m in op.sampled
                if any(c["reason"] == "NoPlacement" for c in p.get("conditions") or [])]
    assert len(requeued) == len(status["attempts"]) - 1, [p.get("message") for p, _ in requeued]
    for _, books in ((p, b) for _, p, b in op.patches_of("unplaceable") if p.get("phase") == "Queued"):
        assert books["classes"]["cpu1"]["allocated"] == 0, f"re-queued, yet booked: {books}"
    for patch, metrics in requeued:
        assert _gauge(metrics, "videojob_gpus_allocated", "cpu1") == 0, patch["message"]
        assert _gauge(metrics, "videojob_gpus_free", "cpu1") == 1, patch["message"]
    assert op.controller.admissions.snapshot()["classes"]["cpu1"]["allocated"] == 0
    assert _gauge(op.metrics(), "videojob_gpus_allocated", "cpu1") == 0
    uid = obj["metadata"]["uid"]
    wait_for("no group of the job left in Ray", lambda: not any(uid in g for g in _groups(ray_client)), timeout=60)


def _on(klass: str, name: str, **changes) -> dict:
    """A one-rank job pinned to ``klass``."""
    doc = one_rank(name, **changes)
    doc["spec"]["resources"]["gpuClass"] = klass
    return doc


def test_restart_with_queued_jobs_and_warm_groups_admits_the_priority_first(operators, crd, namespace,  # noqa: F811
                                                                          ray_client, tmp_path):
    """Two classes of one rank. On x, `kept` leaves an idle warm group Gx. On y,
    `warm` leaves G, `long` reuses G and runs, `low` then `high` (priority 10)
    queue behind it. The operator stops; `long` ends while none runs. The new
    operator's books: Gx idle on x, G held by `long` on y (not also idle). Then
    `low`'s lifecycle asks first, `high`'s next, `long`'s last (it frees G): `high`
    runs on G before `low`; a new job for x reuses the adopted Gx."""
    first = operators([{"name": "x", "gpusPerPod": 1, "maxPods": 1}, {"name": "y", "gpusPerPod": 1, "maxPods": 1}],
                      warm_group_ttl_s=600).start()
    first.create(_on("x", "kept", steps=2))
    first.create(_on("y", "warm", steps=2))
    kept, warm = first.wait("kept", timeout=300)["status"], first.wait("warm", timeout=300)["status"]
    for status in (kept, warm):
        assert status["phase"] == "Succeeded" and status["actorGroup"]["kept"], status.get("message")
    gx, group = kept["actorGroup"]["name"], warm["actorGroup"]["name"]
    # `long` stalls after its first step (not "many steps": step time depends on the
    # machine's load), so it is still running when the operator stops; released (40 s
    # at most) once the operator stopped, so it ends while none runs.
    release = tmp_path / "release-long"
    first.create(with_fault(_on("y", "long", steps=3), [1], stage="denoise", kind="stall", step=1, seconds=40,
                            release=str(release)))
    wait_for("`long` to run", lambda: ((videojob(crd, namespace, "long").get("status") or {}).get("progress")
                                       or {}).get("step", 0) >= 1, timeout=300)
    first.create(_on("y", "low", steps=2))
    first.create(_on("y", "high", steps=2, resources={"priority": 10}))
    for name in ("low", "high"):
        wait_for(f"`{name}` to be Queued", lambda n=name: (videojob(crd, namespace, n).get("status") or {})
                 .get("phase") == "Queued", timeout=60)
    long_attempt = videojob(crd, namespace, "long")["status"]["attempts"][-1]
    assert long_attempt["group"] == group, "`long` reused the warm group"
    first.stop()
    release.touch()
    wait_for("`long`'s driver to end while no operator runs",
             lambda: (j := ray_client.job(long_attempt["submissionId"])) is not None and j.terminal, timeout=400)
    assert {gx, group} <= _groups(ray_client), "both warm groups outlived the operator"

    second = operators([{"name": "x", "gpusPerPod": 1, "maxPods": 1}, {"name": "y", "gpusPerPod": 1, "maxPods": 1}],
                       warm_group_ttl_s=600).start()
    books = second.controller.admissions.snapshot()
    rebuilt = {k: (c["allocated"], c["idle"]) for k, c in books["classes"].items()}
    assert rebuilt == {"x": (1, 1), "y": (1, 0)} and books["running"] == 1, f"rebuilt books: {books}"
    for name in ("low", "high", "long"):
        second.run(name)
    second.create(_on("x", "again", steps=2))
    ended = {name: second.wait(name, timeout=400)["status"] for name in ("long", "high", "low", "again")}
    for name, status in ended.items():
        assert status["phase"] == "Succeeded", (name, status.get("message"))
        assert len(status["attempts"]) == 1, (name, status["attempts"])
    assert ended["high"]["attempts"][0]["group"] == group, "the higher priority took the warm group"
    assert _first_running(second, "high") < _first_running(second, "low"), "`low` was admitted before `high`"
    assert ended["again"]["attempts"][0]["group"] == gx and ended["again"]["actorGroup"]["reused"], \
        "the adopted idle group was not reused"


def test_a_job_spills_from_a_busy_class_and_its_warm_group_expires(operators, crd, namespace, ray_client,  # noqa: F811
                                                                   caplog, tmp_path):
    """The story below in `make test`'s time: `first` holds class a (planned long, and
    stalled after its first step, 60 s at most); `second` spills to b, where it ends
    sooner, and keeps its group; `first` is deleted instead of run to its end; the
    sweeper tears `second`'s warm group down once idle past the TTL (4 s), and the books
    let go."""
    classes = [{"name": "a", "gpusPerPod": 1, "maxPods": 1, "gpuType": "generic", "cost": 1.0},
               {"name": "b", "gpusPerPod": 1, "maxPods": 1, "gpuType": "h100", "cost": 5.0}]
    caplog.set_level(logging.INFO, logger="videojob.admission")
    op = operators(classes, warm_group_ttl_s=4, sweep_interval_s=1).start()
    op.create(with_fault(one_rank("first", steps=30, video=SLOW_VIDEO), [1], stage="denoise", kind="stall",
                         step=1, seconds=60))
    wait_for("`first` to run on a", lambda: (videojob(crd, namespace, "first").get("status") or {})
             .get("phase") == "Running", timeout=300)
    op.create(one_rank("second", steps=2))
    second = op.wait("second", timeout=300)["status"]
    assert second["phase"] == "Succeeded", second.get("message")
    assert second["plan"]["gpuClass"] == "b" and second["attempts"][0]["plan"]["gpuClass"] == "b"
    planned = next(c for c in second["conditions"] if c["type"] == "Planned")
    assert "spilled from a" in planned["message"], planned
    group = second["actorGroup"]["name"]
    assert second["actorGroup"]["kept"], second["actorGroup"]
    creator = second["attempts"][0]["submissionId"]
    op.delete("first")
    wait_for(f"the warm group {group} to expire and be torn down", lambda: group not in _groups(ray_client),
             timeout=120)
    # The driver that made the group was kept in Ray's job table while its group lived; the
    # sweep after the group went deletes its record.
    wait_for(f"the sweeper to delete {creator}, whose group is gone", lambda: ray_client.job(creator) is None,
             timeout=60)
    wait_for("the books to let go of both classes", lambda: all(
        c["allocated"] == 0 and c["idle"] == 0 for c in op.controller.admissions.snapshot()["classes"].values()),
        timeout=30)
    assert re.search(r'videojob_warm_group_evictions_total\{why="ttl"\} [1-9]', op.metrics()), op.metrics()
    books_log = "\n".join(r.getMessage() for r in caplog.records if r.name == "videojob.admission")
    assert f"released {namespace}/second class=b kept={group}" in books_log, books_log[-2000:]
    assert re.search(rf"expired {group} class=b .*allocated=0/1 idle=0", books_log), books_log[-2000:]


# Slow (CI time): `make test` runs the story above, faster (`first` deleted, not run to its end).
@pytest.mark.slow
def test_a_busy_class_spills_and_warm_groups_expire(operators, crd, namespace, ray_client, caplog,  # noqa: F811
                                                   tmp_path):
    """Class a is preferred (cheaper); b is faster. `first` runs on a; `second`, whose
    class a is busy, spills to b, where it ends sooner. Both keep their groups; the
    sweeper tears each down once idle past the TTL (4 s), and the books let go."""
    classes = [{"name": "a", "gpusPerPod": 1, "maxPods": 1, "gpuType": "generic", "cost": 1.0},
               {"name": "b", "gpusPerPod": 1, "maxPods": 1, "gpuType": "h100", "cost": 5.0}]
    caplog.set_level(logging.INFO, logger="videojob.admission")
    op = operators(classes, warm_group_ttl_s=4, sweep_interval_s=1).start()
    # `first` is planned long (30 steps of the slow video: the spill compares the wait
    # for a, from that plan, with running on b) and also holds a after its first step (a
    # stall of 45 s at most: step time depends on the machine's load), so `second` is
    # planned while a is busy however slowly the operator picks it up; released once
    # `second` runs.
    release = tmp_path / "release-first"
    op.create(with_fault(one_rank("first", steps=30, video=SLOW_VIDEO), [1], stage="denoise", kind="stall",
                         step=1, seconds=45, release=str(release)))
    wait_for("`first` to run on a", lambda: (videojob(crd, namespace, "first").get("status") or {})
             .get("phase") == "Running", timeout=300)
    op.create(one_rank("second", steps=2))
    wait_for("`second` to run while `first` holds a", lambda: (videojob(crd, namespace, "second").get("status")
                                                               or {}).get("phase") in ("Running", "Succeeded",
                                                                                      "Failed"), timeout=300)
    release.touch()
    ended = {name: op.wait(name, timeout=400)["status"] for name in ("second", "first")}
    assert ended["first"]["phase"] == "Succeeded" and ended["first"]["plan"]["gpuClass"] == "a"
    second = ended["second"]
    assert second["phase"] == "Succeeded", second.get("message")
    assert second["plan"]["gpuClass"] == "b" and second["attempts"][0]["plan"]["gpuClass"] == "b"
    planned = next(c for c in second["conditions"] if c["type"] == "Planned")
    assert "spilled from a" in planned["message"], planned
    groups = {ended[n]["actorGroup"]["name"] for n in ended}
    assert all(ended[n]["actorGroup"]["kept"] for n in ended), [ended[n]["actorGroup"] for n in ended]
    wait_for("both warm groups to expire and be torn down", lambda: not (groups & _groups(ray_client)), timeout=120)
    books = op.controller.admissions.snapshot()
    assert all(c["allocated"] == 0 and c["idle"] == 0 for c in books["classes"].values()), books
    assert 'videojob_warm_group_evictions_total{why="ttl"} 2.0' in op.metrics()
    books_log = "\n".join(r.getMessage() for r in caplog.records if r.name == "videojob.admission")
    for name, klass in (("first", "a"), ("second", "b")):
        group = ended[name]["actorGroup"]["name"]
        assert f"released {namespace}/{name} class={klass} kept={group}" in books_log, books_log[-2000:]
        assert re.search(rf"expired {group} class={klass} .*allocated=0/1 idle=0", books_log), books_log[-2000:]


# Slow (CI time): `make test` covers the sweeper with
# test_scheduling_operator::test_the_sweeper_removes_groups_nobody_owns and test_operator_races'
# sweeper race.
@pytest.mark.slow
def test_the_sweeper_leaves_the_operators_groups_and_removes_an_orphan(operators, crd, namespace,  # noqa: F811
                                                                     ray_client):
    """A group whose job does not exist (left by a driver of a deleted job), an idle
    warm group of a finished job, and the group of a running job: a sweep tears
    down the first only; the books still hold the other two."""
    from videojob.api import parse_videojob
    from videojob.driver_protocol import DriverRequest, GroupRequest, group_name
    from videojob.jobrequest import job_fields, seed_for

    orphan_uid = str(uuid.uuid4())
    orphan = group_name(orphan_uid, "a1")
    doc = one_rank("orphan")
    doc["metadata"].update(uid=orphan_uid, namespace=namespace)
    layout = {"offload": "none", "vaeTiling": False, "vaeSlicing": False, "fp8Weights": False,
              "decodeOffload": False, "cache": "off"}
    request = DriverRequest(namespace=namespace, name="orphan", uid=orphan_uid, attempt=1,
                            group=GroupRequest(name=orphan, device="cpu", keep=True, cpus_per_rank=0.5),
                            job=job_fields(parse_videojob(doc), layout, "orphan", "orphan",
                                           seed_for(parse_videojob(doc))),
                            output_uri="local://videos/orphan")
    sid = f"orphan-{orphan_uid[:8]}"
    ray_client.submit(sid, request.entrypoint(sys.executable), entrypoint_num_cpus=0,
                      metadata={"videojob.io/namespace": namespace, "videojob.io/uid": orphan_uid})
    wait_for("the orphan's driver to end", lambda: (j := ray_client.job(sid)) is not None and j.terminal,
             timeout=300)
    assert orphan in _groups(ray_client), "the orphan's driver kept its group"

    op = operators([{"name": "cpu1", "gpusPerPod": 1, "maxPods": 2}], warm_group_ttl_s=600).start()
    op.create(one_rank("idle", steps=2))
    # `busy` stalls 60 s after its first step, so it is still running during the sweep.
    op.create(with_fault(one_rank("busy", steps=3), [1], stage="denoise", kind="stall", step=1, seconds=60))
    idle = op.wait("idle", timeout=300)["status"]
    assert idle["phase"] == "Succeeded" and idle["actorGroup"]["kept"], idle.get("message")
    busy = wait_for("`busy` to run", lambda: (s := videojob(crd, namespace, "busy").get("status") or {})
                    .get("progress", {}).get("step", 0) >= 1 and s, timeout=300)
    owned = {idle["actorGroup"]["name"], busy["attempts"][-1]["group"]}
    assert len(owned) == 2 and owned <= _groups(ray_client), (owned, _groups(ray_client))
    swept = op.controller.sweep()
    assert swept == {"expired": [], "ownerless": [orphan], "jobsExpired": []}, swept
    wait_for(f"the sweeper's teardown of {orphan}", lambda: orphan not in _groups(ray_client), timeout=90)
    assert owned <= _groups(ray_client), f"an operator's group was torn down: {owned - _groups(ray_client)}"
    books = op.controller.admissions.snapshot()["classes"]["cpu1"]
    assert (books["allocated"], books["idle"]) == (2, 1), books
    # `busy` is deleted, not waited for through the rest of its stall: the finalizer's
    # work frees its GPU and leaves the idle warm group to the books.
    busy_obj = videojob(crd, namespace, "busy")
    op.controller.delete(namespace, "busy", busy_obj["metadata"]["uid"], busy_obj.get("status") or {})
    books = op.controller.admissions.snapshot()["classes"]["cpu1"]
    assert (books["allocated"], books["idle"]) == (1, 1), books


def _finish(crd, namespace: str, name: str, phase: str, ended_ago_s: float, **spec) -> dict:  # noqa: F811
    """A VideoJob made and marked finished ``ended_ago_s`` ago (as the operator writes it)."""
    from datetime import datetime, timedelta, timezone

    doc = one_rank(name)
    doc["spec"].update(spec)
    obj = create(crd, namespace, doc)
    ended = (datetime.now(timezone.utc) - timedelta(seconds=ended_ago_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
    if phase:
        crd.kubectl("patch", "vj", name, "-n", namespace, "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"phase": phase, "completionTime": ended}}))
    return obj


def test_the_sweeper_deletes_finished_jobs_past_their_ttl_and_no_other(operators, crd, namespace):  # noqa: F811
    from videojob.controller.kube import VideoJobs

    op = operators(ttl_seconds_after_finished=600).start()
    _finish(crd, namespace, "at-once", "Succeeded", 1, ttlSecondsAfterFinished=0)
    _finish(crd, namespace, "own-ttl-young", "Failed", 100, ttlSecondsAfterFinished=3600)
    _finish(crd, namespace, "default-old", "Cancelled", 900)
    _finish(crd, namespace, "default-young", "Succeeded", 60)
    _finish(crd, namespace, "unfinished", "Queued", 10_000, ttlSecondsAfterFinished=0)
    swept = op.controller.sweep()
    assert swept["jobsExpired"] == [f"{namespace}/default-old", f"{namespace}/at-once"]  # the longest ended first
    left = set(crd.kubectl("get", "vj", "-n", namespace, "-o", "name").stdout.split())
    assert left == {f"videojob.videojob.io/{n}" for n in ("own-ttl-young", "default-young", "unfinished")}
    assert "videojob_jobs_expired_total 2.0" in op.metrics()
    # A job expired between a listing and the delete, and made again under its name: untouched.
    stale = _finish(crd, namespace, "remade", "Succeeded", 1, ttlSecondsAfterFinished=0)
    crd.kubectl("delete", "vj", "remade", "-n", namespace)
    remade = _finish(crd, namespace, "remade", "", 0)
    assert op.controller.ctx.jobs.delete(namespace, "remade", stale["metadata"]["uid"]) is False
    assert videojob(crd, namespace, "remade")["metadata"]["uid"] == remade["metadata"]["uid"]
    assert isinstance(op.controller.ctx.jobs, VideoJobs) and op.controller.sweep()["jobsExpired"] == []
