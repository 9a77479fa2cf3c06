"""One Ray head for every operator module whose books allow sharing it (a pytest plugin,
loaded by conftest.py).

Fixtures (session scope): ``crd`` (kube_cluster with the VideoJob CRD installed),
``roots`` (outputs/work dirs), ``ray_head`` (a RayHead with a dashboard whose drivers
write under ``roots["outputs"]``) and ``ray_client`` (an HttpRayClient on it).

Sharing is kept honest three ways:

* the modules that use the shared head run one after another and the head is stopped
  right after its last user (tests/resource_order.py), so it does not idle through
  the rest of the run;
* an autouse guard checks before and after every test that uses it: no ``vj-*``
  actor or placement group alive, no Ray job still running and no CPU in use
  (the dashboard's cluster status, which lags by a few seconds). A test that leaves
  any of these behind fails (error in teardown, naming what it left) and the guard
  then removes it, so the next test starts clean;
* tests that count the job table's rows, add nodes or need other head settings
  keep a head of their own (their modules define their own fixtures).
"""
from __future__ import annotations

import sys
import time

import pytest

from helpers import RayHead

SETTLE_S = 30.0  # how long a test's own clean-up (teardown drivers, a stopping operator) may take


def _census(client) -> dict[str, list[str]]:
    from videojob.driver_protocol import GROUP_PREFIX

    status = client._json("GET", "/api/cluster_status") or {}
    report = ((status.get("data") or {}).get("clusterStatus") or {}).get("loadMetricsReport") or {}
    used, total = (report.get("usage") or {}).get("CPU", (0.0, 0.0))
    return {"actors": sorted(a.get("name") or "" for a in client.actors(GROUP_PREFIX)),
            "placement groups": sorted(p.get("name") or "" for p in client.placement_groups(GROUP_PREFIX)),
            "running jobs": sorted(j.submission_id for j in client.jobs() if not j.terminal),
            "CPUs in use": [f"{used:g} of {total:g}"] if used else []}


def _clean_up(client) -> None:
    """Stop every running job, then tear every group down (what a leaking test left)."""
    from videojob.controller.groups import DriverLaunch, groups_in_ray, teardown_groups

    for job in client.jobs():
        if not job.terminal:
            client.stop(job.submission_id)
    launch = DriverLaunch(python=sys.executable)
    teardown_groups(client, list(groups_in_ray(client)), launch, "the shared head's guard", wait_s=60)


def _wait_clean(client, timeout: float) -> dict[str, list[str]]:
    deadline = time.monotonic() + timeout
    while True:
        left = {what: names for what, names in _census(client).items() if names}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.3)


@pytest.fixture(scope="session")
def crd(kube_cluster):
    kube_cluster.install_crd()
    return kube_cluster


@pytest.fixture(scope="session")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("operator")
    return {"outputs": base / "outputs", "work": base / "work", "base": base}


@pytest.fixture(scope="session")
def ray_head(roots):
    """The shared Ray head: its drivers inherit where outputs go."""
    roots["outputs"].mkdir(parents=True, exist_ok=True)
    with RayHead(num_cpus=2, dashboard=True, env={"VIDEOJOB_OUTPUT_ROOT": str(roots["outputs"]),
                                                  "OMP_NUM_THREADS": "1"}) as head:
        yield head


@pytest.fixture(scope="session")
def ray_client(ray_head):
    from videojob.raycluster.client import HttpRayClient

    return HttpRayClient(ray_head.dashboard_url, token=ray_head.token)


def uses_shared_head(item) -> bool:
    """Whether ``item`` resolves ``ray_head`` to this plugin's fixture (not a module's own)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get("ray_head") if info else None
    func = getattr(defs[-1], "func", None) if defs else None
    return func is not None and func.__module__ == __name__


@pytest.fixture(autouse=True)
def _shared_head_guard(request):
    """Around a test that uses the shared head: clean before; after, anything it left fails it."""
    if not uses_shared_head(request.node):
        yield
        return
    client = request.getfixturevalue("ray_client")
    left = _wait_clean(client, SETTLE_S)
    if left:
        _clean_up(client)
        pytest.fail(f"the shared Ray head was not clean before this test (an earlier test's clean-up "
                    f"failed): {left}", pytrace=False)
    yield
    left = _wait_clean(client, SETTLE_S)
    if left:
        _clean_up(client)
        pytest.fail(f"this test left behind in the shared Ray head {SETTLE_S:.0f} s after it ended: {left} "
                    "(removed by the guard)", pytrace=False)
