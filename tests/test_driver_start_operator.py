"""The real controller and a driver that cannot start (issue 18): the real
``Controller``/``JobLifecycle`` against the loopback kube-apiserver (every
status write passes the CRD's schema) and a real Ray head (its own process,
dashboard on, token auth), with VIDEOJOB_DRIVER_PYTHON naming a Python that
cannot import the runtime. Before: three attempts, each ``DriverLost``, and a
message quoting the start of the driver's log (the base64 request). Now: one
attempt, ``DriverStartFailed``, one driver submitted, the message ending with
the import error. tests/test_driver_start.py has the cases without Kubernetes.
"""

from __future__ import annotations

import json

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("ray")
require_module("aiohttp_cors", reason="Ray's Jobs API (the dashboard) needs ray[default]")

from helpers import RayHead  # noqa: E402
from operator_harness import python_without_runtime  # noqa: E402
from test_placement_operator import Run  # noqa: E402
from videojob.raycluster.client import HttpRayClient  # noqa: E402

pytestmark = pytest.mark.cluster
DRIVER_START_FAILED = "DriverStartFailed"  # the attempt's reason in status
IMPORT_ERROR = "(ModuleNotFoundError: No module named 'videojob_runtime')"


@pytest.fixture(scope="module")
def ray_client():
    with RayHead(num_cpus=1, dashboard=True, env={"OMP_NUM_THREADS": "1"}) as head:
        yield HttpRayClient(head.dashboard_url, token=head.token)


def test_a_job_whose_driver_cannot_start_fails_once_with_the_import_error(crd, namespace, ray_client,  # noqa: F811
                                                                           tmp_path):
    run = Run(crd, namespace, tmp_path, ray_client, driver_python=str(python_without_runtime(tmp_path / "plain")),
              driver_resources={}, max_attempts=3, retry_backoff_s=0.3)
    try:
        obj = run.job("cannot-start", timeout=120)
    finally:
        run.close()
    status = obj["status"]
    assert status["phase"] == "Failed", json.dumps(status, indent=1)
    attempts = status["attempts"]
    assert [(a["result"], a["reason"]) for a in attempts] == [("Failed", DRIVER_START_FAILED)], attempts
    assert attempts[0]["message"].endswith(IMPORT_ERROR), attempts[0]["message"]
    assert IMPORT_ERROR in status["message"] and "VIDEOJOB_DRIVER_PYTHON" in status["message"], status["message"]
    assert "--request" not in status["message"] and "eyJ" not in status["message"], (
        f"the driver's request is quoted: {status['message']}")
    completed = next(c for c in status["conditions"] if c["type"] == "Completed")
    assert (completed["status"], completed["reason"]) == ("False", "Failed"), completed
    assert IMPORT_ERROR in completed["message"], completed["message"]
    assert not [p for p, _ in run.patches if p.get("phase") == "Queued"], "the job was queued again for a retry"
    uid = obj["metadata"]["uid"]
    drivers = [j for j in ray_client.jobs() if j.metadata.get("videojob.io/uid") == uid]
    assert len(drivers) == 1, f"{len(drivers)} drivers submitted for the job: {drivers}"
