"""Every call to the Kubernetes API gives up (issue 36, 4): against an API server that takes the
connection and never answers (a connection dropped silently by a NAT or a load balancer looks
the same), a job's read, the Workload watch and the sweeper no longer wait for ever; the
sweeper's liveness is in /healthz."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import urllib3
from kubernetes import client as k8s

from memory_operator import memory_controller
from videojob.controller.kube import TIMEOUT_ATTEMPTS, VideoJobs, api_client
from videojob.health import SWEEPER
from videojob.kueue import KueueApi

ONE_CPU = [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 1}]


class SilentServer:
    """A TCP server on loopback that accepts every connection and never sends a byte."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._closing = False
        threading.Thread(target=self._accept, name="silent-server", daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def configuration(self) -> k8s.Configuration:
        conf = k8s.Configuration()
        conf.host = f"http://127.0.0.1:{self.port}"
        return conf

    def close(self) -> None:
        self._closing = True
        self.listener.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def _finishes(what: str, call, within_s: float):
    """``call()`` on a thread; its result or exception, or fail when it still waits after ``within_s``."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"{what} still waits after {within_s:g} s on a server that never answers"
    return outcome


def test_a_read_of_a_job_gives_up_on_a_server_that_never_answers(silent):
    jobs = VideoJobs(api_client(timeout_s=0.3, configuration=silent.configuration()))
    start = time.monotonic()
    outcome = _finishes("a job's GET", lambda: jobs.get("ns", "job"), within_s=20)
    assert isinstance(outcome.get("error"), urllib3.exceptions.HTTPError), outcome
    assert len(silent.accepted) == TIMEOUT_ATTEMPTS, "each try waits its timeout on a connection of its own"
    assert time.monotonic() - start >= TIMEOUT_ATTEMPTS * 0.3


def test_the_workload_watch_lists_again_when_the_server_stops_answering(silent):
    kueue = KueueApi(api_client(timeout_s=0.3, configuration=silent.configuration()), ["ns"])
    try:
        deadline = time.monotonic() + 15
        while len(silent.accepted) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(silent.accepted) >= 3, (
            f"the Workload cache made {len(silent.accepted)} connection(s) in 15 s: its list waits for ever")
        assert not kueue.cache.synced("ns")
    finally:
        kueue.cache.stop()


def test_a_sweep_that_stops_making_progress_fails_healthz_and_passes_again_when_it_goes_on(tmp_path, monkeypatch):
    controller, jobs, _ = memory_controller(tmp_path, ONE_CPU, sweep_interval_s=0.05, health_stall_s=1.0)
    controller.health.stall_s, controller.health.beat_s, controller.health.grace_s = 0.5, 0.1, 0.1
    monkeypatch.setattr(controller, "sweep_step_limit_s", lambda: 0.5)
    release, listing = threading.Event(), threading.Event()
    list_jobs = jobs.list

    def hung_list(*args, **kwargs):
        listing.set()
        release.wait(30)
        return list_jobs(*args, **kwargs)

    jobs.list = hung_list
    controller.alive.set()
    sweeper = threading.Thread(target=controller._sweeper, daemon=True)
    sweeper.start()
    try:
        assert listing.wait(10), "no sweep started"
        deadline = time.monotonic() + 10
        while controller.health.check()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        healthy, body = controller.health.check()
        assert not healthy and SWEEPER in body, f"/healthz says {body!r} while the sweep is stuck"
        release.set()
        deadline = time.monotonic() + 10
        while not controller.health.check()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert controller.health.check()[0], "the sweep went on and /healthz still fails"
    finally:
        release.set()
        controller.alive.clear()
        sweeper.join(10)
