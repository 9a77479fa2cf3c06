"""A driver that cannot start, and the Python drivers run with (issue 18).

`.venv/bin/videojob operator` in embedded mode, the venv not activated, used
to hand its drivers `python -m videojob_runtime.driver`: the first `python` on
PATH, which cannot import the runtime. Each attempt was retried as a lost
driver, and the job's message quoted the start of the driver's log (Ray's
preamble: the entrypoint with its base64 request), not its end.

- Without Ray: embedded mode's drivers run with the operator's own Python
  (sys.executable) unless VIDEOJOB_DRIVER_PYTHON is set; address mode keeps
  `python` (the runtime image's).
- Against a real Ray head (its own process, dashboard on, token auth), through
  the operator's ``HttpRayClient``, each driver's end read as the controller
  reads it (``outcome_of``): a driver whose Python cannot import the runtime,
  or whose interpreter is missing, fails once (``DriverStartFailed``) with
  the end of its log; a driver killed by a signal, stopped, or that had
  started before it died is lost (retried); a long log is quoted by its end.

The real controller meets such a driver in tests/test_driver_start_operator.py.
"""

from __future__ import annotations

import shlex
import sys
import uuid

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

from helpers import RayHead, wait_for
from operator_harness import python_without_runtime
from videojob.controller.groups import DriverLaunch
from videojob.controller.outcome import Outcome, outcome_of
from videojob.driver_protocol import PROTOCOL, DriverRequest, GroupRequest, record, result_of, submission_id
from videojob.raycluster.client import HttpRayClient, RayJob
from videojob.settings import OperatorSettings

NAMESPACE = "team-a"
DRIVER_START_FAILED = "DriverStartFailed"  # the attempt's reason in status
IMPORT_ERROR = "(ModuleNotFoundError: No module named 'videojob_runtime')"


def _request(name: str) -> DriverRequest:
    uid = str(uuid.uuid4())
    return DriverRequest(namespace=NAMESPACE, name=name, uid=uid, group=GroupRequest(name=f"vj-{uid}", ulysses=1),
                         job={"job_id": name}, output_uri=f"local://videos/{name}")


# -- the Python drivers run with (no Ray) ------------------------------------------------


def test_embedded_mode_runs_drivers_with_the_operators_own_python(monkeypatch):
    monkeypatch.delenv("VIDEOJOB_DRIVER_PYTHON", raising=False)
    monkeypatch.delenv("VIDEOJOB_RAY_MODE", raising=False)
    settings = OperatorSettings()
    assert settings.ray_mode == "embedded"
    launch = DriverLaunch.of(settings)
    assert launch.python == sys.executable, (
        f"embedded mode's drivers run {launch.python!r}, not the operator's own Python {sys.executable!r}")
    entrypoint = _request("own-python").entrypoint(launch.python)
    assert entrypoint.startswith(f"{shlex.quote(sys.executable)} -m videojob_runtime.driver --request "), entrypoint


def test_an_explicit_driver_python_wins_and_address_mode_keeps_the_images_python(monkeypatch):
    monkeypatch.delenv("VIDEOJOB_RAY_MODE", raising=False)
    monkeypatch.setenv("VIDEOJOB_DRIVER_PYTHON", "python")  # as the chart renders it, in every mode
    assert DriverLaunch.of(OperatorSettings()).python == "python"
    monkeypatch.setenv("VIDEOJOB_DRIVER_PYTHON", "/opt/runtime/bin/python")
    assert DriverLaunch.of(OperatorSettings()).python == "/opt/runtime/bin/python"
    monkeypatch.delenv("VIDEOJOB_DRIVER_PYTHON")
    address = OperatorSettings(ray_mode="address", ray_dashboard_url="http://head:8265")
    assert DriverLaunch.of(address).python == "python"  # the runtime image's, first on the Ray node's PATH


# -- a real Ray head -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_client():
    require_module("ray")
    require_module("aiohttp_cors", reason="Ray's Jobs API (the dashboard) needs ray[default]")
    with RayHead(num_cpus=1, dashboard=True, env={"OMP_NUM_THREADS": "1"}) as head:
        yield HttpRayClient(head.dashboard_url, token=head.token)


def _end(client: HttpRayClient, sid: str, entrypoint: str, timeout: float = 90) -> tuple[RayJob, str, Outcome]:
    """Submit ``entrypoint`` as the operator submits a driver; its Ray job, log and outcome once it ended."""
    assert client.submit(sid, entrypoint, entrypoint_num_cpus=0) is True
    job = wait_for(f"Ray job {sid} to end", lambda: (j := client.job(sid)) is not None and j.terminal and j,
                   timeout=timeout, interval=0.3)
    logs = client.logs(sid)
    return job, logs, outcome_of(job, result_of(logs), logs)


def _python_code(code: str) -> str:
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


def test_a_driver_whose_python_cannot_import_the_runtime_fails_once_with_the_import_error(ray_client, tmp_path):
    python = python_without_runtime(tmp_path / "plain")
    request = _request("no-runtime")
    sid = submission_id(NAMESPACE, request.name, request.uid, 1)
    job, logs, outcome = _end(ray_client, sid, request.entrypoint(str(python)))
    assert job.status == "FAILED" and job.driver_exit_code == 1, (job, logs)
    assert request.encode() in logs, "Ray's preamble no longer repeats the entrypoint: this test proves less"
    assert (outcome.kind, outcome.reason, outcome.attempt_result) == ("failed", DRIVER_START_FAILED, "Failed"), outcome
    assert outcome.message.endswith(IMPORT_ERROR), outcome.message
    assert request.encode()[:40] not in outcome.message, f"the base64 request is quoted: {outcome.message}"
    assert "VIDEOJOB_DRIVER_PYTHON" in outcome.message and str(python) in outcome.message, outcome.message


def test_a_missing_interpreter_fails_once_saying_so(ray_client, tmp_path):
    request = _request("no-python")
    missing = tmp_path / "no-such-dir" / "python"
    job, logs, outcome = _end(ray_client, submission_id(NAMESPACE, request.name, request.uid, 1),
                              request.entrypoint(str(missing)))
    assert job.status == "FAILED" and job.driver_exit_code == 127, (job, logs)
    assert (outcome.kind, outcome.reason) == ("failed", DRIVER_START_FAILED), outcome
    assert outcome.message.endswith(f"{missing}: not found"), outcome.message
    assert request.encode()[:40] not in outcome.message, outcome.message


def test_a_long_log_is_quoted_by_its_end(ray_client):
    # One line of code: Ray's preamble repeats the command, and a command of several lines
    # left its lines in the log, at the end when Ray flushed the preamble after the driver's
    # output (seen once in CI, 2026-12-07). The operator's own entrypoints are one line.
    code = ("print('FIRST LINE OF THE LOG'); [print(f'line {i} ' + 'x' * 80) for i in range(500)]; "
            "import no_such_module_for_this_test")
    _, logs, outcome = _end(ray_client, f"vj-long-log-{uuid.uuid4().hex[:8]}", _python_code(code))
    assert "FIRST LINE OF THE LOG" in logs
    assert outcome.kind == "failed", outcome
    assert outcome.message.endswith("ModuleNotFoundError: No module named 'no_such_module_for_this_test'"), (
        outcome.message)
    assert "line 499" not in outcome.message.splitlines()[-1] and "FIRST LINE" not in outcome.message
    assert len(outcome.message) < 1000, len(outcome.message)


def test_a_driver_killed_by_a_signal_is_lost_and_retried(ray_client):
    code = "import os, signal\nprint('loading', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"
    job, logs, outcome = _end(ray_client, f"vj-killed-{uuid.uuid4().hex[:8]}", _python_code(code))
    assert job.status == "FAILED" and job.driver_exit_code == 137, (job, logs)  # 128 + SIGKILL, through the shell
    assert (outcome.kind, outcome.reason) == ("lost", "DriverLost"), outcome
    # The shell's report ("... Killed  python -c '...'") quotes the command, which spans lines
    # here: "Killed" is in the log's end, not always its last line.
    tail = outcome.message.partition("its log ends:")[2]
    assert "exit code 137" in outcome.message and "Killed" in tail, outcome.message


def test_a_driver_that_had_started_is_lost_not_failed(ray_client):
    """A record printed, then an exit with an error and no result: the driver had started; its
    end is not a start failure (only a driver that printed nothing is failed without retry)."""
    started = record("progress", protocol=PROTOCOL, step=0, steps=3, percent=0, stage="start", state="starting")
    code = f"print({started!r}, flush=True)\nraise SystemExit(3)\n"
    job, logs, outcome = _end(ray_client, f"vj-started-{uuid.uuid4().hex[:8]}", _python_code(code))
    assert job.status == "FAILED" and job.driver_exit_code == 3, (job, logs)
    assert (outcome.kind, outcome.reason) == ("lost", "DriverLost"), outcome


def test_a_stopped_driver_is_lost(ray_client):
    sid = f"vj-stopped-{uuid.uuid4().hex[:8]}"
    assert ray_client.submit(sid, _python_code("import time\nprint('up', flush=True)\ntime.sleep(300)\n")) is True
    wait_for(f"{sid} to print", lambda: "up" in ray_client.logs(sid), timeout=60, interval=0.3)
    assert ray_client.stop(sid)
    job = wait_for(f"Ray job {sid} to end", lambda: (j := ray_client.job(sid)) is not None and j.terminal and j,
                   timeout=60, interval=0.3)
    logs = ray_client.logs(sid)
    outcome = outcome_of(job, result_of(logs), logs)
    assert job.status == "STOPPED", job
    assert (outcome.kind, outcome.reason) == ("lost", "DriverLost") and "STOPPED" in outcome.message, outcome
