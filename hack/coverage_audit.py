#!/usr/bin/env python3
"""`make coverage-audit`: the lines and branches of operator/ and runtime/ that only the
`slow` tests reach (issue 35, point 4) -> tests/coverage-audit.json.

    python hack/coverage_audit.py [--select tests/test_x.py ...] [--fast-data FILE] [--out FILE]

1. The fast tier (`pytest tests -m "not slow"`, as `make test`) under line and branch coverage
   of operator/videojob and runtime/videojob_runtime.
2. Each module's slow tests on their own (`pytest MODULE -m slow`, as `make test-slow`), each
   test's lines in pytest's process under a coverage context named by its node id (this file
   is also that pytest plugin: ``-p coverage_audit``; PYTEST_DONT_REWRITE, it is imported
   before pytest loads it). A module fixture's set-up counts for its first test.
3. Per slow test, what it reached that the fast tier did not, and a "why" a person writes
   (carried over when the file is regenerated); tests/test_coverage_audit.py checks both.

Subprocesses: COVERAGE_PROCESS_START reaches every Python process pytest starts (the
operator, `ray start` and through the raylet every Ray worker: job supervisor, driver, rank
actors), where coverage's own a1_coverage.pth starts measuring. A sitecustomize.py on
PYTHONPATH (in the scratch directory) adds a save every SAVE_EVERY_S, since some tests
SIGKILL the operator and Ray ends actors with ray.kill (no atexit), and in Ray workers it
patches each actor method to start coverage's tracer in Ray's C++-made task threads (the
threaded rank actors) and to save when the method returns; os._exit saves first (``patch =
_exit``). Lost: what a process ran in its last SAVE_EVERY_S before a SIGKILL. Subprocess
data carries no test context: what a slow module's subprocesses alone reached counts for the
module ("slowModulesSubprocessOnly").

--select: only these test files or node ids, in both tiers (a quick run; its file goes to
the scratch directory unless --out says otherwise). --fast-data: reuse a combined fast-tier
data file (a scratch directory's fast/.coverage) instead of running the fast tier.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "operator" / "videojob", REPO / "runtime" / "videojob_runtime"]
OUT = REPO / "tests" / "coverage-audit.json"
SAVE_EVERY_S = 1.0
PYTEST_PROCESS = "VIDEOJOB_COVERAGE_AUDIT_PYTEST"  # set for pytest only; its children save periodically
IN_PROCESS = "pytest"  # the pytest process's context outside tests (collection, session fixtures)
RCFILE = """\
[run]
branch = true
parallel = true
data_file = {data}
source =
    {sources}
patch = _exit
disable_warnings = no-data-collected, module-not-measured, module-not-imported
"""


# -- in every measured process (sitecustomize.py imports this module) -----------------

def process_hook() -> None:
    """Start the periodic save in a subprocess that coverage measures (not in pytest itself,
    whose saves must not race its context switches)."""
    if os.environ.pop(PYTEST_PROCESS, None):
        return
    try:
        import coverage
    except ImportError:
        return
    cov = coverage.process_startup() or coverage.Coverage.current()
    if cov is None:
        return
    threading.Thread(target=_save_every, args=(cov,), name="coverage-audit-saver", daemon=True).start()
    if sys.argv and sys.argv[0].endswith("default_worker.py"):
        _trace_ray_task_threads(cov)


_SAVING = threading.Lock()


def _save(cov) -> None:
    """Save now, unless nothing of ours was imported (Ray's own processes)."""
    if {"videojob", "videojob_runtime"} & sys.modules.keys():
        with _SAVING, contextlib.suppress(Exception):  # the process is ending, or coverage stopped
            cov.save()


def _save_every(cov) -> None:
    while True:
        time.sleep(SAVE_EVERY_S)
        _save(cov)


def _trace_ray_task_threads(cov) -> None:
    """The rank actors are threaded (max_concurrency): Ray runs their methods on threads
    made in C++, which threading.settrace (how coverage follows threads) never reaches.
    Each actor method's executor starts coverage's tracer in its thread first, and saves
    when the method returns (before its caller has the result and can ray.kill the actor)."""
    from ray._private.function_manager import FunctionActorManager

    make = FunctionActorManager._make_actor_method_executor

    def make_traced(self, method_name, method):
        executor = make(self, method_name, method)

        def traced(*args, **kwargs):
            if sys.gettrace() is None and threading.gettrace() is not None:
                sys.settrace(threading.gettrace())  # coverage's per-thread installer
            try:
                return executor(*args, **kwargs)
            finally:
                _save(cov)

        traced.name, traced.method = executor.name, executor.method  # what Ray reads off it
        return traced

    FunctionActorManager._make_actor_method_executor = make_traced


# -- the pytest plugin (-p coverage_audit): one coverage context per test ----------------

def pytest_configure(config) -> None:
    _switch(IN_PROCESS)


def pytest_runtest_logstart(nodeid, location) -> None:
    _switch(nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    _switch(IN_PROCESS)


def _switch(context: str) -> None:
    import coverage

    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(context)


# -- running the tiers ---------------------------------------------------------------

def run_tier(tier: Path, pytest_args: list[str], env: dict[str, str], contexts: bool) -> int:
    """pytest under coverage, its data in ``tier``; pytest's exit status."""
    (tier / "site").mkdir(parents=True)
    rc = tier / "coveragerc"
    rc.write_text(RCFILE.format(data=tier / ".coverage", sources="\n    ".join(map(str, SOURCES))))
    (tier / "site" / "sitecustomize.py").write_text("import coverage_audit\ncoverage_audit.process_hook()\n")
    path = [str(tier / "site"), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, **env, "COVERAGE_PROCESS_START": str(rc), PYTEST_PROCESS: "1",
           "VIDEOJOB_TEST_TIMINGS": str(tier / "timings.json"),  # outcomes; out/test-timings.json stays
           "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    argv = [sys.executable, "-m", "pytest", *pytest_args, *(["-p", "coverage_audit"] if contexts else [])]
    print(f"coverage-audit: {' '.join(argv[1:])}  (data: {tier})", flush=True)
    started = time.monotonic()
    status = subprocess.run(argv, env=env, cwd=REPO).returncode
    print(f"coverage-audit: exit {status} after {time.monotonic() - started:.0f} s", flush=True)
    return status


def combine(tier: Path):
    """The tier's per-process data files combined into tier/.coverage (kept: --fast-data)."""
    import coverage

    cov = coverage.Coverage(config_file=str(tier / "coveragerc"))
    cov.combine(data_paths=[str(tier)], keep=True)
    cov.save()
    return cov


def reached(cov, contexts: list[str] | None = None) -> tuple[dict, dict, dict]:
    """(lines by file, branch arcs by file, totals) that ``cov``'s data reached, only in
    ``contexts`` (regexes) when given."""
    files = None
    if contexts:  # only the files these contexts reached: a report parses every file it lists
        data = cov.get_data()
        data.set_query_contexts(contexts)
        files = [name for name in data.measured_files() if data.lines(name)]
        if not files:
            return {}, {}, {}
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cov.json_report(morfs=files, outfile=f.name, contexts=contexts)
        report = json.loads(Path(f.name).read_text())
    lines = {name: set(f["executed_lines"]) for name, f in report["files"].items()}
    arcs = {name: {tuple(a) for a in f.get("executed_branches", [])} for name, f in report["files"].items()}
    return lines, arcs, report["totals"]


def percents(totals: dict) -> dict:
    return {"lines%": round(100 * totals["covered_lines"] / max(totals["num_statements"], 1), 2),
            "branches%": round(100 * totals["covered_branches"] / max(totals["num_branches"], 1), 2),
            "lines": totals["num_statements"], "branches": totals["num_branches"]}


def minus(mine: dict, theirs: dict) -> dict:
    return {name: s - theirs.get(name, set()) for name, s in mine.items() if s - theirs.get(name, set())}


def entry(lines: dict, arcs: dict, fast_lines: dict, fast_arcs: dict, old: dict | None) -> dict:
    """What was reached beyond the fast tier, and the why of the file before (carried over)."""
    return {"onlyLines": format_lines(minus(lines, fast_lines)),
            "onlyBranches": format_branches(minus(arcs, fast_arcs)), "why": (old or {}).get("why")}


def format_lines(lines: dict) -> list[str]:
    """{file: {3, 4, 5, 9}} -> ["file:3-5,9"]."""
    out = []
    for name, nums in sorted(lines.items()):
        runs: list[list[int]] = []
        for n in sorted(nums):
            if runs and n == runs[-1][1] + 1:
                runs[-1][1] = n
            else:
                runs.append([n, n])
        out.append(f"{name}:" + ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs))
    return out


def format_branches(arcs: dict) -> list[str]:
    """{file: {(3, 5), (7, -1)}} -> ["file:3->5", "file:7->exit"]."""
    return [f"{name}:{a}->{b if b > 0 else 'exit'}" for name, s in sorted(arcs.items()) for a, b in sorted(s)]


def slow_tests(select: list[str]) -> dict[str, list[str]]:
    """The node ids marked slow, by module."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", *select],
                         capture_output=True, text=True, cwd=REPO)
    nodeids = list(dict.fromkeys(line for line in res.stdout.splitlines() if "::" in line and not line[0].isspace()))
    if res.returncode not in (0, 5) or (res.returncode == 0 and not nodeids):
        raise RuntimeError(f"collecting the slow tests failed ({res.returncode}):\n"
                           f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
    modules: dict[str, list[str]] = {}
    for nodeid in nodeids:
        modules.setdefault(nodeid.split("::")[0], []).append(nodeid)
    return modules


def audit_module(module: str, nodeids: list[str], select: list[str], scratch: Path, fast: tuple[dict, dict],
                 old: dict) -> tuple[int, dict, dict, object]:
    """Run one module's slow tests; (exit status, entries by node id, the module's entry, its data)."""
    tier = scratch / "slow" / Path(module).stem
    picked = [n for n in select if n.startswith(module + "::")] or [module]
    # the environment of `make test-slow` (Makefile: VIDEOJOB_HYGIENE_JOBS=200)
    status = run_tier(tier, [*picked, "-m", "slow"], {"VIDEOJOB_HYGIENE_JOBS": "200"}, contexts=True)
    cov = combine(tier)
    ran = json.loads((tier / "timings.json").read_text())["tests"] if (tier / "timings.json").is_file() else {}
    tests = {}
    for nodeid in nodeids:
        lines, arcs, _ = reached(cov, [f"^{re.escape(nodeid)}$"])
        times = ran.get(nodeid, {})
        tests[nodeid] = {**entry(lines, arcs, *fast, old.get("slowTests", {}).get(nodeid)),
                         "outcome": times.get("outcome", "not run"),
                         "seconds": round(sum(times.get(k, 0) for k in ("setup", "call", "teardown")), 1)}
    # the rest: subprocesses (context ""), and pytest's own process outside tests ("pytest")
    rest = [re.escape(c) for c in set(cov.get_data().measured_contexts()) - set(nodeids)]
    lines, arcs, _ = reached(cov, ["^(" + "|".join(rest) + ")$"])
    module_entry = entry(lines, arcs, *fast, old.get("slowModulesSubprocessOnly", {}).get(module))
    return status, tests, module_entry, cov


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--select", nargs="+", default=[], help="test files or node ids (default: tests/)")
    ap.add_argument("--fast-data", type=Path, help="a combined fast-tier data file to reuse")
    ap.add_argument("--scratch", type=Path, help="an empty or new directory for the data (default: one in /tmp)")
    ap.add_argument("--out", type=Path, help="default tests/coverage-audit.json ({scratch}/coverage-audit.json "
                                             "with --select)")
    args = ap.parse_args()
    os.chdir(REPO)  # the report's file names are relative to the repository
    scratch = (args.scratch or Path(tempfile.mkdtemp(prefix="coverage-audit-"))).resolve()
    if scratch.exists() and any(scratch.iterdir()):
        sys.exit(f"coverage-audit: {scratch} is not empty (its data would mix with this run's)")
    scratch.mkdir(parents=True, exist_ok=True)
    out = args.out or (scratch / "coverage-audit.json" if args.select else OUT)
    select = args.select or ["tests"]
    started = time.monotonic()
    statuses: dict[str, int] = {}

    import coverage

    if args.fast_data:
        fast_cov = coverage.Coverage(data_file=str(args.fast_data.resolve()))
        fast_cov.load()
    else:
        statuses["fast"] = run_tier(scratch / "fast", [*select, "-m", "not slow"], {}, contexts=False)
        fast_cov = combine(scratch / "fast")
    fast_lines, fast_arcs, fast_totals = reached(fast_cov)

    old = json.loads(out.read_text()) if out.is_file() else {}
    tests, modules = {}, {}
    every = coverage.CoverageData(str(scratch / "with-slow.coverage"))
    every.update(fast_cov.get_data())
    for module, nodeids in slow_tests(select).items():
        statuses[module], found, modules[module], cov = audit_module(module, nodeids, select, scratch,
                                                                    (fast_lines, fast_arcs), old)
        tests.update(found)
        every.update(cov.get_data())
    every.write()
    with_cov = coverage.Coverage(data_file=every.data_filename())
    with_cov.load()

    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, cwd=REPO).stdout.strip()  # noqa: E731
    result = {
        "generated": {"commit": git("rev-parse", "HEAD"),
                      "dirty": bool(git("status", "--porcelain", "--", "operator", "runtime", "tests",
                                        ":(exclude)tests/coverage-audit.json")),
                      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                      "command": " ".join(["python", "hack/coverage_audit.py", *sys.argv[1:]]),
                      "seconds": round(time.monotonic() - started), "pytestExitStatus": statuses,
                      "coverage": coverage.__version__},
        "about": ("slowTests: what each slow test reached in pytest's own process that the fast tier "
                  "(`make test`) did not, as file:lines and file:from->to branches. slowModulesSubprocessOnly: "
                  "what a slow module's subprocesses (operator, Ray job driver, rank actors) and pytest's "
                  "process outside its tests reached that the fast tier did not: subprocess data carries no "
                  "test context, so it counts for the module as a whole. Each non-empty entry, and each slow "
                  "test that did not pass here, needs a why (a scale figure, a soak)."),
        "fastTier": percents(fast_totals),
        "withSlow": percents(reached(with_cov)[2]),
        "slowTests": tests,
        "slowModulesSubprocessOnly": modules,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    unexplained = [name for section in (tests, modules) for name, e in section.items()
                   if (e["onlyLines"] or e["onlyBranches"] or e.get("outcome", "passed") != "passed") and not e["why"]]
    print(f"coverage-audit: wrote {out}: fast tier {result['fastTier']}, with slow {result['withSlow']}; "
          f"{len(unexplained)} entries need a why; data in {scratch}")
    return 1 if any(statuses.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
