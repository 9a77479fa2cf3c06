"""/healthz: a liveness probe that a stuck client cannot fail and a wedged operator cannot pass.

Unit: the threaded server answers while other clients hang, and ``Health``
names the heartbeat that stalled (kopf's loop, the Admissions lock). Cluster:
the real operator as its own process (address mode, a real Ray head) is
healthy while idle; wedged by its test-only fault signals (SIGUSR1 holds the
Admissions lock, SIGUSR2 blocks kopf's loop) it answers 503 naming what is
stale; stopped (SIGSTOP) for longer than the stall limit, it is healthy again
once resumed.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from helpers import RayHead, wait_for
from operator_harness import OperatorProcess, write_inventory
from videojob.controller.admission import Admissions
from videojob.health import ADMISSIONS, KOPF_LOOP, Health
from videojob.inventory import load_inventory
from videojob.metrics import Metrics, serve

STALL_S = 3.0  # the operator's VIDEOJOB_HEALTH_STALL_S in the cluster tests (its least is 1 s)
# What a 200 held "longer than the limit" adds to it: several of stays' looks (every 0.5 s
# plus the look), so a heartbeat that stopped when the wait began is seen stale (503) in it.
MARGIN_S = 3.0


def get(port: int, path: str = "/healthz", timeout: float = 5.0) -> tuple[int, str]:
    """(HTTP status, body) of GET ``path``; a 503 is an answer, not an error."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def stays(what: str, probe, seconds: float) -> None:
    """``probe`` holds (truthy) at every look for ``seconds``; fail with the first look that did not."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen = probe()
        assert seen, f"{what} stopped holding: {seen!r}"
        time.sleep(0.5)


# -- unit: the server and the heartbeats --------------------------------------


@pytest.fixture
def server():
    servers = []

    def start(health):
        srv, port = serve(Metrics(), 0, health, host="127.0.0.1")
        servers.append(srv)
        return port

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def test_a_silent_or_half_sent_client_does_not_hold_up_healthz(server):
    """The kubelet's probe gets its answer while other clients hang on the same port
    (wsgiref's single-threaded server waited on the first for ever)."""
    port = server(lambda: (True, "ok\n"))
    silent = socket.create_connection(("127.0.0.1", port), timeout=5)
    half = socket.create_connection(("127.0.0.1", port), timeout=5)
    half.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line that ends it
    try:
        started = time.monotonic()
        status, body = get(port, timeout=5)
        assert (status, body) == (200, "ok\n")
        assert time.monotonic() - started < 5
        status, metrics = get(port, "/metrics", timeout=5)
        assert status == 200 and "videojob_queue_length" in metrics
    finally:
        silent.close()
        half.close()


def test_healthz_answers_503_with_the_body_health_gives(server):
    port = server(lambda: (False, "stale: admissions: no progress for 70s\n"))
    assert get(port) == (503, "stale: admissions: no progress for 70s\n")


def test_a_held_admissions_lock_is_named_stale_and_recovers():
    """The probe thread cannot take a held lock, so its heartbeat ages past the limit;
    once the lock is free again the heartbeat resumes."""
    admissions = Admissions(load_inventory(None), idle_ttl_s=0)
    health = Health(stall_s=1.0)
    health.start_probe(ADMISSIONS, admissions.ping)
    try:
        wait_for("a first healthy check", lambda: health.check()[0], timeout=10)
        with admissions._lock:  # what a wedged request or sweep would do
            wait_for("/healthz to call the held lock stale", lambda: not health.check()[0], timeout=30)
            ok, body = health.check()
            assert "stale: admissions: no progress for" in body and KOPF_LOOP not in body, body
        wait_for("healthy again once the lock is free", lambda: health.check()[0], timeout=30)
    finally:
        health.stop()


def test_a_blocked_event_loop_is_named_stale_and_recovers():
    """The heartbeat task stamps only when the loop runs it: a loop kept busy stops it."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    health = Health(stall_s=1.0)
    release = threading.Event()
    task = None
    try:
        task = asyncio.run_coroutine_threadsafe(_start_heartbeat(health), loop).result(timeout=10)
        wait_for("a first healthy check", lambda: health.check()[0], timeout=10)
        loop.call_soon_threadsafe(release.wait, 60)  # blocks the loop until released (or 60 s)
        wait_for("/healthz to call the blocked loop stale", lambda: not health.check()[0], timeout=30)
        ok, body = health.check()
        assert f"stale: {KOPF_LOOP}: no progress for" in body and "VIDEOJOB_HEALTH_STALL_S" in body, body
        release.set()
        wait_for("healthy again once the loop runs", lambda: health.check()[0], timeout=30)
    finally:
        release.set()
        health.stop()
        if task is not None:  # it ends at its next beat
            asyncio.run_coroutine_threadsafe(asyncio.wait_for(task, 10), loop).result(timeout=20)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        loop.close()


async def _start_heartbeat(health: Health) -> asyncio.Task:
    return health.start_loop_heartbeat()


def test_stall_must_be_positive():
    with pytest.raises(ValueError, match="stall_s"):
        Health(stall_s=0)


# -- the real operator ----------------------------------------------------------


@pytest.fixture(scope="module")
def ray_head():
    with RayHead(num_cpus=1, dashboard=True) as head:
        yield head


@pytest.fixture
def operator(crd, namespace, ray_head, tmp_path):  # noqa: F811
    """Starts the operator, address mode, stall limit STALL_S, fault signals on; killed afterwards."""
    token = tmp_path / "ray-token"
    token.write_text(ray_head.token)
    env = {"VIDEOJOB_RAY_MODE": "address", "VIDEOJOB_RAY_DASHBOARD_URL": ray_head.dashboard_url,
           "VIDEOJOB_RAY_TOKEN_FILE": str(token),
           "VIDEOJOB_INVENTORY_FILE": str(write_inventory(tmp_path / "inventory.yaml")),
           "VIDEOJOB_HEALTH_STALL_S": str(STALL_S), "VIDEOJOB_ALLOW_FAULT_INJECTION": "1"}
    process = OperatorProcess(crd, namespace, tmp_path / "operator", env)
    try:
        yield process.start()
    finally:
        if process.process is not None and process.process.poll() is None:
            os.kill(process.process.pid, signal.SIGCONT)  # a test that failed while it was stopped
            process.kill()  # a wedged operator cannot stop gently (its loop handles SIGTERM)


def _healthy(op: OperatorProcess) -> tuple[int, str] | None:
    answer = get(op.metrics_port, timeout=10)
    return answer if answer[0] == 200 else None


def _unhealthy(op: OperatorProcess) -> tuple[int, str] | None:
    answer = get(op.metrics_port, timeout=10)
    return answer if answer[0] == 503 else None


def _wedged(op: OperatorProcess, sig: signal.Signals, stale: str, fine: str) -> str:
    """Send the fault signal; /healthz turns 503 within the stall limit plus slack, naming
    ``stale`` (and not ``fine``); the body it answered."""
    os.kill(op.process.pid, sig)
    status, body = wait_for(f"/healthz to answer 503 after {sig.name}", lambda: _unhealthy(op),
                            timeout=STALL_S + 60, interval=0.5)
    assert f"stale: {stale}: no progress for" in body and fine not in body, body
    age = float(re.search(r"no progress for (\d+)s", body).group(1))
    assert age >= STALL_S, f"called stale after {age:g}s, under the {STALL_S:g}s limit: {body}"
    assert op.process.poll() is None, "the wedged operator exited"
    return body


@pytest.mark.cluster
def test_idle_operator_is_healthy_with_a_stuck_client_then_fails_on_a_held_admissions_lock(operator):
    silent = socket.create_connection(("127.0.0.1", operator.metrics_port), timeout=5)
    try:
        # Idle (no VideoJob) for longer than the limit: the heartbeats need no job.
        stays("the idle operator's 200", lambda: _healthy(operator), STALL_S + MARGIN_S)
    finally:
        silent.close()
    _wedged(operator, signal.SIGUSR1, ADMISSIONS, KOPF_LOOP)
    assert "holding the Admissions lock" in operator.log()


@pytest.mark.cluster
def test_blocked_kopf_loop_fails_healthz(operator):
    _wedged(operator, signal.SIGUSR2, KOPF_LOOP, f"{ADMISSIONS}:")


@pytest.mark.cluster
def test_sigstop_longer_than_the_limit_leaves_it_healthy_after_sigcont(operator):
    """Every stamp is old when it resumes; the beats come at once and stay."""
    pid = operator.process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S + 1)  # the stall itself: stopped past the limit (every stamp older than it)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for("/healthz to answer 200 after SIGCONT", lambda: _healthy(operator), timeout=60, interval=0.5)
    # Longer than the limit again: the heartbeats resumed, not just one stamp.
    stays("the resumed operator's 200", lambda: _healthy(operator), STALL_S + MARGIN_S)
