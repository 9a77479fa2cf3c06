"""The operator's side of placement and of the driver protocol, with Ray scripted.

The real controller (``Controller``, ``JobLifecycle``) against the real
loopback kube-apiserver (so every status write passes the CRD's schema: a
``Requeued`` attempt, the new condition reasons), with Ray replaced by
``ScriptedRay``: an in-memory ``RayClient`` whose drivers print what the real
driver prints (``driver_protocol`` records) and end as each test scripts it
per attempt. What is checked:

- a group that cannot be placed (NoPlacement) re-queues the job: the attempt is
  recorded as ``Requeued``, does not count against maxAttempts (1 here), its
  GPUs go back to the scheduler's books, the status says Queued with reason
  NoPlacement and what to check; the job then succeeds;
- a placement that never happens fails the job with NoPlacement and its whole
  story once the requeue limit has passed, and not before;
- a driver waiting for its Ray node (PENDING, driver resources), then for a
  node the autoscaler is launching, shows both in the status (WaitingForDriver,
  WaitingForNode with the class);
- a runtime that cannot speak the operator's protocol fails the attempt with
  ProtocolIncompatible and no retry (a 1.1 driver's refusal, and a 1.0
  driver's "Extra inputs are not permitted");
- every driver the operator submits, attempts' and teardowns', asks for the
  driver resources (VIDEOJOB_DRIVER_RESOURCES);
- a restarted operator's queued job writes its place only once it has moved.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import yaml

from operator_harness import create, tiny_job
from videojob.driver_protocol import PROTOCOL, decode_request, record
from videojob.raycluster.client import RayJob
from videojob.settings import OperatorSettings

pytestmark = pytest.mark.cluster
CLASS = "small"
DRIVER_RESOURCES = {"vj-driver": 1.0}


# -- Ray, scripted ------------------------------------------------------------------


@dataclass
class Script:
    """How one attempt's driver goes: PENDING for ``pending_s``, then RUNNING with a
    placement waiting for a node for ``waiting_s``, then (a successful one) its group ready
    and denoising for ``running_s``, then its ``end`` record."""

    end: dict[str, Any]
    pending_s: float = 0.0
    waiting_s: float = 0.0
    running_s: float = 0.0


def succeeded(request: dict[str, Any]) -> dict[str, Any]:
    return {"protocol": PROTOCOL, "ok": True, "steps": 4, "groupName": request["group"]["name"], "groupKept": False,
            "groupReused": False, "framesDigest": "sha256:" + "0" * 64,
            "output": {"uri": request.get("output_uri"), "bytes": 1000},
            "measured": {"peakGiB": 0.01, "loadSeconds": 0.1, "denoiseSeconds": 0.1, "decodeSeconds": 0.1}}


def failed(reason: str, stage: str, message: str, protocol: str | None = PROTOCOL) -> dict[str, Any]:
    end = {"ok": False, "error": {"reason": reason, "stage": stage, "message": message, "groupTornDown": True}}
    return {**end, "protocol": protocol} if protocol else end


NO_PLACEMENT = ("no node could hold vj-x's 2 x {'CPU': 0.5, 'vj-class-small': 1.0} in one pod within 5s "
                "(STRICT_PACK), and the autoscaler launched no node of node type small for 5s of it")


@dataclass
class _Driver:
    sid: str
    entrypoint: str
    resources: dict[str, float] | None
    metadata: dict[str, str]
    submitted: float
    request: dict[str, Any] | None
    script: Script | None
    stopped: bool = False


@dataclass
class ScriptedRay:
    """A ``RayClient`` in memory; ``script(attempt number, request)`` says how each attempt's driver goes."""

    script: Callable[[int, dict[str, Any]], Script]
    drivers: dict[str, _Driver] = field(default_factory=dict)
    live_actors: list[dict[str, Any]] = field(default_factory=list)
    address: str = "scripted-ray"

    def __post_init__(self):
        self.lock = threading.Lock()
        self.reads: list[tuple[str, str, str]] = []  # (logs or tail, submission id, its status then)

    def version(self) -> dict[str, Any]:
        return {"ray_version": "scripted"}

    def submit(self, submission_id: str, entrypoint: str, *, runtime_env=None, metadata=None,
               entrypoint_num_cpus: float = 0, entrypoint_resources=None) -> bool:
        request = None
        if " --request " in entrypoint:
            request = decode_request(entrypoint.split(" --request ", 1)[1].split()[0])[0].model_dump()
        with self.lock:
            if submission_id in self.drivers:
                return False
            script = self.script(request["attempt"], request) if request else None
            self.drivers[submission_id] = _Driver(submission_id, entrypoint, entrypoint_resources,
                                                  dict(metadata or {}), time.monotonic(), request, script)
            return True

    def _state(self, driver: _Driver) -> tuple[str, str]:
        """(Ray job status, logs) now."""
        if driver.script is None:  # a teardown driver: found nothing to remove
            return "SUCCEEDED", record("result", protocol=PROTOCOL, ok=True, removed={}) + "\n"
        script, age = driver.script, time.monotonic() - driver.submitted
        if driver.stopped:
            return "STOPPED", ""
        if age < script.pending_s:
            return "PENDING", ""
        steps = driver.request["job"]["steps"]
        lines = [record("progress", protocol=PROTOCOL, step=0, steps=steps, percent=0, stage="start",
                        state="starting")]
        if script.waiting_s:
            lines.append(record("progress", protocol=PROTOCOL, step=0, steps=steps, percent=0, stage="placement",
                                state="waiting-for-node", nodeType=driver.request["group"]["node_type"],
                                message=f"waiting for a node of class {driver.request['group']['node_type']} (the "
                                        "autoscaler is starting one: 1 launch(es) requested; 3s so far)"))
        if age < script.pending_s + script.waiting_s:
            return "RUNNING", "\n".join(lines) + "\n"
        if script.end.get("ok"):  # the group is ready, the job runs, then the result (as the driver prints them)
            lines += [record("group", protocol=PROTOCOL, name=driver.request["group"]["name"], reused=False, world=2,
                             seconds=script.waiting_s),
                      record("progress", protocol=PROTOCOL, step=1, steps=steps, percent=int(100 / steps),
                             stage="denoise", state="running")]
            if age < script.pending_s + script.waiting_s + script.running_s:
                return "RUNNING", "\n".join(lines) + "\n"
            lines += [record("progress", protocol=PROTOCOL, step=steps, steps=steps, percent=100, stage="decode",
                                     state="running")]
        lines.append(record("result", **script.end))
        return ("SUCCEEDED" if script.end.get("ok") else "FAILED"), "\n".join(lines) + "\n"

    def job(self, submission_id: str) -> RayJob | None:
        with self.lock:
            driver = self.drivers.get(submission_id)
        if driver is None:
            return None
        status, _ = self._state(driver)
        return RayJob(submission_id, status, metadata=driver.metadata)

    def _read(self, kind: str, submission_id: str) -> str:
        with self.lock:
            driver = self.drivers.get(submission_id)
        status, logs = self._state(driver) if driver else ("", "")
        self.reads.append((kind, submission_id, status))
        return logs

    def logs(self, submission_id: str) -> str:
        return self._read("logs", submission_id)

    def log_tail(self, submission_id: str, lines: int, node_id: str | None = None) -> str:
        return "\n".join(self._read("tail", submission_id).splitlines()[-lines:])

    def jobs(self) -> list[RayJob]:
        return [j for j in (self.job(sid) for sid in list(self.drivers)) if j is not None]

    def stop(self, submission_id: str) -> bool:
        with self.lock:
            if submission_id in self.drivers:
                self.drivers[submission_id].stopped = True
                return True
        return False

    def delete(self, submission_id: str) -> bool:
        with self.lock:
            return self.drivers.pop(submission_id, None) is not None

    def actors(self, name_prefix: str = "", alive_only: bool = True,
               where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        return [a for a in self.live_actors if a["name"].startswith(name_prefix)
                and all(a.get(k) == v for k, v in (where or {}).items())]

    def placement_groups(self, name_prefix: str = "", live_only: bool = True,
                         where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        return []

    def attempts(self) -> list[_Driver]:
        return sorted((d for d in self.drivers.values() if d.request), key=lambda d: d.request["attempt"])


# -- the controller --------------------------------------------------------------------


class Run:
    """The controller in this process, over the real API server and a ScriptedRay;
    every status patch recorded with the scheduler's books at that moment."""

    def __init__(self, cluster, namespace: str, tmp_path, ray: ScriptedRay, **settings: Any):
        from kubernetes import config as k8s_config

        from videojob.controller.kube import VideoJobs
        from videojob.controller.operator import Controller

        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({"device": "cpu", "classes": [
            {"name": CLASS, "gpuMemory": "8Gi", "hostMemory": "16Gi", "gpuType": "generic", "gpusPerPod": 2,
             "maxPods": 1}]}))
        base = dict(ray_mode="address", ray_dashboard_url="http://scripted", inventory_file=str(inventory),
                    namespaces=[namespace], metrics_port=0, poll_interval_s=0.1, progress_interval_s=0.1,
                    retry_backoff_s=0.3, driver_resources=DRIVER_RESOURCES, warm_group_ttl_s=0,
                    queue_status_interval_s=0, sweep_interval_s=3600, cpus_per_rank=0.5)
        self.settings = OperatorSettings(**{**base, **settings})
        self.patches: list[tuple[dict[str, Any], dict[str, Any]]] = []
        run = self

        class RecordingJobs(VideoJobs):
            def patch_status(self, ns, name, status, expect=None, uid=None, known=None):
                obj = super().patch_status(ns, name, status, expect, uid, known)
                run.patches.append((status, run.controller.admissions.snapshot()))
                return obj

        api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
        self.ray = ray
        self.controller = Controller(self.settings, ray=ray, jobs=RecordingJobs(api))
        self.controller.start()
        self.cluster, self.namespace = cluster, namespace

    def job(self, name: str, timeout: float = 60) -> dict[str, Any]:
        """Create the tiny job and run its lifecycle to its end; its final object."""
        obj = create(self.cluster, self.namespace, tiny_job(name))
        stopped = threading.Event()
        lifecycle = self.controller.lifecycle(self.namespace, name, obj["metadata"]["uid"])
        thread = threading.Thread(target=lifecycle.run, args=(stopped,), daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            stopped.set()
            thread.join(10)
            raise AssertionError(f"{name}'s lifecycle did not end within {timeout:.0f}s; its patches: "
                                 f"{json.dumps([p for p, _ in self.patches], default=str)[-3000:]}")
        return json.loads(self.cluster.kubectl("get", "vj", name, "-n", self.namespace, "-o", "json").stdout)

    def conditions(self, type_: str) -> list[tuple[str, str, str]]:
        """Every (status, reason, message) written for condition ``type_``, in order, without repeats."""
        seen: list[tuple[str, str, str]] = []
        for patch, _ in self.patches:
            for c in patch.get("conditions") or []:
                item = (c["status"], c["reason"], c["message"])
                if c["type"] == type_ and (not seen or seen[-1] != item):
                    seen.append(item)
        return seen

    def close(self) -> None:
        self.controller.stop()


@pytest.fixture
def run_with(crd, namespace, tmp_path):  # noqa: F811
    runs: list[Run] = []

    def make(ray: ScriptedRay, **settings: Any) -> Run:
        runs.append(Run(crd, namespace, tmp_path, ray, **settings))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


# -- tests -------------------------------------------------------------------------------


def test_no_placement_requeues_without_using_up_attempts_then_succeeds(run_with):
    ray = ScriptedRay(lambda n, req: Script(failed("NoPlacement", "placement", NO_PLACEMENT)) if n <= 2
                      else Script(succeeded(req)))
    run = run_with(ray, max_attempts=1, placement_requeue_limit_s=120)
    obj = run.job("requeued")
    status = obj["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert [a["result"] for a in status["attempts"]] == ["Requeued", "Requeued", "Succeeded"], status["attempts"]
    assert [a["reason"] for a in status["attempts"][:2]] == ["NoPlacement", "NoPlacement"]
    assert NO_PLACEMENT in status["attempts"][0]["message"]
    # While re-queued: Queued, with a reason and what to check, and the GPUs back in the books.
    queued = [(p, books) for p, books in run.patches if p.get("phase") == "Queued"]
    assert len(queued) == 2, [p for p, _ in run.patches]
    for patch, books in queued:
        admitted = next(c for c in patch["conditions"] if c["type"] == "Admitted")
        assert admitted["status"] == "False" and admitted["reason"] == "NoPlacement", admitted
        assert "re-queued, not counted as an attempt" in patch["message"], patch["message"]
        assert f"class {CLASS}'s worker group" in patch["message"] and "VIDEOJOB_PLACEMENT_REQUEUE_LIMIT_S" in \
            patch["message"], patch["message"]
        assert books["classes"][CLASS]["allocated"] == 0, f"the re-queued attempt's GPUs are still booked: {books}"
    assert run.controller.admissions.snapshot()["classes"][CLASS]["allocated"] == 0
    # Three attempts, three drivers; each asks for the driver resources.
    drivers = ray.attempts()
    assert [d.request["attempt"] for d in drivers] == [1, 2, 3]
    assert all(d.resources == DRIVER_RESOURCES for d in drivers), [d.resources for d in drivers]


def test_a_placement_that_never_happens_fails_after_the_requeue_limit(run_with):
    limit = 2.0
    ray = ScriptedRay(lambda n, req: Script(failed("NoPlacement", "placement", NO_PLACEMENT)))
    run = run_with(ray, max_attempts=1, placement_requeue_limit_s=limit, retry_backoff_s=0.5)
    started = time.monotonic()
    obj = run.job("never-placed")
    took = time.monotonic() - started
    status = obj["status"]
    assert status["phase"] == "Failed", json.dumps(status, indent=1)
    completed = next(c for c in status["conditions"] if c["type"] == "Completed")
    assert completed["status"] == "False" and completed["reason"] == "NoPlacement", completed
    results = [a["result"] for a in status["attempts"]]
    assert len(results) >= 2 and set(results) == {"Requeued"}, results
    assert "VIDEOJOB_PLACEMENT_REQUEUE_LIMIT_S" in status["message"] and f"{len(results)} time(s)" in \
        status["message"], status["message"]
    assert "attempt 1 (" in status["message"] and NO_PLACEMENT in status["message"], status["message"]
    assert took >= limit, f"failed after {took:.1f}s, before the {limit:g} s requeue limit"
    assert took < limit + 20, f"the requeue limit ({limit:g} s) did not end it: {took:.1f}s"


def test_a_driver_that_waited_then_runs_no_longer_says_it_waits(run_with):
    """The driver waited for its node (PENDING), then its group was placed at once: while
    it denoises, the job's message is no longer the driver's wait (it was, in CI)."""
    ray = ScriptedRay(lambda n, req: Script(succeeded(req), pending_s=1.0, running_s=2.0))
    run = run_with(ray)
    obj = run.job("waited")
    assert obj["status"]["phase"] == "Succeeded", obj["status"].get("message")
    messages = [p["message"] for p, _ in run.patches if "message" in p]
    assert any("its driver waits" in m for m in messages), messages
    first_wait = next(i for i, m in enumerate(messages) if "its driver waits" in m)
    after = messages[first_wait + 1:]
    assert after and "its driver waits" not in after[0], messages
    assert any(m.startswith("attempt 1: running (denoise)") or "ready" in m for m in after[:-1]), messages
    # While it ran, only the log's last lines were read; the whole log once, at its end.
    reads = [(kind, status) for kind, sid, status in ray.reads if not sid.startswith("vj-teardown")]
    assert ("tail", "RUNNING") in reads, reads
    assert [status for kind, status in reads if kind == "logs"] == ["SUCCEEDED"], reads


def test_waiting_for_the_driver_and_for_a_node_is_shown_in_status(run_with):
    ray = ScriptedRay(lambda n, req: Script(succeeded(req), pending_s=1.0, waiting_s=1.5))
    run = run_with(ray)
    obj = run.job("waits")
    assert obj["status"]["phase"] == "Succeeded"
    shown = run.conditions("ActorsReady")
    reasons = [reason for _, reason, _ in shown]
    assert reasons[:2] == ["WaitingForDriver", "WaitingForNode"] and reasons[-1] in ("ActorsReady", "Running"), shown
    final = next(c for c in obj["status"]["conditions"] if c["type"] == "ActorsReady")
    assert final["status"] == "True", f"a finished job still shows a wait: {final}"
    assert '{"vj-driver": 1.0}' in shown[0][2] and "VIDEOJOB_DRIVER_RESOURCES" in shown[0][2], shown[0]
    assert f"waiting for a node of class {CLASS} (the autoscaler is starting one" in shown[1][2], shown[1]
    messages = [p["message"] for p, _ in run.patches if "message" in p]
    assert any(m.startswith("attempt 1: waiting for a node of class") for m in messages), messages
    # What the driver was told: the node type to wait for, and how long at most.
    (driver,) = ray.attempts()
    assert driver.request["group"]["node_type"] == CLASS
    assert driver.request["placement_max_wait_s"] == run.settings.placement_max_wait_s


@pytest.mark.parametrize("case", ["refused-by-1.1", "refused-by-1.0"])
def test_an_incompatible_runtime_fails_the_attempt_with_its_reason_and_no_retry(run_with, case):
    if case == "refused-by-1.1":
        end = failed("ProtocolIncompatible", "request", "this runtime speaks protocol 1.1; the operator needs "
                     "protocol 2.x: upgrade the RayCluster's runtime image to the operator's version")
    else:  # a driver from before versioned requests: pydantic refused the unknown field
        end = failed("BadRequest", "request", "the driver request does not decode: 1 validation error for "
                     "DriverRequest\ngroup.node_type\n  Extra inputs are not permitted [type=extra_forbidden]",
                     protocol=None)
    ray = ScriptedRay(lambda n, req: Script(end))
    run = run_with(ray, max_attempts=3)
    status = run.job(f"incompatible-{case.split('-')[-1].replace('.', '')}")["status"]
    assert status["phase"] == "Failed", status
    assert [(a["result"], a["reason"]) for a in status["attempts"]] == [("Failed", "ProtocolIncompatible")]
    completed = next(c for c in status["conditions"] if c["type"] == "Completed")
    assert completed["reason"] == "ProtocolIncompatible", completed
    assert "upgrade the RayCluster's runtime image" in status["message"], status["message"]
    assert ("speaks protocol 1.0" in status["message"]) == (case == "refused-by-1.0"), status["message"]


def test_teardown_drivers_ask_for_the_driver_resources_too(run_with):
    """The sweeper's teardown of a group nobody owns is a driver like any other."""
    uid = str(uuid.uuid4())
    orphan = f"vj-{uid}-a1"
    ray = ScriptedRay(lambda n, req: Script(succeeded(req)), live_actors=[{"name": f"{orphan}-rank0"}])
    run = run_with(ray)
    # Its driver is gone long ago; Ray still knows whose it was (a namespaced operator sweeps its own only).
    ray.drivers["vj-orphan-a1"] = _Driver("vj-orphan-a1", "python -m videojob_runtime.driver --request x", None,
                                          {"videojob.io/uid": uid, "videojob.io/namespace": run.namespace},
                                          time.monotonic(), None, None)
    swept = run.controller.sweep()
    assert swept["ownerless"] == [orphan], swept
    teardowns = [d for d in ray.drivers.values() if "--teardown" in d.entrypoint]
    assert len(teardowns) == 1 and f"--teardown {orphan}" in teardowns[0].entrypoint, teardowns
    assert teardowns[0].resources == DRIVER_RESOURCES, teardowns[0]


def test_a_restarted_operators_queued_job_rewrites_its_place_only_once_it_moved(run_with):
    """Jobs a stopped operator left Queued at a place: the new operator's lifecycle
    parks each without a status write while its place is the one shown (a restart with
    10,000 queued jobs wrote 10,000 statuses), and writes the new place once it moved."""
    from videojob.api import parse_videojob
    from videojob.controller.lifecycle import JobLifecycle
    from videojob.planner.classes import plan_classes

    run = run_with(ScriptedRay(lambda n, req: Script(succeeded(req))))
    books = run.controller.admissions
    books.running(f"{run.namespace}/holder", CLASS, 2, 600.0, None, "pool")  # the class is full
    lifecycles = {}
    # Created in this order, and in name order too: the queue orders by priority, then
    # creation second, then name, so both ties break the same way.
    for name, shown in (("a-same", 1), ("b-moved", 3)):
        obj = create(run.cluster, run.namespace, tiny_job(name))
        plan = JobLifecycle._plan_status(plan_classes(parse_videojob(obj).spec, run.controller.inventory))
        run.controller.ctx.jobs.patch_status(run.namespace, name, {
            "phase": "Queued", "plan": plan, "queue": {"position": shown, "waitingFor": "2 free GPUs"},
            "message": "waiting for 2 free GPUs"})
        lifecycles[name] = run.controller.lifecycle(run.namespace, name, obj["metadata"]["uid"])
    run.patches.clear()
    stopped = threading.Event()
    for name in ("a-same", "b-moved"):
        assert lifecycles[name].run(stopped, park=True), f"{name} did not park"
    books.tick()
    assert (books.place(f"{run.namespace}/a-same"), books.place(f"{run.namespace}/b-moved")) == (1, 2)
    for name in ("a-same", "b-moved"):  # woken as the job runner wakes them to show a place
        assert lifecycles[name].run(stopped, park=True), f"{name} did not park again"
    written = [p for p, _ in run.patches]
    assert [p.get("queue", {}).get("position") for p in written] == [2], \
        f"only `b-moved` rewrites its place, to 2: {written}"
    assert lifecycles["a-same"].shown_place() == 1 and lifecycles["b-moved"].shown_place() == 2


def test_a_parked_job_keeps_its_document_compressed_and_runs_it_when_woken(run_with):
    """While a job waits without a thread its lifecycle keeps no parsed models and no
    ``managedFields`` (10,000 queued jobs kept a parsed VideoJob each: issue 22's
    memory goal), only the document it was parsed from, compressed; woken and
    admitted, it runs that same spec to Succeeded, with no extra GET of the job."""
    import zlib

    from pydantic import BaseModel

    run = run_with(ScriptedRay(lambda n, req: Script(succeeded(req))))
    books = run.controller.admissions
    holder = f"{run.namespace}/holder"
    books.running(holder, CLASS, 2, 600.0, None, "pool")  # the class is full: the job parks
    create(run.cluster, run.namespace, tiny_job("parks"))
    obj = run.controller.ctx.jobs.get(run.namespace, "parks")  # as the operator reads it (kubectl hides these)
    assert obj["metadata"].get("managedFields"), "the API server wrote managedFields (what must not be kept)"
    lifecycle = run.controller.lifecycle(run.namespace, "parks", obj["metadata"]["uid"])
    stopped = threading.Event()
    assert lifecycle.run(stopped, park=True), "the job did not park in a full class"
    books.tick()
    assert lifecycle.run(stopped, park=True), "woken to show its place, the job did not park again"

    kept = [(k, type(v).__name__) for k, v in vars(lifecycle).items() if isinstance(v, BaseModel)]
    assert kept == [], f"a parked lifecycle holds parsed models: {kept}"
    blob = lifecycle._parked_job
    assert isinstance(blob, bytes) and len(blob) < 4096, (type(blob), len(blob or b""))
    doc = json.loads(zlib.decompress(blob))
    assert "managedFields" not in doc["metadata"] and "status" not in doc, sorted(doc["metadata"])
    assert doc["spec"] == obj["spec"] and doc["metadata"]["uid"] == obj["metadata"]["uid"]

    gets = [0]
    real_get = run.controller.ctx.jobs.get

    def counted_get(*args, **kwargs):
        gets[0] += 1
        return real_get(*args, **kwargs)

    run.controller.ctx.jobs.get = counted_get
    books.cancel(holder)  # its GPUs free: the next pass admits the parked job
    books.tick()
    assert lifecycle.run(stopped, park=True) is False, "admitted, the job should have run to its end"
    assert gets[0] == 0, f"the woken job read itself again {gets[0]} times (its document was kept)"
    final = run.controller.ctx.jobs.get(run.namespace, "parks")
    assert final["status"]["phase"] == "Succeeded", final["status"]
    assert lifecycle._parked_job is None and lifecycle._document is None
