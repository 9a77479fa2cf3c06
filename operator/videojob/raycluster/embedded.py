"""Embedded mode: the operator starts a local Ray head as a child process.

For a CPU trial on one machine (or an operator pod running the runtime
image): ``ray start --head --block`` in its own process group, with its own
temp dir, the dashboard (Jobs API) on loopback and a fresh auth token, and
then the same HTTP path as a real cluster. Ray dies with the operator, so a
restart re-runs the job (DESIGN.md: the restart promise holds where Ray runs
outside the operator). The operator package still never imports ray: it
runs the ``ray`` command.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("videojob.raycluster.embedded")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_command() -> str:
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if not found:
        raise RuntimeError("embedded Ray needs the `ray` command (the runtime image, or "
                           "pip install 'videojob[runtime]'); or set VIDEOJOB_RAY_MODE=address")
    return found


@dataclass
class EmbeddedRay:
    process: subprocess.Popen
    dashboard_url: str
    token: str
    temp_root: Path

    def stop(self) -> None:
        try:
            pgid = os.getpgid(self.process.pid)
        except ProcessLookupError:
            pgid = None
        if pgid is not None:
            os.killpg(pgid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(pgid, signal.SIGKILL)  # `ray start --block` winds down slowly; it is ours
            except ProcessLookupError:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.temp_root, ignore_errors=True)


def start_embedded_ray(num_cpus: int | None = None, timeout_s: float = 90.0,
                       extra_env: dict[str, str] | None = None) -> EmbeddedRay:
    """A local Ray head with its dashboard on loopback; waits until the Jobs API answers."""
    from .client import HttpRayClient, RayUnavailable

    root = Path(tempfile.mkdtemp(prefix="vj-ray-", dir="/tmp"))  # Ray's socket paths must stay short
    token = secrets.token_hex(32)
    dashboard = _free_port()
    # RAY_JOB_STOP_WAIT_TIME_S: as the chart sets it (a stopped driver's time to tear its group down)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_TMPDIR": str(root),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_JOB_STOP_WAIT_TIME_S": "10", **(extra_env or {})}
    env.pop("RAY_ADDRESS", None)  # never join a cluster found in the environment
    argv = [ray_command(), "start", "--head", "--block", f"--port={_free_port()}", "--node-ip-address=127.0.0.1",
            f"--temp-dir={root / 'ray'}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={_free_port()}",
            "--disable-usage-stats", f"--num-cpus={num_cpus or os.cpu_count() or 1}"]
    logfile = open(root / "ray-head.log", "w")
    process = subprocess.Popen(argv, env=env, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
    embedded = EmbeddedRay(process, f"http://127.0.0.1:{dashboard}", token, root)
    client = HttpRayClient(embedded.dashboard_url, token=token, timeout_s=5, retries=0)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            text = (root / "ray-head.log").read_text()[-2000:]
            embedded.stop()
            raise RuntimeError(f"the embedded Ray head exited with {process.returncode}: {text}")
        try:
            client.version()
            client.actors()  # the State API comes up a moment after the Jobs API
            client._json("GET", "/api/jobs/")  # and submissions work once the head's agent reported in
            break
        except RayUnavailable:
            if time.monotonic() > deadline:
                embedded.stop()
                raise RuntimeError(f"the embedded Ray head's dashboard did not answer within {timeout_s:.0f}s "
                                   f"(log: {root / 'ray-head.log'})") from None
            time.sleep(0.5)
    log.info("embedded Ray head at %s (temp dir %s)", embedded.dashboard_url, root)
    return embedded
