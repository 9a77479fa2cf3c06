"""startupProbe, livenessProbe and readinessProbe for one container instance, with the
kubelet's timing (initialDelaySeconds from the container's start, periodSeconds,
timeoutSeconds, successThreshold, failureThreshold) and rules: the startup probe gates
the other two; readiness starts False; liveness or startup failure asks the pod worker
to restart the container.

exec runs inside the container (nsenter into its pid 1's net, mount, pid and uts
namespaces, then setpriv to its uid/gids) with its env and working dir; httpGet and
tcpSocket connect from the host to the pod's address (named ports resolved from the
container's ports)."""
from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from .env import expand

NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
SETPRIV = shutil.which("setpriv") or "/usr/bin/setpriv"
USER_AGENT = "kube-probe/1.34"


@dataclass
class Target:
    """Where a probe runs: the container instance's pid 1 and identity, the pod's address."""
    container: dict
    pid1: int
    env: dict[str, str]
    uid: int
    gid: int
    groups: list[int]
    cwd: str
    pod_ip: str
    started_at: float


def _port(target: Target, port) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in target.container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"named port {port!r} is not a port of container {target.container['name']}")


def run_exec(target: Target, command: list[str], timeout: float) -> tuple[bool, str]:
    argv = [NSENTER, "-t", str(target.pid1), "-n", "-m", "-p", "-u", f"--wd={target.cwd}", "--",
            SETPRIV, f"--reuid={target.uid}", f"--regid={target.gid}",
            f"--groups={','.join(map(str, target.groups))}" if target.groups else "--clear-groups", "--",
            *[expand(c, target.env) for c in command]]
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=target.env, start_new_session=True)
    except OSError as exc:
        return False, str(exc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
        return False, f"command timed out after {timeout:g}s"
    text = out.decode(errors="replace")[-1024:]
    return proc.returncode == 0, text if proc.returncode == 0 else f"exit {proc.returncode}: {text}"


def run_http(target: Target, spec: dict, timeout: float) -> tuple[bool, str]:
    host = spec.get("host") or target.pod_ip
    port = _port(target, spec["port"])
    path = spec.get("path") or "/"
    if not path.startswith("/"):
        path = "/" + path
    if (spec.get("scheme") or "HTTP").upper() == "HTTPS":
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"User-Agent": USER_AGENT, "Accept": "*/*"}
    for h in spec.get("httpHeaders") or []:
        headers[h["name"]] = h["value"]
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        body = resp.read(10240).decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        return False, f'Get "http://{host}:{port}{path}": {exc}'
    finally:
        conn.close()
    if 200 <= resp.status < 400:
        return True, ""
    return False, f"HTTP probe failed with statuscode: {resp.status} {body[:200]}"


def run_tcp(target: Target, spec: dict, timeout: float) -> tuple[bool, str]:
    host = spec.get("host") or target.pod_ip
    port = _port(target, spec["port"])
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, ""
    except OSError as exc:
        return False, f"dial tcp {host}:{port}: {exc}"


def run_probe(target: Target, probe: dict) -> tuple[bool, str]:
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "exec" in probe:
            return run_exec(target, probe["exec"].get("command") or [], timeout)
        if "httpGet" in probe:
            return run_http(target, probe["httpGet"], timeout)
        if "tcpSocket" in probe:
            return run_tcp(target, probe["tcpSocket"], timeout)
    except ValueError as exc:
        return False, str(exc)
    return False, f"probe handler {sorted(k for k in probe if not k[0].isupper())} is not supported by the pod runner"


class ProbeSet:
    """The probe workers of one container instance: `started` (an Event) and `ready` hold
    the results; notify(kind, message) reports 'changed' (either flipped), 'unhealthy'
    (a failed probe, for an event) and 'liveness' / 'startup' (failed past the threshold:
    the container must be restarted)."""

    def __init__(self, target: Target, notify: Callable[[str, str], None]):
        c = target.container
        self.target = target
        self.notify = notify
        self.stop_event = threading.Event()
        self.startup, self.liveness, self.readiness = (c.get("startupProbe"), c.get("livenessProbe"),
                                                       c.get("readinessProbe"))
        self.started = threading.Event()
        if not self.startup:
            self.started.set()
        self.ready = self.readiness is None
        self.threads = [threading.Thread(target=self._worker, args=(kind, probe), daemon=True,
                                         name=f"probe {kind} {c['name']}")
                        for kind, probe in (("startup", self.startup), ("liveness", self.liveness),
                                            ("readiness", self.readiness)) if probe]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stop_event.set()

    def _worker(self, kind: str, probe: dict) -> None:
        period = float(probe.get("periodSeconds") or 10)
        delay = float(probe.get("initialDelaySeconds") or 0)
        success_needed = int(probe.get("successThreshold") or 1)
        failure_needed = int(probe.get("failureThreshold") or 3)
        if kind != "startup":
            while not self.started.is_set():
                if self.stop_event.wait(0.2):
                    return
        first = self.target.started_at + delay
        if self.stop_event.wait(max(0.0, first - time.time())):
            return
        successes = failures = 0
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            ok, message = run_probe(self.target, probe)
            if self.stop_event.is_set():
                return
            if ok:
                successes, failures = successes + 1, 0
            else:
                successes, failures = 0, failures + 1
            if kind == "startup":
                if ok:
                    self.started.set()
                    self.notify("changed", "")
                    return
                if failures >= failure_needed:
                    self.notify("startup", message)
                    return
                self.notify("unhealthy", f"Startup probe failed: {message}")
            elif kind == "readiness":
                if ok and successes >= success_needed and not self.ready:
                    self.ready = True
                    self.notify("changed", "")
                elif not ok:
                    if failures >= failure_needed and self.ready:
                        self.ready = False
                        self.notify("changed", "")
                    self.notify("unhealthy", f"Readiness probe failed: {message}")
            else:  # liveness
                if not ok and failures >= failure_needed:
                    self.notify("liveness", message)
                    return
                if not ok:
                    self.notify("unhealthy", f"Liveness probe failed: {message}")
            self.stop_event.wait(max(0.0, period - (time.monotonic() - t0)))
