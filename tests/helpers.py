"""Small shared helpers for tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, TypeVar

import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
INVALID = sorted((REPO / "tests" / "data" / "invalid").glob("*.yaml"))

T = TypeVar("T")


def expected_field(path: Path) -> str:
    """The field a bad example must be rejected for, from its `# field:` header."""
    first = path.read_text().splitlines()[0]
    if not first.startswith("# field: "):
        raise ValueError(f"{path} lacks its '# field: spec.x' header line")
    return first.removeprefix("# field: ").strip()


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def wait_for(what: str, probe: Callable[[], T], timeout: float = 30.0, interval: float = 0.2) -> T:
    """Poll ``probe`` until it returns a truthy value; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T = probe()
    while not last:
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)
        last = probe()
    return last


def ray_census(prefix: str) -> dict[str, list[str]]:
    """Live placement groups and actors whose names start with ``prefix``."""
    import ray

    pgs = [p["name"] for p in ray.util.placement_group_table().values()
           if p["state"] != "REMOVED" and p["name"].startswith(prefix)]
    actors = [a["Name"] for a in ray._private.state.actors().values()
              if a["State"] != "DEAD" and a["Name"].startswith(prefix)]
    return {"placement_groups": pgs, "actors": actors}


def wait_until_clean(prefix: str, timeout: float = 30.0) -> None:
    """Wait until no placement group or actor named ``prefix``* is left in Ray;
    fail listing what is left after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        census = ray_census(prefix)
        if not any(census.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind in Ray {timeout:.0f}s later: {census}")
        time.sleep(0.2)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _live_group_members(pgid: int) -> list[int]:
    """Processes of a process group that are not zombies (an unreaped zombie still counts for killpg)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


class RayHead:
    """A Ray head a test starts as its own process group (``ray start --head
    --block``), with its own temp dir and explicit auth, and stops by signalling
    that group only: never ``ray stop``, which kills every Ray on the machine."""

    def __init__(self, num_cpus: int = 1, token: str | None = None):
        import secrets
        import sys
        import tempfile

        # Short: Ray's socket paths must stay under 108 bytes.
        self.root = root = Path(tempfile.mkdtemp(prefix="vj-head-", dir="/tmp"))
        self.temp_dir = root / "ray"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.token = token or secrets.token_hex(16)
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_TMPDIR": str(root),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self._argv = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                      f"--port={self.port}", "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp_dir}",
                      f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats"]
        self.process = None

    def __enter__(self) -> "RayHead":
        import os
        import socket
        import subprocess

        self.log = open(self.root / "ray-head.log", "w")
        self.process = subprocess.Popen(self._argv, env={**os.environ, **self.env}, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)

        def gcs_up():
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited {self.process.returncode}: "
                                   f"{(self.root / 'ray-head.log').read_text()[-2000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(f"the Ray head's GCS on port {self.port}", gcs_up, timeout=60)
        return self

    def run_python(self, code: str, timeout: float = 60) -> str:
        """Run ``code`` in a fresh interpreter connected to this head; returns stdout."""
        import os
        import subprocess
        import sys

        res = subprocess.run([sys.executable, "-c", code], env={**os.environ, **self.env, "RAY_ADDRESS": self.address},
                             capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"python against the Ray head failed: {res.stderr[-2000:]}")
        return res.stdout

    def __exit__(self, *exc) -> None:
        import os
        import signal
        import subprocess

        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass  # `ray start --block` takes ~30 s to wind down on SIGTERM: it is our own cluster, so kill it
        deadline = time.monotonic() + 30
        while _live_group_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head's processes {_live_group_members(pgid)} survived SIGKILL for 30s")
            time.sleep(0.2)
        self.process.wait(timeout=30)
        self.log.close()
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)
