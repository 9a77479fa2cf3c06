"""Ray hygiene: the operator's drivers leave Ray's job table, the sweeper's cost
stays bounded, and a driver's request carries no secret.

Real parts: the loopback kube-apiserver (``namespace``), a real Ray head with
its dashboard, ``HttpRayClient`` (wrapped only to count requests and bytes),
and the operator's own code in this process (``Controller``, ``JobLifecycle``)
as ``tests/test_placement_operator.py`` runs it. The drivers are real Ray jobs
whose entrypoint is a stand-in for ``python -m videojob_runtime.driver``: a
stdlib-only script that reads the real request and prints the records a driver
prints (the group, a result) at once. Why: a Ray job costs about a second of
CPU (its supervisor is a fresh worker process) even when its entrypoint does
nothing; a diffusion run on top would make 200 jobs take an hour on 2 cores,
while the job table, the deletes and the sweeper's reads are the same either way.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml

from helpers import RayHead, wait_for
from videojob.controller.hygiene import ledger
from operator_harness import tiny_job

pytestmark = pytest.mark.cluster
GROUP, VERSION, PLURAL = "videojob.io", "v1alpha1", "videojobs"

FAKE_DRIVER = r'''
import base64, json, sys, time
PROTOCOL = %(protocol)r
def rec(kind, **fields):
    print("@@videojob " + json.dumps({"type": kind, "protocol": PROTOCOL, **fields}), flush=True)
args = sys.argv[1:]
if "--teardown" in args:
    rec("result", ok=True, removed={})
    sys.exit(0)
req = json.loads(base64.urlsafe_b64decode(args[args.index("--request") + 1]))
group, how = req["group"]["name"], req["job"].get("negative_prompt") or ""
if how == "hang":
    time.sleep(600)
if how == "lose-first" and req["attempt"] == 1:
    rec("result", ok=False, error={"reason": "ActorDied", "stage": "denoise", "message": "rank 1 died (scripted)",
                                   "groupTornDown": False})
    sys.exit(1)
rec("group", name=group, reused=False, world=1, seconds=0.0)
rec("result", ok=True, steps=req["job"]["steps"], groupName=group, groupKept=req["group"]["keep"],
    groupReused=False, framesDigest="sha256:" + "0" * 64,
    output={"uri": (req.get("output_uri") or "local://videos") + "/" + req["name"] + ".mp4", "bytes": 1000},
    measured={"peakGiB": 0.01})
'''


@pytest.fixture(scope="module")
def head():
    with RayHead(num_cpus=2, dashboard=True) as ray_head:
        yield ray_head


def _counting_client(head):
    """``HttpRayClient`` that counts its requests and the bytes it reads, per thread, and records submissions."""
    from videojob.raycluster.client import HttpRayClient

    class Counting(HttpRayClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.lock = threading.Lock()
            self.requests: Counter = Counter()  # (thread id, "METHOD /path-kind")
            self.bytes: Counter = Counter()  # thread id -> bytes read
            self.submitted: list[dict[str, Any]] = []

        def _request(self, method, path, body=None, query=None, ok_missing=False):
            status, text = super()._request(method, path, body=body, query=query, ok_missing=ok_missing)
            me = threading.get_ident()
            kind = "/api/jobs/{id}" if path.startswith("/api/jobs/") and path != "/api/jobs/" else path
            with self.lock:
                self.requests[(me, f"{method} {kind}")] += 1
                self.bytes[me] += len(text)
                if method == "POST" and path == "/api/jobs/":
                    self.submitted.append(body)
            return status, text

        def cost(self) -> tuple[int, int]:
            """(requests, bytes) of this thread so far."""
            me = threading.get_ident()
            with self.lock:
                return sum(n for (t, _), n in self.requests.items() if t == me), self.bytes[me]

    return Counting(head.dashboard_url, token=head.token)


class Operator:
    """The controller in this process over the real API server and the real Ray head."""

    def __init__(self, cluster, namespace: str, tmp_path, head, jobs_cls=None, **settings: Any):
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        from videojob.controller.kube import VideoJobs
        from videojob.controller.operator import Controller
        from videojob.driver_protocol import PROTOCOL
        from videojob.settings import OperatorSettings

        driver = tmp_path / "fake-driver"
        driver.write_text(f"#!{sys.executable} -S\n" + FAKE_DRIVER % {"protocol": PROTOCOL})
        driver.chmod(0o755)
        inventory = tmp_path / "inventory.yaml"
        inventory.write_text(yaml.safe_dump({"device": "cpu", "classes": [
            {"name": "cpu1", "gpuMemory": "8Gi", "hostMemory": "16Gi", "gpuType": "generic", "gpusPerPod": 1,
             "maxPods": 8}]}))
        base = dict(ray_mode="address", ray_dashboard_url=head.dashboard_url, inventory_file=str(inventory),
                    namespaces=[namespace], metrics_port=0, poll_interval_s=0.2, progress_interval_s=0.5,
                    retry_backoff_s=0.2, warm_group_ttl_s=0, queue_status_interval_s=3600,
                    sweep_interval_s=3600, cpus_per_rank=0.5, driver_python=str(driver))
        self.settings = OperatorSettings(**{**base, **settings})
        self.api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
        self.objects = k8s.CustomObjectsApi(self.api)
        self.ray = _counting_client(head)
        self.controller = Controller(self.settings, ray=self.ray, jobs=(jobs_cls or VideoJobs)(self.api))
        self.controller.start()
        self.namespace = namespace

    def create(self, name: str, **spec) -> dict[str, Any]:
        doc = tiny_job(name, **spec)
        doc["spec"].pop("parallel", None)
        doc["spec"]["resources"] = {"maxGPUs": 1}
        return self.objects.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, doc)

    def get(self, name: str) -> dict[str, Any]:
        return self.objects.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

    def run(self, name: str, stopped: threading.Event | None = None, **spec) -> dict[str, Any]:
        """Create the job and run its lifecycle to its end (kopf's daemon, in this thread); its final object."""
        obj = self.create(name, **spec)
        self.controller.lifecycle(self.namespace, name, obj["metadata"]["uid"]).run(stopped or threading.Event())
        return self.get(name)

    def close(self) -> None:
        self.controller.stop()


def _table(head) -> dict[str, Any]:
    """Ray's job table (submission id -> job), read with a client of its own (not counted)."""
    from videojob.raycluster.client import HttpRayClient

    return {j.submission_id: j for j in HttpRayClient(head.dashboard_url, token=head.token).jobs()}


def _sids(submitted: list[dict[str, Any]]) -> set[str]:
    return {b["submission_id"] for b in submitted}


def test_ended_drivers_and_teardowns_leave_the_job_table(crd, namespace, head, tmp_path):  # noqa: F811
    """A succeeded job, a job whose first attempt was lost (its group torn down by a
    teardown driver), a job deleted while running (the finalizer), and what a crashed
    operator left (an ended driver of a job that is gone, a teardown): afterwards Ray's
    job table holds none of their drivers. No submission carries the Ray token."""
    from videojob.driver_protocol import DriverRequest

    op = Operator(crd, namespace, tmp_path, head, ray_job_retention_s=1)
    try:
        plain = op.run("plain")
        assert plain["status"]["phase"] == "Succeeded", plain["status"].get("message")
        lost = op.run("lost", negativePrompt="lose-first")
        assert [a["result"] for a in lost["status"]["attempts"]] == ["Lost", "Succeeded"], lost["status"]
        teardowns = [b for b in op.ray.submitted if "--teardown" in b["entrypoint"]]
        assert teardowns, "the lost attempt's group was torn down by a teardown driver"

        uid = op.create("deleted", negativePrompt="hang")["metadata"]["uid"]
        runner = threading.Thread(target=op.controller.lifecycle(namespace, "deleted", uid).run,
                                  args=(threading.Event(),), daemon=True)
        runner.start()

        def driver_running():
            status = op.get("deleted").get("status") or {}
            attempts = status.get("attempts") or [{}]
            job = _table(head).get(attempts[-1].get("submissionId"))
            return job is not None and job.status == "RUNNING" and status
        running = wait_for("the hanging job's driver to run", driver_running, timeout=120)
        op.controller.delete(namespace, "deleted", uid, running)  # the finalizer's work, as kopf calls it
        op.objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "deleted")
        runner.join(60)
        assert not runner.is_alive(), "the deleted job's lifecycle stopped"

        # What a crashed operator left: an ended driver of a job that no longer exists, and a teardown.
        gone = str(uuid.uuid4())
        left = {f"vj-{namespace}-gone-{gone[:8]}-a1": {"videojob.io/namespace": namespace, "videojob.io/uid": gone,
                                                       "videojob.io/attempt": "1"},
                "vj-teardown-leftover1": {"videojob.io/teardown": f"vj-{gone}-a1"}}
        for sid, meta in left.items():
            op.ray.submit(sid, f"{op.settings.driver_python} -m videojob_runtime.driver --teardown vj-{gone}-a1",
                          metadata=meta)
        wait_for("the leftovers to end", lambda: all((j := _table(head).get(s)) and j.terminal for s in left),
                 timeout=120)
        ours = _sids(op.ray.submitted)
        assert len(ours) >= 7, ours  # 4 attempts, a teardown, 2 leftovers

        left: dict[str, Any] = {}

        def clean():
            op.controller.sweep()
            left.clear()
            left.update({sid: job for sid, job in _table(head).items() if sid in ours})
            return not left
        try:
            wait_for("Ray's job table to hold none of the operator's drivers", clean, timeout=120, interval=1.0)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; left: {left}") from None
    finally:
        op.close()
    for body in op.ray.submitted:  # the request is in the entrypoint: it carries no credential
        text = json.dumps(body)
        assert head.token not in text
        if " --request " in body["entrypoint"]:
            request = DriverRequest.decode(body["entrypoint"].split(" --request ", 1)[1].split()[0])
            assert head.token not in base64.urlsafe_b64decode(request.encode()).decode()


def test_a_failed_status_write_leaves_the_driver_in_ray(crd, namespace, head, tmp_path):  # noqa: F811
    """The end is written first, the driver deleted after: when the write that records
    the end fails, the driver stays in Ray, so the next life of the lifecycle adopts
    its ended Ray job (reads its result) instead of submitting the driver again."""
    from videojob.controller.kube import VideoJobs

    failing = threading.Event()

    class FailingJobs(VideoJobs):
        def patch_status(self, ns, name, status, expect=None, uid=None, known=None):
            if failing.is_set() and status.get("phase") == "Succeeded":
                raise RuntimeError("injected: the status write of the attempt's end failed")
            return super().patch_status(ns, name, status, expect, uid, known)

    op = Operator(crd, namespace, tmp_path, head, jobs_cls=FailingJobs)
    try:
        failing.set()
        with pytest.raises(RuntimeError, match="injected"):
            op.run("fragile")
        status = op.get("fragile")["status"]
        sid = status["attempts"][-1]["submissionId"]
        assert status["attempts"][-1]["result"] == "Running", "the end was not written"
        assert _table(head).get(sid) is not None and _table(head)[sid].terminal, \
            "the driver's Ray job is still there (it was not deleted before the status write)"
        failing.clear()
        uid = op.get("fragile")["metadata"]["uid"]
        op.controller.lifecycle(namespace, "fragile", uid).run(threading.Event())  # the daemon, again
        final = op.get("fragile")["status"]
        assert final["phase"] == "Succeeded" and len(final["attempts"]) == 1, final
        assert [b["submission_id"] for b in op.ray.submitted].count(sid) == 1, "the driver was not submitted again"
        wait_for(f"{sid} to be deleted once its end was written",
                 lambda: op.controller.sweep() and sid not in _table(head), timeout=120, interval=1.0)
    finally:
        op.close()


def test_a_signed_or_credentialed_https_input_is_refused(crd, namespace):  # noqa: F811
    """A driver's request carries the spec's image uris into Ray's job table: the
    API server, ``videojob validate``'s models and the runtime refuse one with a
    user:password or a signature, token or key in its query; a plain one passes."""
    from videojob.api import InvalidVideoJob, parse_videojob
    from videojob.api.uris import uri_problem

    secret = ["https://bucket.example.com/face.png?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=abc",
              "https://acct.example.net/c/face.png?sv=2022-11-02&sig=abc%3D",
              "https://images.example.com/face.png?token=abc", "https://images.example.com/face.png#access_token=x",
              "https://user:pass@images.example.com/face.png"]
    for uri in secret:
        assert uri_problem(uri, "input"), uri
        doc = tiny_job("signed", task="i2v", image=uri)
        doc["metadata"]["namespace"] = namespace
        with pytest.raises(InvalidVideoJob, match="signature|credentials"):
            parse_videojob(doc)
        res = crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
        assert "signature" in str(uri_problem(uri, "input")) or "credentials" in str(uri_problem(uri, "input"))
        assert res.returncode != 0 and ("credentials" in res.stderr or "signature" in res.stderr), res.stderr
    assert uri_problem("https://images.example.com/face.png?v=2&monkey=1", "input") is None


def test_many_jobs_keep_the_job_table_and_the_sweep_small(crd, namespace, head, tmp_path):  # noqa: F811
    """30 jobs (``make test``: two sweeps): see ``_many_jobs``."""
    _many_jobs(crd, namespace, head, tmp_path, 30)


@pytest.mark.slow
def test_200_jobs_keep_the_job_table_and_the_sweep_small(crd, namespace, head, tmp_path):  # noqa: F811
    """200 jobs (``make test-slow``, in ``make bench``; VIDEOJOB_HYGIENE_JOBS changes it)."""
    _many_jobs(crd, namespace, head, tmp_path, int(os.environ.get("VIDEOJOB_HYGIENE_JOBS", "200")))


def _many_jobs(crd, namespace, head, tmp_path, total: int) -> None:  # noqa: F811
    """``total`` jobs, 8 at a time, through the operator's own code: every 25 jobs a
    sweep runs and its cost (Ray requests and bytes read, counted in the client) is
    recorded with the size of Ray's job table. With the whole-table scan on every
    sweep (retention 0, the worst case) both stay bounded by what runs at once,
    not by how many jobs ran; at the end no driver is left."""
    op = Operator(crd, namespace, tmp_path, head, ray_job_retention_s=0)
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    try:
        def one(i: int) -> str:
            return op.run(f"j{i:03d}")["status"]["phase"]

        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(one, i) for i in range(total)]
            mark = 0
            deadline = time.monotonic() + 1200
            while mark < total:  # a sweep each time 25 more jobs ended, while the others run
                assert time.monotonic() < deadline, f"only {mark} of {total} jobs ended in 20 minutes"
                done = sum(f.done() for f in futures)
                if done < min(total, mark + 25):
                    time.sleep(0.5)
                    continue
                mark = done
                table = len(_table(head))
                owed = len(ledger(op.ray).owed)  # ended since about the last sweep: deleted once settled
                before = op.ray.cost()
                op.controller.sweep()
                after = op.ray.cost()
                samples.append({"jobs": done, "table": table, "owed": owed, "requests": after[0] - before[0],
                                "bytes": after[1] - before[1]})
            phases = Counter(f.result() for f in futures)
        assert phases == Counter({"Succeeded": total}), phases
        ours = _sids(op.ray.submitted)
        wait_for("the last drivers to be deleted", lambda: op.controller.sweep() and not ours & set(_table(head)),
                 timeout=120, interval=1.0)
    finally:
        op.close()
    took = time.monotonic() - start
    print(f"\n{total} jobs in {took:.0f}s; per sweep: {json.dumps(samples)}")
    # The table holds what runs (8), what ended since about the last sweep (owed), and
    # a few ended a moment ago whose end is being written: never what ran before.
    for s in samples:
        assert s["table"] <= 8 + s["owed"] + 8, samples
        # A sweep: the groups (2 requests), the table scan (1: a few KB a row), a DELETE per settled owed driver.
        assert s["requests"] <= s["owed"] + 8, samples
        assert s["bytes"] <= 3_000 * (s["table"] + s["owed"]) + 30_000, samples
    if total >= 200:  # then the table at the end is a small part of what ran
        assert samples[-1]["table"] < total / 4, samples
