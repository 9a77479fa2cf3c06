"""`make test`'s two streams (tests/streams.py, hack/test_streams.sh): every module lands in
exactly one, by what it uses, and the suite's timings of both read as one run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO
from streams import stream_of_module

sys.path.insert(0, str(REPO / "benchmarks"))


def test_a_module_is_in_the_cluster_stream_by_its_fixtures_or_what_it_names(tmp_path):
    plain = tmp_path / "test_plain.py"
    plain.write_text("def test_x():\n    pass\n")
    starts_one = tmp_path / "test_starts.py"
    starts_one.write_text("import subprocess\nsubprocess.run(['python', 'hack/cluster/localcluster.py', 'up'])\n")
    assert stream_of_module(plain, {"tmp_path"}) == "local"
    assert stream_of_module(plain, {"tmp_path", "crd"}) == "cluster"
    assert stream_of_module(starts_one, set()) == "cluster"
    assert stream_of_module(tmp_path / "gone.py", set()) == "cluster", "unreadable: the safe side"


def test_a_stream_name_that_is_not_one_is_refused():
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/test_streams.py"], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "VIDEOJOB_TEST_STREAM": "both"})
    assert result.returncode != 0 and "VIDEOJOB_TEST_STREAM='both'" in result.stdout + result.stderr


def test_the_streams_timings_merge_into_one_run(tmp_path):
    from test_suite import merge, summarize

    def doc(seconds, tests, busy):
        return {"pytestSeconds": seconds, "exitStatus": 0, "cpuBusyFraction": busy, "cpuCount": 2, "args": [],
                "tests": {t: {"setup": 0.0, "call": 1.0, "teardown": 0.0, "outcome": "passed",
                              "busyCpuSeconds": 1.5, "wallSeconds": 1.0} for t in tests},
                "fixtures": [], "starts": []}

    merged = merge([doc(100.0, ["tests/a.py::t"], 0.9), doc(80.0, ["tests/b.py::t", "tests/b.py::u"], 0.8)],
                   ["cluster", "local"])
    summary = summarize(json.loads(json.dumps(merged)))
    assert summary["pytestSeconds"] == 100.0 and summary["tests"] == 3 and summary["cpuBusyFraction"] == 0.9
    assert [s["tests"] for s in summary["streams"]] == [1, 2]
    assert summary["moduleBusyCores"] == {"tests/b.py": 1.5, "tests/a.py": 1.5}


def test_the_suite_file_says_which_caches_the_run_had_and_when_its_setup_was_ready(tmp_path):
    """.ci/run passes which caches it found; hack/test_streams.sh's out/setup-timings.json says
    when the tests could start; the no-cache budget (40 min) is judged from noCaches and
    makeTestSeconds, in a file of its own so that both budgets' runs are kept."""
    from test_suite import result_name

    timings = tmp_path / "t.json"
    timings.write_text(json.dumps({"pytestSeconds": 5.0, "exitStatus": 0, "tests": {}, "fixtures": [], "starts": []}))
    setup = tmp_path / "setup.json"
    setup.write_text(json.dumps({"venvSeconds": 210, "controlPlaneToolsSeconds": 340, "streamsStartSeconds": 341,
                                 "otherToolsBuilt": ["helm", "kueue"], "otherToolsSeconds": 900,
                                 "streamsEndSeconds": 2000}))
    out = tmp_path / "suite.json"

    def run(*caches):
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "test_suite.py"), "--timings", str(timings),
                        "--make-test-seconds", "2000", "--ci-seconds", "2030", "--setup-timings", str(setup),
                        "--out", str(out), "--caches", *caches], cwd=REPO, check=True, timeout=120,
                       capture_output=True)
        return json.loads(out.read_text())

    cold = run("videojobTools=empty", "goBuild=empty", "goModules=empty", "pip=empty")
    assert (cold["setupSeconds"], cold["ciSeconds"], cold["noCaches"]) == (341.0, 2030.0, True)
    assert cold["setup"]["otherToolsBuilt"] == ["helm", "kueue"]
    warm = run("videojobTools=present", "goBuild=empty", "goModules=empty", "pip=empty")
    assert warm["noCaches"] is False and warm["cachesAtStart"]["videojobTools"] == "present"
    assert (result_name(True), result_name(False)) == ("test_suite_no_caches.json", "test_suite.json")


class _Item:
    """What tests/resource_order.py reads of a collected test."""

    def __init__(self, path, name: str, fixturenames: set[str]):
        self.fspath, self.nodeid, self.fixturenames = path, f"{path.name}::{name}", fixturenames


def test_modules_that_need_a_tool_still_building_run_last_in_its_build_order(tmp_path, monkeypatch):
    """On a machine without the Go tools, hack/test_streams.sh builds helm, KWOK, KubeRay and Kueue
    beside the streams (VIDEOJOB_TOOLS_PENDING): the modules that need one run after the rest,
    those needing the earliest-built first, and each module's tests stay together in order."""
    import resource_order

    def module(name: str, text: str = "def test_x():\n    pass\n"):
        path = tmp_path / name
        path.write_text(text)
        return path

    plain, charts, kueue, full = (module("test_plain.py"), module("test_charts.py", "helm_binary()\n"),
                                  module("test_kueue.py"), module("test_full.py"))
    items = [_Item(kueue, "a", {"kueue"}), _Item(full, "a", {"full_cluster", "helm"}), _Item(charts, "a", set()),
             _Item(plain, "a", {"tmp_path"}), _Item(full, "b", {"full_cluster"}), _Item(plain, "b", set())]
    monkeypatch.setenv(resource_order.TOOLS_PENDING_VARIABLE, "helm,kwok,kuberay,kueue")
    resource_order.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == ["test_plain.py::a", "test_plain.py::b", "test_charts.py::a",
                                         "test_full.py::a", "test_full.py::b", "test_kueue.py::a"]
    assert resource_order.tools_needed(full, {"full_cluster"}) == {"kwok", "kuberay"}

    monkeypatch.setenv(resource_order.TOOLS_PENDING_VARIABLE, "kueue")  # the others cached: only Kueue's wait
    items = [_Item(kueue, "a", {"kueue"}), _Item(charts, "a", set()), _Item(plain, "a", set())]
    resource_order.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == ["test_charts.py::a", "test_plain.py::a", "test_kueue.py::a"]

    monkeypatch.setenv(resource_order.TOOLS_PENDING_VARIABLE, "kwok,rclone")
    with pytest.raises(ValueError, match="rclone"):
        resource_order.pytest_collection_modifyitems(None, None, items)
