"""`make test`'s two streams (tests/streams.py, hack/test_streams.sh): every module lands in
exactly one, by what it uses, and the suite's timings of both read as one run."""
from __future__ import annotations

import json
import subprocess
import sys

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


def test_the_suite_file_says_which_caches_the_run_had(tmp_path):
    """.ci/run passes what `make setup` cost and which caches it found; the no-cache budget
    (40 min) is judged from noCaches and ciSeconds."""
    timings = tmp_path / "t.json"
    timings.write_text(json.dumps({"pytestSeconds": 5.0, "exitStatus": 0, "tests": {}, "fixtures": [], "starts": []}))
    out = tmp_path / "suite.json"

    def run(*caches):
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "test_suite.py"), "--timings", str(timings),
                        "--make-test-seconds", "60", "--setup-seconds", "900", "--ci-seconds", "990",
                        "--out", str(out), "--caches", *caches], cwd=REPO, check=True, timeout=120,
                       capture_output=True)
        return json.loads(out.read_text())

    cold = run("videojobTools=empty", "goBuild=empty", "goModules=empty", "pip=empty")
    assert (cold["setupSeconds"], cold["ciSeconds"], cold["noCaches"]) == (900.0, 990.0, True)
    warm = run("videojobTools=present", "goBuild=empty", "goModules=empty", "pip=empty")
    assert warm["noCaches"] is False and warm["cachesAtStart"]["videojobTools"] == "present"
