"""kueue admission mode through the real operator, real Kueue and a real Ray head.

Two teams (namespaces), each with a LocalQueue on its own ClusterQueue, both
ClusterQueues in one cohort with a nominal quota of one CPU rank each on one
flavor (the operator's GPU class, CPU ranks here). The operator's Controller
runs in this process (tests/operator_inprocess.py) with ``admission=kueue``:
each attempt is a Workload that real Kueue admits, borrows for, preempts and
reclaims. Afterwards the books are compared with what Kueue and the API
server hold: every Workload Finished, one per attempt, none left running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from helpers import require_module, wait_for

require_module("ray")
require_module("xfuser")

from kueue_helpers import KueueSetup  # noqa: E402
from operator_harness import create, videojob  # noqa: E402
from operator_inprocess import InProcess, one_rank, with_fault  # noqa: E402

pytestmark = pytest.mark.cluster
STEPS = 8
RANK = {"cpu": "500m", "memory": "64Gi"}  # one CPU rank's Workload: 0.5 CPU, half a 2-rank pod's 16Gi (8Gi) fits


class _Daemon:
    """A job on the operator's job runner as kopf runs it (an async daemon on an event
    loop; parked jobs hold no thread), seen as InProcess sees a lifecycle's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, runner, lifecycle):
        self.loop = loop
        self.event = asyncio.run_coroutine_threadsafe(self._event(), loop).result(10)
        self.future = asyncio.run_coroutine_threadsafe(runner.run(lifecycle, self), loop)

    @staticmethod
    async def _event() -> asyncio.Event:
        return asyncio.Event()

    async def wait(self) -> None:  # kopf's daemon flag
        await self.event.wait()

    def set(self) -> None:
        self.loop.call_soon_threadsafe(self.event.set)

    def join(self, timeout: float) -> None:
        try:
            self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            pass

    def is_alive(self) -> bool:
        return not self.future.done()


class Teams(InProcess):
    """The in-process operator over several namespaces (lifecycles keyed ns/name), each
    job run by the operator's job runner on an event loop, as kopf's daemons run them:
    a job whose Workload waits parks without a thread and its Workload's watch wakes it."""

    def start(self) -> "Teams":
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="teams-loop", daemon=True).start()
        return super().start()

    def create_in(self, namespace: str, doc: dict) -> dict:
        obj = create(self.cluster, namespace, doc)
        self.run_in(namespace, obj["metadata"]["name"])
        return obj

    def run_in(self, namespace: str, name: str) -> None:
        obj = videojob(self.cluster, namespace, name)
        lifecycle = self.controller.lifecycle(namespace, name, obj["metadata"]["uid"])
        daemon = _Daemon(self.loop, self.controller.runner, lifecycle)
        self.threads[f"{namespace}/{name}"] = (daemon, daemon)

    def stop(self) -> None:
        super().stop()
        if getattr(self, "loop", None) is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)

    def wait_in(self, namespace: str, name: str, timeout: float = 600) -> dict:
        thread, _ = self.threads[f"{namespace}/{name}"]
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError(f"{namespace}/{name} did not end within {timeout:.0f}s: "
                                 f"{json.dumps(videojob(self.cluster, namespace, name).get('status'))[-3000:]}")
        return videojob(self.cluster, namespace, name)


@pytest.fixture
def second_namespace(kube_cluster):
    from conftest import _new_namespace

    name = _new_namespace(kube_cluster)
    yield name
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture
def setup(kueue, crd):  # noqa: F811
    with KueueSetup(crd) as made:
        yield made


def _operator(crd, namespaces, tmp_path, ray_head, flavor, **settings) -> Teams:  # noqa: F811
    return Teams(crd, namespaces[0], tmp_path, ray_head, [{"name": flavor, "gpusPerPod": 2, "maxPods": 2}],
                 namespaces=list(namespaces), admission="kueue", kueue_poll_interval_s=0.5, **settings)


def _workloads(cluster, namespace: str) -> list[dict[str, Any]]:
    """Polled: read over the kept-alive client, not a kubectl fork."""
    return cluster.api.get(f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads")["items"]


def _conditions(wl: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (wl.get("status") or {}).get("conditions") or []}


def _phase(cluster, namespace, name) -> str:
    return (videojob(cluster, namespace, name).get("status") or {}).get("phase", "")


def _step(cluster, namespace, name) -> int:
    return int(((videojob(cluster, namespace, name).get("status") or {}).get("progress") or {}).get("step") or 0)


def _slow(name: str, release: Path | None = None, **changes) -> dict:
    """A job whose first attempt stalls 1.5 s after every step (steps the test can count);
    a stall ends early once the attempt is preempted, and every stall is over once the
    test creates the file ``release`` (it acted: the job may finish)."""
    fault = {"release": str(release)} if release is not None else {}
    return with_fault(one_rank(name, steps=STEPS, seed=5, checkpoint={"everySteps": 0}, **changes), [1],
                      stage="denoise", kind="stall", seconds=1.5, **fault)


def _books_match(op: Teams, cluster, jobs: dict[str, list[str]]) -> None:
    """Afterwards: the operator's books hold nothing; every Workload is Finished; each
    job has exactly one Workload per attempt, named in that attempt."""
    snapshot = op.controller.admissions.snapshot()
    assert snapshot["running"] == 0 and snapshot["queued"] == 0, snapshot
    for namespace, names in jobs.items():
        workloads = {w["metadata"]["name"]: w for w in _workloads(cluster, namespace)}
        for wl in workloads.values():
            assert _conditions(wl).get("Finished", {}).get("status") == "True", wl["metadata"]["name"]
        for name in names:
            status = videojob(cluster, namespace, name)["status"]
            uid = videojob(cluster, namespace, name)["metadata"]["uid"]
            mine = sorted(n for n, w in workloads.items() if w["metadata"]["labels"]["videojob.io/uid"] == uid)
            named = sorted(a["workload"] for a in status["attempts"])
            assert mine == named, (name, mine, named)


def test_two_teams_borrow_reclaim_and_every_job_finishes(setup, crd, namespace, second_namespace, tmp_path,
                                                         ray_head):  # noqa: F811
    team_a, team_b = namespace, second_namespace
    flavor = setup.resource_flavor("vj-cpu")
    cohort = setup.unique("vj-fleet")
    queue_a = setup.cluster_queue("team-a", {flavor: RANK}, cohort=cohort)
    queue_b = setup.cluster_queue("team-b", {flavor: RANK}, cohort=cohort)
    setup.local_queue(team_a, "default", queue_a)
    setup.local_queue(team_b, "gpus", queue_b)
    op = _operator(crd, (team_a, team_b), tmp_path, ray_head, flavor).start()
    try:
        # Team A saturates its quota (one rank) and borrows team B's unused one; both run
        # slowly until team B's job has had its quota back.
        release = tmp_path / "release-team-a"
        op.create_in(team_a, _slow("a1", release))
        op.create_in(team_a, _slow("a2", release))
        wait_for("both of team A's jobs to run (one on borrowed quota)",
                 lambda: _step(crd, team_a, "a1") >= 1 and _step(crd, team_a, "a2") >= 1, timeout=300)
        usage = crd.get_json(f"clusterqueues.kueue.x-k8s.io/{queue_a}")["status"]
        borrowed = [r for f in usage.get("flavorsReservation") or [] for r in f["resources"]
                    if r["name"] == "cpu" and r.get("borrowed") not in (None, "0")]
        assert borrowed, f"team A runs two ranks on a one-rank quota, so it borrows: {usage}"
        # Team B's job is admitted within B's own quota: Kueue reclaims it from A.
        b1 = one_rank("b1", steps=2)
        b1["spec"]["queueName"] = "gpus"  # team B's LocalQueue is not the default's name
        op.create_in(team_b, b1)
        b1 = op.wait_in(team_b, "b1")["status"]
        release.touch()
        assert b1["phase"] == "Succeeded", json.dumps(b1)[-2000:]
        a = {n: op.wait_in(team_a, n)["status"] for n in ("a1", "a2")}
        assert all(s["phase"] == "Succeeded" for s in a.values()), json.dumps(a)[-3000:]
        reclaimed = [(n, s) for n, s in a.items() if s["attempts"][0]["result"] == "Preempted"]
        assert len(reclaimed) == 1, f"exactly one of team A's jobs gives B's quota back: {json.dumps(a)[-3000:]}"
        name, status = reclaimed[0]
        first, second = status["attempts"]
        assert "Kueue" in first["message"] and first["reason"], first
        assert second["result"] == "Succeeded" and second["resumedFromStep"] == first["stepsComputed"], second
        queued = [p for _, p, _ in op.patches_of(name) if p.get("phase") == "Queued"]
        assert any("KueueEvicted" in json.dumps(p) for p in queued), "the preempted job showed Queued, by Kueue"
        _books_match(op, crd, {team_a: ["a1", "a2"], team_b: ["b1"]})
    finally:
        op.stop()


def test_a_deactivated_workload_pauses_its_job_until_a_workload_of_it_is_active_again(
        setup, crd, namespace, tmp_path, ray_head):  # noqa: F811
    """Issue 36, 9: a Workload deactivated by hand (spec.active false: Kueue's way to pause a job)
    was treated as a preemption: the next attempt made a new, active Workload that Kueue admitted
    at once, so the job ran on. Now the attempt stops at a checkpoint, the next Workload is made
    inactive, the status says which and how to resume; activated, the job resumes and finishes."""
    flavor = setup.resource_flavor("vj-cpu")
    setup.local_queue(namespace, "default", setup.cluster_queue("paused", {flavor: RANK}))
    op = _operator(crd, (namespace,), tmp_path, ray_head, flavor).start()
    try:
        op.create_in(namespace, _slow("paused"))
        wait_for("`paused` to pass step 1", lambda: _step(crd, namespace, "paused") >= 1, timeout=300)
        first = videojob(crd, namespace, "paused")["status"]["attempts"][0]["workload"]
        crd.kubectl("patch", "workloads.kueue.x-k8s.io", first, "-n", namespace, "--type", "merge",
                    "-p", json.dumps({"spec": {"active": False}}))
        second = wait_for("a second Workload of `paused`", lambda: next(
            (w for w in _workloads(crd, namespace) if w["metadata"]["name"] != first), None), timeout=120)
        assert second["spec"].get("active") is False, "the next attempt's Workload was made active: the pause is lost"
        status = wait_for("`paused` to say it waits for its Workload", lambda: (s := videojob(
            crd, namespace, "paused")["status"]).get("message", "").startswith(f"Workload {second['metadata']['name']}")
            and s, timeout=60)
        assert status["phase"] == "Queued" and "kubectl patch workloads.kueue.x-k8s.io" in status["message"]
        admitted = {c["type"]: c for c in status["conditions"]}["Admitted"]
        assert (admitted["status"], admitted["reason"]) == ("False", "KueueDeactivated"), admitted
        stopped = status["attempts"][0]
        assert (stopped["result"], stopped["reason"]) == ("Preempted", "Deactivated"), stopped
        assert "its Workload was deactivated" in stopped["message"], stopped["message"]
        assert not _conditions(second).get("QuotaReserved", {}).get("status") == "True", "Kueue admitted it"

        crd.kubectl("patch", "workloads.kueue.x-k8s.io", second["metadata"]["name"], "-n", namespace,
                    "--type", "merge", "-p", json.dumps({"spec": {"active": True}}))
        status = op.wait_in(namespace, "paused")["status"]
        assert status["phase"] == "Succeeded", json.dumps(status)[-2000:]
        done = status["attempts"]
        assert [a["result"] for a in done] == ["Preempted", "Succeeded"], done
        assert done[1]["resumedFromStep"] >= 1 and done[1]["workload"] == second["metadata"]["name"], done
        _books_match(op, crd, {namespace: ["paused"]})
    finally:
        op.stop()


# Slow (CI time): `make test` covers Kueue preemption with
# test_kueue_cluster::test_preemption_and_release_by_the_owner and the operator with Kueue with the
# two-teams test.
@pytest.mark.slow
def test_priority_preempts_an_oversized_job_says_so_deletion_and_restart_lose_nothing(
        setup, crd, namespace, tmp_path, ray_head):  # noqa: F811
    flavor = setup.resource_flavor("vj-cpu")
    setup.local_queue(namespace, "default", setup.cluster_queue("solo", {flavor: RANK}))
    setup.local_queue(namespace, "tiny", setup.cluster_queue("tiny", {flavor: {"cpu": "100m", "memory": "64Gi"}}))
    op = _operator(crd, (namespace,), tmp_path, ray_head, flavor).start()
    try:
        # A job larger than any quota says so and never runs.
        big = one_rank("big", steps=2)
        big["spec"]["queueName"] = "tiny"
        op.create_in(namespace, big)
        said = wait_for("`big` to show why Kueue does not admit it", lambda: (s := videojob(crd, namespace, "big").get(
            "status") or {}).get("phase") == "Queued" and "maximum capacity" in s.get("message", "") and s,
            timeout=120)
        assert said["message"].startswith("waiting for Kueue (LocalQueue tiny"), said["message"]
        # It waits parked: no thread of the runner is its until its Workload changes.
        wait_for("`big` to wait for its Workload parked (no thread)", lambda: op.controller.runner.parked == 1,
                 timeout=30)
        admitted = {c["type"]: c for c in said["conditions"]}["Admitted"]
        assert admitted["status"] == "False" and admitted["reason"] == "KueuePending", admitted
        # A low job runs; a high one preempts it (withinClusterQueue: LowerPriority).
        op.create_in(namespace, _slow("low"))
        wait_for("`low` to pass step 1", lambda: _step(crd, namespace, "low") >= 1, timeout=300)
        high = one_rank("high", steps=2)
        high["spec"]["resources"]["priority"] = 50
        op.create_in(namespace, high)
        assert op.wait_in(namespace, "high")["status"]["phase"] == "Succeeded"
        low = op.wait_in(namespace, "low")["status"]
        assert low["phase"] == "Succeeded", json.dumps(low)[-3000:]
        assert [a["result"] for a in low["attempts"]] == ["Preempted", "Succeeded"], low["attempts"]
        assert low["attempts"][0]["reason"] in ("Preempted", "InClusterQueue"), low["attempts"][0]
        wpc = crd.get_json("workloadpriorityclasses.kueue.x-k8s.io/videojob-priority-50")
        assert wpc["value"] == 50
        # The oversized job never ran; deleting it deletes its Workload.
        assert not (videojob(crd, namespace, "big").get("status") or {}).get("attempts")
        obj = videojob(crd, namespace, "big")
        crd.kubectl("delete", "vj", "big", "-n", namespace)
        op.controller.delete(namespace, "big", obj["metadata"]["uid"], obj.get("status") or {})
        wait_for("big's Workload to be gone", lambda: not [
            w for w in _workloads(crd, namespace) if w["metadata"]["labels"]["videojob.io/uid"] == obj["metadata"]["uid"]
        ], timeout=60)

        # A restart while one Workload is admitted (its job running) and one pending.
        release_r1 = tmp_path / "release-r1"  # once the restarted operator runs r1 and r2
        op.create_in(namespace, _slow("r1", release_r1))
        wait_for("`r1` to pass step 1", lambda: _step(crd, namespace, "r1") >= 1, timeout=300)
        op.create_in(namespace, one_rank("r2", steps=2))
        wait_for("`r2` to wait for Kueue", lambda: "Kueue" in (videojob(crd, namespace, "r2").get("status") or {})
                 .get("message", ""), timeout=60)
    finally:
        op.stop()
    again = _operator(crd, (namespace,), tmp_path, ray_head, flavor).start()
    try:
        for name in ("r1", "r2"):
            again.run_in(namespace, name)
        wait_for("the restarted operator to write r1's status", lambda: again.patches_of("r1"), timeout=120)
        release_r1.touch()
        for name in ("r1", "r2"):
            status = again.wait_in(namespace, name)["status"]
            assert status["phase"] == "Succeeded", json.dumps(status)[-2000:]
            assert [a["result"] for a in status["attempts"]] == ["Succeeded"], status["attempts"]
        _books_match(again, crd, {namespace: ["low", "high", "r1", "r2"]})
    finally:
        again.stop()


def test_admitted_on_another_class_flavor_the_job_is_replanned_for_it(setup, crd, namespace, tmp_path,
                                                                     ray_head):  # noqa: F811
    """The planner prefers the cheaper class; the ClusterQueue has no quota there, so
    Kueue admits the Workload on the other class's flavor: the job runs that class's plan."""
    cheap, other = setup.resource_flavor("vj-cheap"), setup.resource_flavor("vj-other")
    queue = setup.cluster_queue("spill", {cheap: {"cpu": "0", "memory": "64Gi"}, other: RANK})
    setup.local_queue(namespace, "default", queue)
    op = Teams(crd, namespace, tmp_path, ray_head,
               [{"name": cheap, "gpusPerPod": 2, "maxPods": 2, "cost": 1.0},
                {"name": other, "gpusPerPod": 2, "maxPods": 2, "cost": 3.0}],
               admission="kueue", kueue_poll_interval_s=0.5).start()
    try:
        op.create_in(namespace, one_rank("spilled", steps=2))
        status = op.wait_in(namespace, "spilled")["status"]
        assert status["phase"] == "Succeeded", json.dumps(status)[-2000:]
        (attempt,) = status["attempts"]
        assert attempt["plan"]["gpuClass"] == other and status["plan"]["gpuClass"] == other, attempt
        assert attempt["workload"].endswith(cheap), attempt  # asked for the planned class, admitted on the other
        planned = {c["type"]: c for c in status["conditions"]}["Planned"]
        assert f"flavor {other}" in planned["message"] and f"not the planned {cheap}" in planned["message"], planned
        _books_match(op, crd, {namespace: ["spilled"]})
        # Its deletion, as kopf's finalizer calls it when the object is already gone from the
        # API server (there is no finalizer on it here): the status cannot be re-read, so the
        # event's copy is used; its Workloads go with it; a late status write finds it gone.
        from videojob.controller.kube import Gone

        obj = videojob(crd, namespace, "spilled")
        assert _workloads(crd, namespace), "the finished job's Workload is still there before its deletion"
        crd.kubectl("delete", "vj", "spilled", "-n", namespace, "--wait=false")
        wait_for("the VideoJob to be gone", lambda: crd.api.get(
            f"/apis/videojob.io/v1alpha1/namespaces/{namespace}/videojobs/spilled") is None, timeout=30)
        op.controller.delete(namespace, "spilled", obj["metadata"]["uid"], obj["status"])
        assert not _workloads(crd, namespace), "the job's Workloads were deleted with it"
        with pytest.raises(Gone):
            op.controller.ctx.jobs.patch_status(namespace, "spilled", {"phase": "Running"})
    finally:
        op.stop()


def test_the_workload_calls_and_the_watch_meet_what_a_restart_and_a_deletion_leave(setup, crd, namespace, caplog):
    """KueueApi and its Workload watch against the real API server and Kueue's CRDs, in the
    states an operator restart and a job's deletion leave (the slow story above runs them
    through the operator): a restarted operator's create finds the Workload already there;
    a new watch lists what exists; a deletion reaches the watch; a name the watch has not
    seen is asked of the API server (None once gone); a watch whose API server is away
    says so and lists again."""
    import logging
    import uuid

    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    from videojob.inventory import parse_inventory
    from videojob.kueue import KueueApi, WorkloadCache, workload_for

    inventory = parse_inventory({"device": "cpu", "classes": [{"name": "cpu2", "gpusPerPod": 2, "maxPods": 1,
                                                               "gpuMemory": "8Gi", "hostMemory": "16Gi"}]})
    body = workload_for(namespace=namespace, name="story", uid=str(uuid.uuid4()), attempt=1,
                        plan={"gpuClass": "cpu2", "gpus": 1}, queue="no-such-queue", priority=0,
                        inventory=inventory, cpus_per_rank=None)
    body["metadata"].pop("ownerReferences")  # no VideoJob owns it here: the garbage collector would take it
    body["spec"].pop("priorityClassRef", None)
    name = body["metadata"]["name"]
    api = k8s_config.new_client_from_config(config_file=str(crd.kubeconfig))
    before = KueueApi(api, [namespace], watch=False)
    made = before.create(body)
    again = before.create(body)  # a restarted operator makes the Workload its attempt already has
    assert again["metadata"]["uid"] == made["metadata"]["uid"]

    after = KueueApi(api, [namespace])  # the restarted operator's watch lists what exists
    try:
        wait_for("the new watch to list the namespace", lambda: after.cache.synced(namespace), timeout=30)
        assert after.cache.get(namespace, name)[0], "the listed Workload is known to the watch"
        assert after.get(namespace, name)["metadata"]["uid"] == made["metadata"]["uid"]
        assert after.get(namespace, "never-made") is None, "not seen by the watch: asked, and not found"
        after.delete(namespace, name)
        wait_for("the watch to see the deletion", lambda: not after.cache.get(namespace, name)[0], timeout=30)
        assert after.get(namespace, name) is None
        after.delete(namespace, name)  # gone already: nothing to do
    finally:
        after.cache.stop()

    caplog.set_level(logging.WARNING, logger="videojob.kueue")
    away = k8s.Configuration()
    away.host = "https://127.0.0.1:9"  # nothing listens
    cache = WorkloadCache(k8s.CustomObjectsApi(k8s.ApiClient(away)), [namespace]).start()
    try:
        wait_for("the watch to say its API server is away", lambda: "the watch of Workloads in" in caplog.text,
                 timeout=30)
        assert not cache.synced(namespace)
    finally:
        cache.stop()
