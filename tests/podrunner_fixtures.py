"""The `runner` fixture of tests/test_podrunner_pods.py and
tests/test_podrunner_lifecycle.py: one pod runner process per test module (its own
state dir, two nodes, a pod CIDR of its own, 1 s..4 s CrashLoopBackOff) that runs
the pods the tests bind to its nodes; at the end it is stopped and nothing it
created may be left. Needs root (network namespaces, mounts): skipped otherwise,
FAILS when CI=true or VIDEOJOB_REQUIRE_CLUSTER=1. Also the image map it runs with
and the check that a stopped runner left nothing behind. A test module imports
`runner` to use it. The runner process and the apiserver client are in
tests/podrunner_helpers.py."""
from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
import yaml

from helpers import REPO
from podrunner_helpers import PYTHON_IMAGE, VENV_BIN, Api, RunnerProcess, alive, free_pod_cidr, leftovers


def _required() -> bool:
    return (os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
            or os.environ.get("VIDEOJOB_REQUIRE_CLUSTER", "").strip() == "1")


SHELL_IMAGE = "test/shell:1"


def _image_map(path: Path) -> Path:
    path.write_text(yaml.safe_dump({"images": [
        {"image": "test/shell", "entrypoint": ["/bin/sh"], "env": {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}},
        # the venv and the checkout are this image's own files: shown behind the container's
        # private /tmp when the checkout lies under /tmp (a CI clone)
        {"image": PYTHON_IMAGE, "cmd": ["python"], "paths": [str(REPO), str(VENV_BIN.parent)],
         "env": {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "VIRTUAL_ENV": str(VENV_BIN.parent), "PYTHONUNBUFFERED": "1", "IMAGE_ONLY": "from-image",
                 "OVERRIDDEN": "image"}},
    ]}))
    return path


def _all_pids(state: dict) -> list[int]:
    return [c["pid"] for p in state.get("pods", []) for c in p["containers"] if c.get("pid")]


def _assert_clean(r: RunnerProcess, host_paths: list[str], pids: list[int]) -> None:
    from podrunner.hostpaths import users_of

    shared = [p for p in host_paths if users_of(p)]   # another live runner on this machine uses them
    left = leftovers(r.prefix, [p for p in host_paths if p not in shared])
    assert not left, f"the pod runner left behind: {left}\n{r.log_tail()}"
    running = [p for p in pids if alive(p)]
    assert not running, f"container processes still running after the runner stopped: {running}"


@pytest.fixture(scope="module")
def runner(kube_cluster, tmp_path_factory):
    if os.geteuid() != 0:
        msg = "the pod runner needs root (network namespaces, bind mounts, other uids)"
        if _required():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    root = tmp_path_factory.mktemp("podrunner")
    tag = secrets.token_hex(3)
    r = RunnerProcess(kube_cluster, root / "state", [f"pr-{tag}-a", f"pr-{tag}-b"], _image_map(root / "images.yaml"),
                      free_pod_cidr())
    r.api = Api(kube_cluster)
    r.node = r.nodes[0]
    r.flags = root / "flags"       # a hostPath the tests flip to drive probes
    r.flags.mkdir()
    try:
        r.start()
    except BaseException:
        r.stop()
        raise
    yield r
    state = r.state()
    rc = r.stop()
    assert rc == 0, f"the pod runner exited with {rc} on SIGTERM:\n{r.log_tail()}"
    _assert_clean(r, state.get("hostPaths", []), _all_pids(state))
    for node in r.nodes:
        assert r.api.call("GET", f"/api/v1/nodes/{node}", ok404=True) is None, f"node {node} left behind"
