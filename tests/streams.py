"""The suite's two streams (a pytest plugin, loaded by conftest.py): `make test` runs one
pytest process for each at once (hack/test_streams.sh), since one process kept only 1.2 of
this machine's 2 cores busy (issue 35).

With ``VIDEOJOB_TEST_STREAM=cluster`` only the modules that use a loopback control plane
are kept (a session fixture that starts or needs one, or the module names the cluster's
directory or ``localcluster``); with ``VIDEOJOB_TEST_STREAM=local`` only the others
(torch, Ray and the CLI on this machine). The two sets share no long-lived service and
no fixed path. Unset: every test in one process (`make test-serial`).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

STREAM_VARIABLE = "VIDEOJOB_TEST_STREAM"
STREAMS = ("cluster", "local")
# Session fixtures that start (or need) a loopback control plane.
CLUSTER_FIXTURES = {"kube_cluster", "full_cluster", "e2e_cluster", "kueue", "crd", "ray_head"}
# A module that starts a cluster itself, or runs the commands that do.
NAMES_A_CLUSTER = re.compile(r"localcluster|\.cluster\b|cluster-up")


def stream_of_module(path: Path, fixturenames: set[str]) -> str:
    """"cluster" or "local" for the module at ``path`` whose tests use ``fixturenames``."""
    if fixturenames & CLUSTER_FIXTURES:
        return "cluster"
    try:
        text = path.read_text()
    except OSError:
        return "cluster"
    return "cluster" if NAMES_A_CLUSTER.search(text) else "local"


def pytest_collection_modifyitems(session, config, items):
    wanted = os.environ.get(STREAM_VARIABLE, "")
    if not wanted:
        return
    if wanted not in STREAMS:
        raise ValueError(f"{STREAM_VARIABLE}={wanted!r}: use one of {', '.join(STREAMS)} (or leave it unset)")
    used: dict[Path, set[str]] = {}
    for item in items:
        used.setdefault(Path(str(item.fspath)), set()).update(item.fixturenames)
    streams = {path: stream_of_module(path, names) for path, names in used.items()}
    keep = [item for item in items if streams[Path(str(item.fspath))] == wanted]
    dropped = [item for item in items if streams[Path(str(item.fspath))] != wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
