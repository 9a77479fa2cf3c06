"""Scheduling through the real operator: gang admission under a capacity,
priority, warm groups (reuse, eviction, the sweeper), re-plan after an
out-of-memory failure, retry after a lost rank, and jobs that can never fit.

A real kube-apiserver, a real Ray head of this module, the operator as a
subprocess under the chart's RBAC rules, the tiny CPU model. One namespace
per test. Inventories here are CPU ranks with classes of 1 or 2 ranks a pod.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import uuid

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required
import yaml

require_module("ray")
require_module("xfuser")

from helpers import wait_for  # noqa: E402
from operator_harness import OperatorProcess, create, tiny_job, videojob, wait_phase  # noqa: E402
from operator_inprocess import with_fault  # noqa: E402

pytestmark = pytest.mark.cluster
ADMISSION = re.compile(r"admission: (admitted|released|evicted|expired) (\S+) class=(\S+) .*allocated=(\d+)/(\d+)")


def _inventory(path, classes: list[dict]) -> str:
    path.write_text(yaml.safe_dump({"device": "cpu", "classes": [
        {"gpuMemory": "8Gi", "hostMemory": "16Gi", "gpuType": "generic", **c} for c in classes]}))
    return str(path)


def _env(ray_head, tmp_path, classes: list[dict], **extra: str) -> dict[str, str]:
    import sys

    token = tmp_path / "ray-token"
    token.write_text(ray_head.token)
    return {"VIDEOJOB_RAY_MODE": "address", "VIDEOJOB_RAY_DASHBOARD_URL": ray_head.dashboard_url,
            "VIDEOJOB_RAY_TOKEN_FILE": str(token), "VIDEOJOB_DRIVER_PYTHON": sys.executable,
            "VIDEOJOB_INVENTORY_FILE": _inventory(tmp_path / "inventory.yaml", classes),
            "VIDEOJOB_CPUS_PER_RANK": "0.5", "VIDEOJOB_RETRY_BACKOFF_S": "1", **extra}


def _one_rank(name: str, **changes) -> dict:
    doc = tiny_job(name, **changes)
    doc["spec"].pop("parallel", None)
    doc["spec"]["resources"] = {**doc["spec"].get("resources", {}), "maxGPUs": 1}
    return doc


def _groups(ray_client) -> set[str]:
    from videojob.controller.groups import groups_in_ray

    return set(groups_in_ray(ray_client))


def _cleanup(cluster, namespace: str, ray_client, names: list[str]) -> None:
    """Delete the jobs while the operator runs (its finalizer removes kept groups); nothing of them is left."""
    uids = [videojob(cluster, namespace, name)["metadata"]["uid"] for name in names]
    for name in names:
        cluster.kubectl("delete", "vj", name, "-n", namespace, "--wait=false", check=False)
    wait_for("the test's VideoJobs to be gone",
             lambda: not cluster.api.get(f"/apis/videojob.io/v1alpha1/namespaces/{namespace}/videojobs")["items"],
             timeout=60)
    wait_for("no group of this test's jobs in Ray",
             lambda: not any(u in g for g in _groups(ray_client) for u in uids), timeout=60)


# 7 jobs (capacity 3: four still queue when the urgent one comes) and 20. Slow (CI time): `make test`
# covers priority first with test_operator_books' restart with queued jobs and capacity with the
# scheduler's property tests.
@pytest.mark.slow
@pytest.mark.parametrize("count", [7, 20])
def test_jobs_never_exceed_capacity_and_priority_goes_first(crd, namespace, ray_head, ray_client,  # noqa: F811
                                                            roots, tmp_path, count):
    """``count`` tiny one-rank jobs, capacity 3 (three 1-rank pods): all finish; the
    groups alive in Ray never exceed 3; the books never do; a job created later
    with a higher priority starts before the lower ones still queued; a queued
    job shows its place and what it waits for in `kubectl get vj`."""
    env = _env(ray_head, tmp_path, [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 3}])
    samples: list[int] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                live = [pg for pg in ray_client.placement_groups("vj-") if pg.get("state") == "CREATED"]
                samples.append(len(live))
            except Exception:  # noqa: BLE001 - a slow answer: the next sample
                pass
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    names = [f"job-{i:02d}" for i in range(count)]
    with OperatorProcess(crd, namespace, roots["work"], env) as operator:
        sampler.start()
        try:
            for name in names:
                create(crd, namespace, _one_rank(name, steps=6))
            wait_for("a job to be Queued with its place shown by kubectl",
                     lambda: re.search(r"Queued\s+(?:\d+\s+)?1\s+cpu1\s+\d+",
                                       crd.kubectl("get", "vj", "-n", namespace).stdout), timeout=120)
            create(crd, namespace, _one_rank("urgent", steps=6, resources={"priority": 10}))
            wait_for("the operator to queue the urgent job",
                     lambda: (videojob(crd, namespace, "urgent").get("status") or {}).get("phase")
                     in ("Queued", "Running", "Succeeded"), timeout=60)
            admitted_before = {m.group(2) for m in ADMISSION.finditer(operator.log()) if m.group(1) == "admitted"}
            for name in names + ["urgent"]:
                obj = wait_phase(crd, namespace, name, {"Succeeded", "Failed"}, timeout=600)
                assert obj["status"]["phase"] == "Succeeded", (name, obj["status"].get("message"))
        finally:
            stop.set()
            sampler.join(10)
        log = operator.log()
        order = [m.group(2) for m in ADMISSION.finditer(log) if m.group(1) == "admitted"]
        books = [int(m.group(4)) for m in ADMISSION.finditer(log)]
        assert books and max(books) <= 3 and all(int(m.group(5)) == 3 for m in ADMISSION.finditer(log))
        assert samples and max(samples) <= 3, f"Ray held {max(samples)} groups at once"
        assert len(samples) > 20, "the sampler saw too little to prove anything"
        urgent = order.index(f"{namespace}/urgent")
        later = [k for k in order if k not in admitted_before and k != f"{namespace}/urgent"]
        assert later, "every low-priority job had started before the urgent one was queued: nothing to compare"
        assert all(order.index(k) > urgent for k in later), (order, admitted_before)
        reused = sum(1 for name in names if videojob(crd, namespace, name)["status"]["actorGroup"]["reused"])
        assert reused >= count // 2, f"only {reused} of {count} same-model jobs reused a warm group"
        _cleanup(crd, namespace, ray_client, names + ["urgent"])


def test_a_job_that_needs_an_idle_groups_ranks_evicts_it(crd, namespace, ray_head, ray_client, roots,  # noqa: F811
                                                        tmp_path):
    """`make test`'s part of the story below: a finished one-rank job keeps its group; a
    two-rank job on the two-rank pod needs those ranks, so the operator tears the idle
    group down before it runs."""
    env = _env(ray_head, tmp_path, [{"name": "cpu2", "gpusPerPod": 2, "maxPods": 1}])
    with OperatorProcess(crd, namespace, roots["work"], env) as operator:
        group = _run_and_keep_the_group(crd, namespace, ray_client, "first")
        _run_big_evicting(crd, namespace, ray_client, operator, group)
        _cleanup(crd, namespace, ray_client, ["first", "big"])


def _run_and_keep_the_group(crd, namespace, ray_client, name: str) -> str:  # noqa: F811
    """A one-rank job that succeeds and keeps its group (its name)."""
    first = wait_phase(crd, namespace, create(crd, namespace, _one_rank(name))["metadata"]["name"],
                       {"Succeeded", "Failed"})
    assert first["status"]["phase"] == "Succeeded", first["status"].get("message")
    group = first["status"]["actorGroup"]["name"]
    assert first["status"]["actorGroup"]["kept"] and group in _groups(ray_client)
    return group


def _run_big_evicting(crd, namespace, ray_client, operator, group: str) -> None:  # noqa: F811
    """`big` (two ranks) runs on the two-rank pod after the idle ``group`` is torn down for it."""
    create(crd, namespace, tiny_job("big"))
    obj = wait_phase(crd, namespace, "big", {"Succeeded", "Failed"})
    assert obj["status"]["phase"] == "Succeeded", obj["status"].get("message")
    assert obj["status"]["plan"]["gpus"] == 2
    assert group not in _groups(ray_client), "the evicted group is gone"
    assert re.search(rf"admitted {namespace}/big .*evict={re.escape(group)}", operator.log())
    assert 'videojob_warm_group_evictions_total{why="needed"} 1.0' in operator.metrics()


# Slow (CI time): `make test` runs its eviction above; the reuse is test_driver's kept group and
# test_operator_races' restart on a reused warm group.
@pytest.mark.slow
def test_warm_reuse_and_eviction(crd, namespace, ray_head, ray_client, roots, tmp_path):  # noqa: F811
    """The second job with the same model, layout and class runs on the first's
    group and loads no weights; a job that needs the idle group's ranks evicts it."""
    from videojob.driver_protocol import result_of

    env = _env(ray_head, tmp_path, [{"name": "cpu2", "gpusPerPod": 2, "maxPods": 1}])
    with OperatorProcess(crd, namespace, roots["work"], env) as operator:
        group = _run_and_keep_the_group(crd, namespace, ray_client, "first")
        create(crd, namespace, _one_rank("second"))
        second = wait_phase(crd, namespace, "second", {"Succeeded", "Failed"})
        assert second["status"]["phase"] == "Succeeded", second["status"].get("message")
        assert second["status"]["attempts"][-1]["group"] == group
        assert second["status"]["actorGroup"]["reused"] is True
        logs = ray_client.logs(second["status"]["attempts"][-1]["submissionId"])
        result = result_of(logs)
        # `loads` counts over the group's life: still the first job's one load.
        assert result["reused"] is True and result["loads"] == 1, "the warm pipeline was reused: no weights loaded"
        # Two ranks on the 2-rank pod: the idle 1-rank group must go.
        _run_big_evicting(crd, namespace, ray_client, operator, group)
        assert re.search(r'videojob_warm_groups\{model="tiny-cogvideox"\} 1\.0', operator.metrics())
        _cleanup(crd, namespace, ray_client, ["first", "second", "big"])


# Slow (CI time): `make test` covers the replan with
# test_operator_retries::test_two_out_of_memory_failures_compound_the_margin.
@pytest.mark.slow
def test_out_of_memory_is_replanned_stricter_and_succeeds(crd, namespace, ray_head, ray_client, roots,  # noqa: F811
                                                          tmp_path):
    env = _env(ray_head, tmp_path, [{"name": "cpu2", "gpusPerPod": 2, "maxPods": 1}],
               VIDEOJOB_ALLOW_FAULT_INJECTION="1", VIDEOJOB_WARM_GROUP_TTL_S="0")
    doc = tiny_job("oom")
    doc["metadata"]["annotations"] = {"videojob.io/inject-fault": json.dumps(
        {"attempts": [1], "stage": "denoise", "kind": "oom", "step": 1})}
    with OperatorProcess(crd, namespace, roots["work"], env):
        create(crd, namespace, doc)
        obj = wait_phase(crd, namespace, "oom", {"Succeeded", "Failed"})
    status = obj["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    first, second = status["attempts"]
    assert (first["result"], first["reason"]) == ("OutOfMemory", "OutOfMemory")
    assert second["result"] == "Succeeded"
    assert first["plan"]["summary"] != second["plan"]["summary"], "the re-plan chose a stricter layout"
    assert status["plan"] == second["plan"]
    assert any(c["reason"] == "Replanned" for c in status["conditions"])


# Slow (CI time): `make test` covers a lost rank retried with
# test_operator_checkpoints::test_a_lost_rank_resumes_from_its_checkpoint.
@pytest.mark.slow
def test_a_killed_rank_is_retried_and_succeeds(crd, namespace, ray_head, ray_client, roots, tmp_path):  # noqa: F811
    env = _env(ray_head, tmp_path, [{"name": "cpu2", "gpusPerPod": 2, "maxPods": 1}],
               VIDEOJOB_ALLOW_FAULT_INJECTION="1", VIDEOJOB_WARM_GROUP_TTL_S="0")
    with OperatorProcess(crd, namespace, roots["work"], env):
        # The first attempt stalls 120 s after step 1 (not "many steps": their time depends on the
        # load), so rank 1 is killed mid-run; the driver stops the other rank 5 s after it dies.
        create(crd, namespace, with_fault(tiny_job("victim", steps=3), [1], stage="denoise", kind="stall",
                                          step=1, seconds=120))
        wait_for("the job to make progress", lambda: ((videojob(crd, namespace, "victim").get("status") or {})
                                                      .get("progress") or {}).get("step", 0) >= 1, timeout=180)
        group = videojob(crd, namespace, "victim")["status"]["attempts"][0]["group"]
        rank1 = next(a for a in ray_client.actors(f"{group}-rank1"))
        os.kill(int(rank1["pid"]), signal.SIGKILL)
        obj = wait_phase(crd, namespace, "victim", {"Succeeded", "Failed"}, timeout=300)
    status = obj["status"]
    assert status["phase"] == "Succeeded", status.get("message")
    assert [a["result"] for a in status["attempts"]] == ["Lost", "Succeeded"], status["attempts"]
    assert status["attempts"][0]["reason"] in ("ActorDied", "RayError", "DriverLost")
    assert group not in _groups(ray_client), "the broken group was removed"


def test_jobs_that_can_never_fit_fail_at_once(crd, namespace, ray_head, roots, tmp_path):  # noqa: F811
    env = _env(ray_head, tmp_path, [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 4}])
    with OperatorProcess(crd, namespace, roots["work"], env):
        start = time.monotonic()
        create(crd, namespace, tiny_job("wide"))  # ulysses 2: no pod has 2 ranks, though 4 are free
        create(crd, namespace, _one_rank("pinned", resources={"gpuClass": "h100"}))
        wide = wait_phase(crd, namespace, "wide", {"Failed", "Succeeded"}, timeout=60)
        pinned = wait_phase(crd, namespace, "pinned", {"Failed", "Succeeded"}, timeout=60)
        took = time.monotonic() - start
    assert wide["status"]["phase"] == "Failed" and "cpu1" in wide["status"]["message"]
    assert any(c["reason"] == "DoesNotFit" for c in wide["status"]["conditions"])
    assert pinned["status"]["phase"] == "Failed"
    assert "spec.resources.gpuClass" in pinned["status"]["message"] and "cpu1" in pinned["status"]["message"]
    assert took < 30, f"failing took {took:.0f}s: they should not wait"


def test_the_sweeper_removes_groups_nobody_owns(crd, namespace, ray_head, ray_client, roots, tmp_path):  # noqa: F811
    """A group left by a driver whose VideoJob does not exist (a job deleted while
    no operator ran) is torn down by the sweeper; the operator's own are not."""
    import sys

    from videojob.driver_protocol import DriverRequest, GroupRequest, group_name
    from videojob.jobrequest import job_fields, seed_for
    from videojob.api import parse_videojob

    orphan_uid = str(uuid.uuid4())
    group = group_name(orphan_uid, "a1")
    doc = _one_rank("orphan")
    doc["metadata"]["uid"] = orphan_uid
    job = parse_videojob(doc)
    layout = {"offload": "none", "vaeTiling": False, "vaeSlicing": False, "fp8Weights": False,
              "decodeOffload": False, "cache": "off"}
    request = DriverRequest(namespace=namespace, name="orphan", uid=orphan_uid, attempt=1,
                            group=GroupRequest(name=group, device="cpu", keep=True, cpus_per_rank=0.5),
                            job=job_fields(job, layout, "orphan", "orphan", seed_for(job)),
                            output_uri="local://videos/orphan")
    sid = f"orphan-{orphan_uid[:8]}"
    ray_client.submit(sid, request.entrypoint(sys.executable), entrypoint_num_cpus=0,
                      metadata={"videojob.io/namespace": namespace, "videojob.io/uid": orphan_uid})
    wait_for("the orphan's driver to finish", lambda: (j := ray_client.job(sid)) is not None and j.terminal,
             timeout=180)
    assert group in _groups(ray_client), "the driver kept its group (the orphan the sweeper must find)"
    env = _env(ray_head, tmp_path, [{"name": "cpu2", "gpusPerPod": 2, "maxPods": 1}],
               VIDEOJOB_SWEEP_INTERVAL_S="1")
    with OperatorProcess(crd, namespace, roots["work"], env) as operator:
        wait_for(f"the sweeper to remove {group}", lambda: group not in _groups(ray_client), timeout=60)
        assert "its owner no longer exists" in operator.log()
