"""The real operator's Controller in the test's process, over the real API server and a real Ray head.

What kopf does for each VideoJob (run its ``JobLifecycle`` in a daemon
thread) is done here by ``InProcess.run``; everything else is the product:
the Controller's books (``Admissions``), its sweeper, its metrics server, the
drivers it submits to the Ray head the test started. Faster than the operator
as a subprocess, and the test can look into the books at every status write
(``patches``) and stop and start the operator at moments it chooses (a
restart: ``stop`` then a new ``InProcess`` on the same jobs).

``Outage`` is a TCP forwarder in front of Ray's dashboard that a test takes
down (connections refused, as for a head that went away) and brings back.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from helpers import REPO, free_port
from operator_harness import create, tiny_job, videojob

sys.path.insert(0, str(REPO / "hack" / "cluster"))
from podrunner.proxy import pump  # noqa: E402 - the same byte pump as the pod runner's proxy


def one_rank(name: str, **changes: Any) -> dict:
    """The tiny job on one CPU rank (a group of one actor: the cheapest attempt)."""
    doc = tiny_job(name, **changes)
    doc["spec"].pop("parallel", None)
    doc["spec"]["resources"] = {**doc["spec"].get("resources", {}), "maxGPUs": 1}
    return doc


def with_fault(doc: dict, attempts: list[int], **fault: Any) -> dict:
    """``doc`` with the test-only fault for those attempts (needs allow_fault_injection)."""
    doc.setdefault("metadata", {}).setdefault("annotations", {})["videojob.io/inject-fault"] = json.dumps(
        {"attempts": attempts, **fault})
    return doc


def write_classes(path: Path, classes: list[dict]) -> str:
    path.write_text(yaml.safe_dump({"device": "cpu", "classes": [
        {"gpuMemory": "8Gi", "hostMemory": "16Gi", "gpuType": "generic", **c} for c in classes]}))
    return str(path)


class InProcess:
    """A Controller of this process; ``patches`` has one (monotonic time, job name,
    status patch, books snapshot after it) per status write."""

    def __init__(self, cluster, namespace: str, tmp_path: Path, ray_head, classes: list[dict],
                 dashboard_url: str | None = None, **settings: Any):
        from kubernetes import config as k8s_config

        from videojob.controller.kube import VideoJobs
        from videojob.controller.operator import Controller
        from videojob.raycluster.client import HttpRayClient
        from videojob.settings import OperatorSettings

        token = tmp_path / "ray-token"
        token.write_text(ray_head.token)
        url = dashboard_url or ray_head.dashboard_url
        base = dict(ray_mode="address", ray_dashboard_url=url, ray_token_file=str(token),
                    driver_python=sys.executable, namespaces=[namespace], metrics_port=0,
                    inventory_file=write_classes(tmp_path / f"inventory-{time.monotonic_ns()}.yaml", classes),
                    poll_interval_s=0.3, progress_interval_s=0.5, ray_retry_s=1.0, retry_backoff_s=1.0,
                    warm_group_ttl_s=0, queue_status_interval_s=0, sweep_interval_s=3600, cpus_per_rank=0.5,
                    allow_fault_injection=True)
        self.settings = OperatorSettings(**{**base, **settings})
        self.cluster, self.namespace = cluster, namespace
        self.patches: list[tuple[float, str, dict[str, Any], dict[str, Any]]] = []
        # Phases at whose writes /metrics is read too: (job name, status patch, metrics text).
        self.sample_metrics: set[str] = set()
        self.sampled: list[tuple[str, dict[str, Any], str]] = []
        self.threads: dict[str, tuple[threading.Thread, threading.Event]] = {}
        run = self

        class RecordingJobs(VideoJobs):
            def patch_status(self, ns, name, status, expect=None, uid=None, known=None):
                obj = super().patch_status(ns, name, status, expect, uid, known)
                run.patches.append((time.monotonic(), name, status, run.controller.admissions.snapshot()))
                if status.get("phase") in run.sample_metrics:
                    run.sampled.append((name, status, run.metrics()))
                return obj

        api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
        self.ray = HttpRayClient(url, token=ray_head.token, timeout_s=self.settings.ray_http_timeout_s,
                                 retries=self.settings.ray_http_retries)
        # The events the controller emits (kopf posts them in a real operator): (name, kind, reason, message).
        self.events: list[tuple[str, str, str, str]] = []
        self.controller = Controller(self.settings, ray=self.ray, jobs=RecordingJobs(api),
                                     event=lambda ns, name, uid, kind, reason, message:
                                     self.events.append((name, kind, reason, message)))

    def start(self) -> "InProcess":
        self.controller.start()
        return self

    def create(self, doc: dict) -> dict:
        """Create the VideoJob and start its lifecycle (as kopf's daemon would)."""
        obj = create(self.cluster, self.namespace, doc)
        self.run(obj["metadata"]["name"])
        return obj

    def run(self, name: str) -> None:
        """Start the lifecycle of an existing VideoJob."""
        obj = videojob(self.cluster, self.namespace, name)
        lifecycle = self.controller.lifecycle(self.namespace, name, obj["metadata"]["uid"])
        stopped = threading.Event()
        thread = threading.Thread(target=lifecycle.run, args=(stopped,), name=f"lifecycle-{name}", daemon=True)
        thread.start()
        self.threads[name] = (thread, stopped)

    def wait(self, name: str, timeout: float = 300) -> dict:
        """Until the lifecycle of ``name`` returns (the job ended); its object."""
        thread, _ = self.threads[name]
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError(f"{name}'s lifecycle did not end within {timeout:.0f}s; its last patches: "
                                 f"{json.dumps([p for _, n, p, _ in self.patches if n == name][-5:])[-3000:]}")
        return videojob(self.cluster, self.namespace, name)

    def delete(self, name: str, timeout: float = 60) -> None:
        """Delete the VideoJob as kopf's finalizer does (there is no finalizer on it here):
        the controller's deletion (stop the driver, its group gone, the books released),
        the lifecycle's thread stopped, then the object."""
        obj = videojob(self.cluster, self.namespace, name)
        self.controller.delete(self.namespace, name, obj["metadata"]["uid"], dict(obj.get("status") or {}))
        thread, stopped = self.threads[name]
        stopped.set()
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError(f"{name}'s lifecycle did not stop within {timeout:.0f}s of its deletion")
        self.cluster.kubectl("delete", "vj", name, "-n", self.namespace, "--wait=false")

    def patches_of(self, name: str) -> list[tuple[float, dict[str, Any], dict[str, Any]]]:
        return [(t, p, books) for t, n, p, books in self.patches if n == name]

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.controller.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def remove_groups(self, timeout: float = 90) -> None:
        """Tear down every group in Ray (warm ones a test kept would hold the module's Ray head)."""
        from videojob.controller.groups import groups_in_ray, teardown_groups

        left = teardown_groups(self.ray, list(groups_in_ray(self.ray)), self.controller.ctx.launch,
                               "the test ended", wait_s=timeout)
        if left:
            raise AssertionError(f"groups still in Ray {timeout:.0f}s after their teardown: {left}")

    def stop(self) -> None:
        """The operator goes away: every lifecycle stops where it is, then the Controller."""
        if not self.controller.alive.is_set():
            return
        for _, stopped in self.threads.values():
            stopped.set()
        for name, (thread, _) in self.threads.items():
            thread.join(60)
            if thread.is_alive():
                raise AssertionError(f"{name}'s lifecycle did not stop within 60 s")
        self.controller.stop()


class Outage:
    """A TCP forwarder to ``target_port`` on loopback; ``down()`` closes it and every
    open connection (new ones are refused), ``up()`` listens again on the same port."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def up(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by down()
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    server.close()
                    return
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()



@contextlib.contextmanager
def operator_factory(cluster, namespace: str, tmp_path, ray_head, default_classes: list[dict], start: bool = False,
                     remove_groups: bool = False):
    """A factory of in-process operators for a test fixture: each is stopped at the
    end (and, with ``remove_groups``, every group in Ray removed)."""
    made: list[InProcess] = []

    def make(classes=default_classes, **settings) -> InProcess:
        op = InProcess(cluster, namespace, tmp_path, ray_head, classes, **settings)
        made.append(op.start() if start else op)
        return made[-1]

    try:
        yield make
    finally:
        for op in made:
            op.stop()
        if remove_groups and made:
            made[-1].remove_groups()
