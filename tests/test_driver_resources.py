"""Drivers off the Ray head: VIDEOJOB_DRIVER_RESOURCES, checked against a real Ray.

Every driver the operator submits goes through ``DriverLaunch.submit`` (Ray's
Jobs API, ``entrypoint_resources``). Ray 2.60's job manager starts a job's
supervisor actor (whose child process is the driver) with those resources and,
when a job asks for any, without the label selector that otherwise pins it to
the head (ray/dashboard/modules/job/job_manager.py, ``_get_label_selector``).

Here: a real head (dashboard on, token auth, its own process group) and later
a second `ray start` node of its own process group that advertises
``vj-driver``, as the chart's drivers worker group does. A driver that asks for
``{"vj-driver": 1}`` stays PENDING while no node offers it (it never runs on the
head), then runs on the second node: Ray says so (``driver_node_id``), and the
driver process itself, walking its ancestors, finds the second node's process
group and not the head's. A driver with no resources runs on the head, as
before. The settings' validation names the variable and the fix.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

from helpers import RayHead, free_port, wait_for
from videojob.controller.groups import DriverLaunch
from videojob.settings import OperatorSettings

PY = sys.executable
PENDING_FOR_S = 8.0
# Prints the driver's ancestors (pid, process group) up to init: where in the machine's process tree it runs.
ANCESTRY = ("import os\n"
            "p = os.getpid()\n"
            "while p > 1:\n"
            "    print('ANCESTOR', p, os.getpgid(p), flush=True)\n"
            "    p = int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])\n")


# -- settings --------------------------------------------------------------------


@pytest.mark.parametrize("value,named", [
    ('{"vj-driver": 1}', None),
    ('{"vj-driver": 0.5, "pool/a": 2}', None),
    ("{}", None),
    ("map[vj-driver:1]", "must be a JSON object such as"),
    ('["vj-driver"]', "must be a JSON object of Ray resource names"),
    ('{"CPU": 1}', "one of Ray's own resources"),
    ('{"vj-driver": 0}', "must be a positive number"),
    ('{"vj-driver": -1}', "must be a positive number"),
    ('{"vj driver": 1}', "resource name 'vj driver' must be"),
])
def test_driver_resources_setting_is_checked_naming_the_variable(monkeypatch, value, named):
    monkeypatch.setenv("VIDEOJOB_DRIVER_RESOURCES", value)
    if named is None:
        settings = OperatorSettings()
        assert settings.entrypoint_resources == {k: float(v) for k, v in json.loads(value).items()}
        return
    with pytest.raises(ValueError) as exc:
        OperatorSettings()
    assert "VIDEOJOB_DRIVER_RESOURCES" in str(exc.value) and named in str(exc.value), str(exc.value)


def test_the_default_is_anywhere():
    settings = OperatorSettings()
    assert settings.driver_resources == {} and DriverLaunch.of(settings).resources == {}


# -- a real Ray ----------------------------------------------------------------------


class WorkerNode:
    """A second Ray node (``ray start --address``, its own process group) on this
    machine, advertising ``resources`` and no CPU; stopped by signalling its group."""

    def __init__(self, head: RayHead, resources: dict[str, float]):
        self.head = head
        self.log_path = head.root / f"worker-{len(list(head.root.glob('worker-*.log')))}.log"
        self.argv = [str(Path(PY).parent / "ray"), "start", f"--address={head.address}", "--block",
                     "--node-ip-address=127.0.0.1", "--num-cpus=0", f"--resources={json.dumps(resources)}",
                     "--disable-usage-stats", f"--node-manager-port={free_port()}",
                     f"--object-manager-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                     f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
                     f"--runtime-env-agent-port={free_port()}", "--object-store-memory=100000000"]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "WorkerNode":
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.argv, env={**os.environ, **self.head.extra_env, **self.head.env},
                                        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pgid(self) -> int:
        return self.process.pid

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.pgid, signal.SIGKILL)  # our own node: what survived SIGTERM goes
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="module")
def ray_head():
    require_module("ray")
    require_module("aiohttp_cors", reason="Ray's Jobs API (the dashboard) needs ray[default]")
    with RayHead(num_cpus=1, dashboard=True) as head:
        yield head


def _client(head: RayHead):
    from videojob.raycluster.client import HttpRayClient

    return HttpRayClient(head.dashboard_url, token=head.token)


def _ancestor_groups(logs: str) -> set[int]:
    return {int(line.split()[2]) for line in logs.splitlines() if line.startswith("ANCESTOR ")}


def test_a_driver_with_driver_resources_waits_then_runs_where_they_are_never_on_the_head(ray_head):
    client = _client(ray_head)
    launch = DriverLaunch(PY, {"vj-driver": 1.0})
    entrypoint = f"{PY} -c {shlex.quote(ANCESTRY)}"
    assert launch.submit(client, "vj-resources-off-head", entrypoint, metadata={"test": "off-head"}) is True

    # No node offers vj-driver: the job waits, and never starts on the head.
    deadline = time.monotonic() + PENDING_FOR_S
    while time.monotonic() < deadline:
        job = client.job("vj-resources-off-head")
        assert job is not None and job.status == "PENDING" and job.driver_node_id is None, (
            f"a driver asking for vj-driver must wait while no node offers it: {job}")
        time.sleep(0.5)

    with WorkerNode(ray_head, {"vj-driver": 2}) as worker:
        job = wait_for("the driver to run on the node that offers vj-driver",
                       lambda: (j := client.job("vj-resources-off-head")) is not None and j.terminal and j,
                       timeout=120, interval=0.5)
        logs = client.logs("vj-resources-off-head")
        assert job.status == "SUCCEEDED", f"{job}\n{logs[-2000:]}\n{worker.log_path.read_text()[-2000:]}"
        groups = _ancestor_groups(logs)
        assert worker.pgid in groups, (f"the driver's ancestors {sorted(groups)} do not include the worker node's "
                                       f"process group {worker.pgid}:\n{logs}")
        assert ray_head.process.pid not in groups, f"the driver ran under the head's process group:\n{logs}"

        # The same submission without resources runs on the head, as the embedded and address modes keep it.
        assert DriverLaunch(PY, {}).submit(client, "vj-resources-anywhere", entrypoint, metadata={}) is True
        anywhere = wait_for("the driver without resources to end",
                            lambda: (j := client.job("vj-resources-anywhere")) is not None and j.terminal and j,
                            timeout=120, interval=0.5)
        head_logs = client.logs("vj-resources-anywhere")
        assert anywhere.status == "SUCCEEDED", head_logs[-2000:]
        assert ray_head.process.pid in _ancestor_groups(head_logs), head_logs
        assert anywhere.driver_node_id and anywhere.driver_node_id != job.driver_node_id, (anywhere, job)
