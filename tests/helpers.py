"""Small shared helpers for tests (no fixtures here: see conftest.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path, PurePosixPath
from typing import Callable, TypeVar

import yaml
from hypothesis import strategies as st

from videojob.catalog import CACHE_POLICIES, MODEL_IDS, TASKS

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


def cluster_required() -> bool:
    """CI=true or VIDEOJOB_REQUIRE_CLUSTER=1: what a test needs must be there; it fails, never skips."""
    return (os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
            or os.environ.get("VIDEOJOB_REQUIRE_CLUSTER", "").strip() == "1")


def require_module(name: str, reason: str | None = None):
    """The module ``name``; when it is missing, skip (as ``pytest.importorskip``), except
    where the cluster is required (``cluster_required``): there a missing module (the
    runtime extra not installed) fails the test instead, naming what is missing."""
    import importlib

    import pytest

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        why = f"{name} cannot be imported ({exc})" + (f": {reason}" if reason else "")
        if not cluster_required():
            pytest.skip(why, allow_module_level=True)
        pytest.fail(f"{why}; CI=true or VIDEOJOB_REQUIRE_CLUSTER=1 says nothing may be skipped: install the "
                    "runtime extra", pytrace=False)


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


HELM_BUILD_TIMEOUT_S = 1800  # a cold build at nice 19 beside the tests, or this test's own


def helm_binary() -> str:
    """The helm binary built from its Go module (hack/cluster/build-gotool.sh, `make
    helm-tool`, cached): built now when it is not (a cold build takes minutes), or waited
    for when another process is building it (`make test` builds it beside the tests on a
    machine without it). When it cannot be built the calling test skips, or FAILS when
    VIDEOJOB_REQUIRE_CLUSTER=1."""
    import pytest

    result = subprocess.run(["bash", str(REPO / "hack" / "cluster" / "build-gotool.sh"), "helm"],
                            capture_output=True, text=True, cwd=REPO, timeout=HELM_BUILD_TIMEOUT_S)
    lines = result.stdout.strip().splitlines()
    path = Path(lines[-1]) / "helm" if result.returncode == 0 and lines else None
    if path is None or not os.access(path, os.X_OK):
        said = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        msg = f"helm could not be built (`make helm-tool` says why): {said}"
        if os.environ.get("VIDEOJOB_REQUIRE_CLUSTER", "").strip() == "1":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return str(path)


def env_of(container: dict) -> dict[str, str]:
    """A container's plain environment variables (name -> value; None for valueFrom)."""
    env = {}
    for item in container.get("env", []):
        assert item["name"] not in env, f"{container['name']}: env {item['name']} set twice"
        env[item["name"]] = item.get("value")
    return env


def inventory_source(deployment: dict) -> tuple[PurePosixPath, str]:
    """Where the operator Deployment's pod reads its inventory (VIDEOJOB_INVENTORY_FILE)
    and the ConfigMap mounted there: (path in the pod, ConfigMap name); the file is the
    ConfigMap's key of the same name."""
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    path = PurePosixPath(env_of(container)["VIDEOJOB_INVENTORY_FILE"])
    mount = next(m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == path.parent)
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    return path, volume["configMap"]["name"]


def running_ready(pod: dict) -> bool:
    """A pod is Running and Ready (on the full cluster: bound to a node, and KWOK says so)."""
    conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
    return pod.get("status", {}).get("phase") == "Running" and conds.get("Ready") == "True"


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


def _record_start(kind: str, seconds: float) -> None:
    """A service's start-up seconds for the suite's timings (only inside pytest)."""
    try:
        from suite_timings import record_start
    except ImportError:
        return
    record_start(kind, seconds)


class RayHead:
    """A Ray head a test starts as its own process group (``ray start --head
    --block``), with its own temp dir and explicit auth, and stops by signalling
    that group only: never ``ray stop``, which kills every Ray on the machine."""

    def __init__(self, num_cpus: int = 1, token: str | None = None, dashboard: bool = False,
                 env: dict[str, str] | None = None):
        """``dashboard``: also run the dashboard (Jobs and State HTTP APIs) on a free
        loopback port, at ``dashboard_url``; ``env``: extra environment for the head,
        which its workers, job supervisors and job drivers inherit."""
        import secrets
        import sys
        import tempfile

        # Short: Ray's socket paths must stay under 108 bytes.
        self.root = root = Path(tempfile.mkdtemp(prefix="vj-head-", dir="/tmp"))
        self.temp_dir = root / "ray"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.token = token or secrets.token_hex(16)
        # RAY_JOB_STOP_WAIT_TIME_S: as the chart and the embedded head set it
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_TMPDIR": str(root),
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_JOB_STOP_WAIT_TIME_S": "10"}
        self.extra_env = dict(env or {})
        self._argv = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                      f"--port={self.port}", "--node-ip-address=127.0.0.1", f"--temp-dir={self.temp_dir}",
                      f"--num-cpus={num_cpus}", "--disable-usage-stats"]
        self.dashboard_port: int | None = None
        self.dashboard_url: str | None = None
        if dashboard:
            self.dashboard_port = free_port()
            self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
            # The agent's HTTP port defaults to a fixed 52365: another head on the machine would collide.
            self._argv += ["--include-dashboard=true", "--dashboard-host=127.0.0.1",
                           f"--dashboard-port={self.dashboard_port}",
                           f"--dashboard-agent-listen-port={free_port()}"]
        else:
            self._argv.append("--include-dashboard=false")
        self.process = None

    def __enter__(self) -> "RayHead":
        import os
        import socket
        import subprocess

        began = time.monotonic()
        self.log = open(self.root / "ray-head.log", "w")
        self.process = subprocess.Popen(self._argv, env={**os.environ, **self.extra_env, **self.env},
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

        def gcs_up():
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited {self.process.returncode}: "
                                   f"{(self.root / 'ray-head.log').read_text()[-2000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        try:
            wait_for(f"the Ray head's GCS on port {self.port}", gcs_up, timeout=60)
            if self.dashboard_url:
                wait_for(f"the Ray head's Jobs API at {self.dashboard_url}", self._jobs_api_up, timeout=90,
                         interval=0.5)
        except BaseException:
            self.__exit__(None, None, None)  # a head that did not come up leaves no process or temp dir
            raise
        _record_start("ray-head", time.monotonic() - began)
        return self

    def _jobs_api_up(self) -> bool:
        """The dashboard answers /api/version and lists jobs (/api/jobs/) with our token."""
        import json
        import urllib.request

        if self.process.poll() is not None:
            raise RuntimeError(f"ray start exited {self.process.returncode}: "
                               f"{(self.root / 'ray-head.log').read_text()[-2000:]}")
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            for path in ("/api/version", "/api/jobs/"):
                request = urllib.request.Request(self.dashboard_url + path, headers=headers)
                with urllib.request.urlopen(request, timeout=5) as response:
                    json.loads(response.read() or b"null")
        except (OSError, ValueError):
            return False
        return True

    def run_python(self, code: str, timeout: float = 60) -> str:
        """Run ``code`` in a fresh interpreter connected to this head; returns stdout."""
        import os
        import subprocess
        import sys

        env = {**os.environ, **self.extra_env, **self.env, "RAY_ADDRESS": self.address}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
        if res.returncode != 0:
            raise RuntimeError(f"python against the Ray head failed: {res.stderr[-2000:]}")
        return res.stdout

    def __exit__(self, *exc) -> None:
        import os
        import signal
        import subprocess

        pgid = self.process.pid  # its own session: the group id is its pid (also once it has exited)
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # nothing of it is left
        try:
            self.process.wait(timeout=1)
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


# A spec space around the rules: mostly near-valid values, so both verdicts occur.
SPEC_SPACE = st.fixed_dictionaries(
    {"model": st.fixed_dictionaries({"name": st.sampled_from(MODEL_IDS)}), "prompt": st.just("a cat")},
    optional={
        "task": st.sampled_from(TASKS),
        "image": st.just("pvc://inputs/a.png"),
        "faceImage": st.just("pvc://inputs/face.png"),
        "video": st.fixed_dictionaries({}, optional={
            "width": st.sampled_from([16, 48, 64, 100, 256, 512, 720, 721, 832, 1280, 1360, 2048, 4096]),
            "height": st.sampled_from([16, 48, 64, 480, 512, 700, 704, 720, 768]),
            "frames": st.sampled_from([1, 5, 9, 16, 17, 32, 33, 49, 50, 81, 161]),
        }),
        "sampling": st.fixed_dictionaries({}, optional={"guidanceScale": st.sampled_from([0.0, 1.0, 1.5, 6.0])}),
        "cache": st.fixed_dictionaries({"policy": st.sampled_from(CACHE_POLICIES)}),
        "resources": st.fixed_dictionaries({}, optional={"maxGPUs": st.integers(1, 8),
                                                         "allowOffload": st.booleans()}),
        "parallel": st.fixed_dictionaries({}, optional={
            "ulysses": st.integers(1, 8), "ring": st.integers(1, 3), "cfg": st.integers(1, 2)}),
        "memory": st.fixed_dictionaries({}, optional={
            "offload": st.sampled_from(["none", "model", "group", "sequential"]),
            "vaeTiling": st.booleans(), "vaeSlicing": st.booleans()}),
    },
)


def plannable_without_limits(spec: dict) -> str | None:
    """Why the planner refuses a (valid) spec on a node with as much of
    everything as a job can ask for (None: it plans). Such a refusal can only
    come from the spec itself, which validation should have caught."""
    from videojob.api import parse_spec
    from videojob.planner import GiB, Inventory, plan_spec

    node = Inventory(gpu_memory=10**6 * GiB, gpus_per_node=8, host_memory=10**7 * GiB)
    result = plan_spec(parse_spec(spec), node)
    return None if result.chosen is not None else result.reason
