"""Where the suite's time goes: a pytest plugin (loaded by conftest.py) that writes
every test's setup, call and teardown seconds and every long-lived fixture's setup
seconds to one JSON file when the session ends.

The file is ``$VIDEOJOB_TEST_TIMINGS`` or ``out/test-timings.json``;
``benchmarks/test_suite.py`` turns it into ``benchmarks/results/test_suite.json``
(.ci/run does that after ``make test``). Shared services that are not fixtures
(a Ray head a helper starts, an operator process) report their start-up through
``record_start(kind, seconds)``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_LONG_LIVED = {"session", "package", "module"}

_tests: dict[str, dict] = {}
_fixtures: list[dict] = []
_starts: list[dict] = []
_current: list[str] = [""]  # the test being set up, run or torn down
_began = [0.0]


def timings_path() -> Path:
    return Path(os.environ.get("VIDEOJOB_TEST_TIMINGS") or REPO / "out" / "test-timings.json")


def record_start(kind: str, seconds: float) -> None:
    """A service's start-up (``kind``: "ray-head", "operator", ...) for the test now running."""
    _starts.append({"kind": kind, "seconds": round(seconds, 3), "test": _current[0]})


def pytest_sessionstart(session) -> None:
    _began[0] = time.monotonic()


def pytest_runtest_logstart(nodeid, location) -> None:
    _current[0] = nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    began = time.monotonic()
    yield
    if fixturedef.scope in _LONG_LIVED:
        _fixtures.append({"fixture": fixturedef.argname, "scope": fixturedef.scope,
                          "seconds": round(time.monotonic() - began, 3), "test": _current[0]})


def pytest_runtest_logreport(report) -> None:
    entry = _tests.setdefault(report.nodeid, {"setup": 0.0, "call": 0.0, "teardown": 0.0, "outcome": "passed"})
    entry[report.when] = round(report.duration, 3)
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session, exitstatus) -> None:
    if not _tests:
        return
    path = timings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"pytestSeconds": round(time.monotonic() - _began[0], 1), "exitStatus": int(exitstatus),
                "args": list(session.config.invocation_params.args),
                "tests": _tests, "fixtures": _fixtures, "starts": _starts}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(tmp, path)
