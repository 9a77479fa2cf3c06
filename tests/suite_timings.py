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
_cpu_began: list[tuple[int, int] | None] = [None]


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat: over a
    session they say how much of the cores the suite kept busy (whether more pytest
    workers could help on this machine)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def timings_path() -> Path:
    return Path(os.environ.get("VIDEOJOB_TEST_TIMINGS") or REPO / "out" / "test-timings.json")


def record_start(kind: str, seconds: float) -> None:
    """A service's start-up (``kind``: "ray-head", "operator", ...) for the test now running."""
    _starts.append({"kind": kind, "seconds": round(seconds, 3), "test": _current[0]})


def pytest_sessionstart(session) -> None:
    _began[0] = time.monotonic()
    _cpu_began[0] = cpu_jiffies()


_test_cpu: list[tuple[int, int] | None] = [None]
_test_began = [0.0]
HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def pytest_runtest_logstart(nodeid, location) -> None:
    _current[0] = nodeid
    _test_cpu[0] = cpu_jiffies()
    _test_began[0] = time.monotonic()


def pytest_runtest_logfinish(nodeid, location) -> None:
    """The machine's busy CPU seconds while this test (set-up to teardown) ran: a long test
    with few is waiting on time or on another process, not computing."""
    now, began = cpu_jiffies(), _test_cpu[0]
    if now and began and nodeid in _tests:
        _tests[nodeid]["busyCpuSeconds"] = round((now[0] - began[0]) / HZ, 2)
        _tests[nodeid]["wallSeconds"] = round(time.monotonic() - _test_began[0], 3)


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
    now, began = cpu_jiffies(), _cpu_began[0]
    busy = round((now[0] - began[0]) / (now[1] - began[1]), 3) if now and began and now[1] > began[1] else None
    document = {"pytestSeconds": round(time.monotonic() - _began[0], 1), "exitStatus": int(exitstatus),
                "cpuBusyFraction": busy, "cpuCount": os.cpu_count(),
                "args": list(session.config.invocation_params.args),
                "tests": _tests, "fixtures": _fixtures, "starts": _starts}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(tmp, path)
