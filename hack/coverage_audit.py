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
3. Per slow test, what it reached that the fast tier did not, and the "why" a person wrote
   for it in tests/coverage-audit-why.json (copied in; the audit file itself is only ever
   written by this script); tests/test_coverage_audit.py checks both.

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

Two lanes at once, as `make test` runs (hack/test_streams.sh, tests/streams.py): the
"cluster" lane runs the fast tier's cluster stream, then the slow modules that use a
loopback control plane; the "local" lane the rest. Each pytest's output goes to its data
directory's pytest.log. The comparison with the fast tier is made when both lanes ended.

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
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "operator" / "videojob", REPO / "runtime" / "videojob_runtime"]
OUT = REPO / "tests" / "coverage-audit.json"
WHYS = REPO / "tests" / "coverage-audit-why.json"
SAVE_EVERY_S = 1.0
STREAM_VARIABLE = "VIDEOJOB_TEST_STREAM"  # tests/streams.py: the lanes
STREAMS = ("cluster", "local")
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
    # This thread exists before the program's own code runs: it must not take signals that
    # code blocks in its threads to wait for them (the driver's stopper sigwaits SIGTERM; a
    # SIGTERM delivered here would end the process before its stop could tear anything down).
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
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

def write_rcfile(tier: Path) -> Path:
    tier.mkdir(parents=True, exist_ok=True)
    rc = tier / "coveragerc"
    rc.write_text(RCFILE.format(data=tier / ".coverage", sources="\n    ".join(map(str, SOURCES))))
    return rc


def run_tier(tier: Path, pytest_args: list[str], env: dict[str, str], contexts: bool) -> int:
    """pytest under coverage, its data in ``tier``, its output in tier/pytest.log; pytest's
    exit status."""
    (tier / "site").mkdir(parents=True, exist_ok=True)  # exists: --rerun adds to an earlier run's data
    rc = write_rcfile(tier)
    (tier / "site" / "sitecustomize.py").write_text("import coverage_audit\ncoverage_audit.process_hook()\n")
    path = [str(tier / "site"), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, **env, "COVERAGE_PROCESS_START": str(rc), PYTEST_PROCESS: "1",
           "VIDEOJOB_TEST_TIMINGS": str(tier / "timings.json"),  # outcomes; out/test-timings.json stays
           "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    argv = [sys.executable, "-m", "pytest", *pytest_args, *(["-p", "coverage_audit"] if contexts else [])]
    print(f"coverage-audit: {' '.join(argv[1:])}  (data: {tier})", flush=True)
    started = time.monotonic()
    with open(tier / "pytest.log", "w") as log:
        status = subprocess.run(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    summary = (tier / "pytest.log").read_text(errors="replace").strip().splitlines()[-1:]
    print(f"coverage-audit: exit {status} after {time.monotonic() - started:.0f} s: {' '.join(argv[3:4])} "
          f"{summary[0] if summary else ''}", flush=True)
    return status


def combine(tier: Path, parts: list[Path] | None = None):
    """The per-process data files of ``parts`` (default: the tier itself) combined into
    tier/.coverage (the parts' files are kept: --fast-data)."""
    import coverage

    if not (tier / "coveragerc").is_file():
        write_rcfile(tier)
    cov = coverage.Coverage(config_file=str(tier / "coveragerc"))
    cov.combine(data_paths=[str(p) for p in (parts or [tier])], keep=True)
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
            "lines": totals["num_statements"], "branches": totals["num_branches"],
            "coveredLines": totals["covered_lines"], "coveredBranches": totals["covered_branches"]}


def minus(mine: dict, theirs: dict) -> dict:
    return {name: s - theirs.get(name, set()) for name, s in mine.items() if s - theirs.get(name, set())}


def entry(lines: dict, arcs: dict, fast_lines: dict, fast_arcs: dict, why: str | None) -> dict:
    """What was reached beyond the fast tier, and the why written for it."""
    return {"onlyLines": format_lines(minus(lines, fast_lines)),
            "onlyBranches": format_branches(minus(arcs, fast_arcs)), "why": why or None}


def load_whys(path: Path = WHYS) -> dict:
    """tests/coverage-audit-why.json: {"slowTests": {nodeid: why}, "slowModulesSubprocessOnly":
    {module: why}}, written by hand."""
    whys = json.loads(path.read_text()) if path.is_file() else {}
    return {section: dict(whys.get(section, {})) for section in ("slowTests", "slowModulesSubprocessOnly")}


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


def parse_lines(specs: list[str]) -> set[tuple[str, int]]:
    """["file:3-5,9"] -> {(file, 3), (file, 4), (file, 5), (file, 9)} (format_lines' inverse)."""
    out = set()
    for spec in specs:
        name, _, runs = spec.rpartition(":")
        for run in runs.split(","):
            first, _, last = run.partition("-")
            out.update((name, n) for n in range(int(first), int(last or first) + 1))
    return out


def slow_tests(select: list[str], stream: str = "") -> dict[str, list[str]]:
    """The node ids marked slow, by module (only ``stream``'s modules when given)."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", *select],
                         capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, STREAM_VARIABLE: stream})
    nodeids = list(dict.fromkeys(line for line in res.stdout.splitlines() if "::" in line and not line[0].isspace()))
    if res.returncode not in (0, 5) or (res.returncode == 0 and not nodeids):
        raise RuntimeError(f"collecting the slow tests failed ({res.returncode}):\n"
                           f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
    modules: dict[str, list[str]] = {}
    for nodeid in nodeids:
        modules.setdefault(nodeid.split("::")[0], []).append(nodeid)
    return modules


def run_module(module: str, select: list[str], scratch: Path, stream: str) -> int:
    """Run one module's slow tests under coverage, in its own data directory."""
    picked = [n for n in select if n.startswith(module + "::")] or [module]
    # the environment of `make test-slow` (Makefile: VIDEOJOB_HYGIENE_JOBS=200)
    return run_tier(module_tier(scratch, module), [*picked, "-m", "slow"],
                    {"VIDEOJOB_HYGIENE_JOBS": "200", STREAM_VARIABLE: stream}, contexts=True)


def module_tier(scratch: Path, module: str) -> Path:
    return scratch / "slow" / Path(module).stem


def audit_module(module: str, nodeids: list[str], scratch: Path, fast: tuple[dict, dict],
                 whys: dict) -> tuple[dict, dict, object]:
    """One slow module's data against the fast tier's; (entries by node id, the module's
    entry, its data)."""
    tier = module_tier(scratch, module)
    cov = combine(tier)
    ran = json.loads((tier / "timings.json").read_text())["tests"] if (tier / "timings.json").is_file() else {}
    tests = {}
    for nodeid in nodeids:
        lines, arcs, _ = reached(cov, [f"^{re.escape(nodeid)}$"])
        times = ran.get(nodeid, {})
        tests[nodeid] = {**entry(lines, arcs, *fast, whys["slowTests"].get(nodeid)),
                         "outcome": times.get("outcome", "not run"),
                         "seconds": round(sum(times.get(k, 0) for k in ("setup", "call", "teardown")), 1)}
    # the rest: subprocesses (context ""), and pytest's own process outside tests ("pytest")
    rest = [re.escape(c) for c in set(cov.get_data().measured_contexts()) - set(nodeids)]
    lines, arcs, _ = reached(cov, ["^(" + "|".join(rest) + ")$"]) if rest else ({}, {}, {})
    module_entry = entry(lines, arcs, *fast, whys["slowModulesSubprocessOnly"].get(module))
    return tests, module_entry, cov


def run_lane(stream: str, select: list[str], scratch: Path, fast_tier: bool, modules: dict[str, list[str]],
             statuses: dict[str, int]) -> None:
    """One lane: the fast tier's ``stream`` (unless reused), then its slow modules in turn."""
    if fast_tier:
        statuses[f"fast-{stream}"] = run_tier(scratch / "fast" / stream, [*select, "-m", "not slow"],
                                              {STREAM_VARIABLE: stream}, contexts=False)
    for module in modules:
        statuses[module] = run_module(module, select, scratch, stream)


def earlier_statuses(scratch: Path, lanes: dict, fast_tier: bool) -> dict[str, int]:
    """Each tier's pytest exit status as its timings file recorded it (-1: none recorded)."""
    def status(tier: Path) -> int:
        path = tier / "timings.json"
        return int(json.loads(path.read_text()).get("exitStatus", -1)) if path.is_file() else -1

    found = {f"fast-{stream}": status(scratch / "fast" / stream) for stream in STREAMS} if fast_tier else {}
    if fast_tier and (scratch / "fast" / "rerun").is_dir():
        found["fast-rerun"] = status(scratch / "fast" / "rerun")
    found.update({module: status(module_tier(scratch, module)) for lane in lanes.values() for module in lane})
    return found


def first_run_fast_tier(scratch: Path) -> dict | None:
    """The lanes' own fast tier (without fast/rerun), when --rerun added to it; else None."""
    if not (scratch / "fast" / "rerun").is_dir():
        return None
    return percents(reached(combine(scratch / "fast-first", [scratch / "fast" / s for s in STREAMS]))[2])


def fast_parts(scratch: Path) -> list[Path]:
    """The fast tier's data directories: each lane's, and fast/rerun when --rerun made one."""
    return [scratch / "fast" / part for part in (*STREAMS, "rerun") if (scratch / "fast" / part).is_dir()]


def rerun(tests: list[str], lanes: dict, scratch: Path) -> dict[str, int]:
    """Run ``tests`` again into the earlier run's data; the exit status of each run."""
    slow_modules = {module: stream for stream, modules in lanes.items() for module in modules}
    slow_ids = {nodeid for modules in lanes.values() for nodeids in modules.values() for nodeid in nodeids}
    # a slow module's path: its slow tests; a slow test's node id: that test; anything else: fast tests
    slow = [t for t in tests if t in slow_modules or t in slow_ids]
    fast = [t for t in tests if t not in slow]
    found = {}
    for module in dict.fromkeys(t.split("::")[0] for t in slow):
        found[module] = run_module(module, [t for t in slow if t.split("::")[0] == module and "::" in t],
                                   scratch, slow_modules[module])
    if fast:
        found["fast-rerun"] = run_tier(scratch / "fast" / "rerun", [*fast, "-m", "not slow"], {}, contexts=False)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--select", nargs="+", default=[], help="test files or node ids (default: tests/)")
    ap.add_argument("--fast-data", type=Path, help="a combined fast-tier data file to reuse")
    ap.add_argument("--scratch", type=Path, help="an empty or new directory for the data (default: one in /tmp)")
    ap.add_argument("--out", type=Path, help="default tests/coverage-audit.json ({scratch}/coverage-audit.json "
                                             "with --select)")
    ap.add_argument("--reanalyse", action="store_true",
                    help="run nothing: compare the data an earlier run left in --scratch (after editing the whys)")
    ap.add_argument("--rerun", nargs="+", default=[], metavar="TEST",
                    help="with --reanalyse: run these test files or node ids again first, their data added to "
                         "the earlier run's (a slow module's in its own directory, fast tests in fast/rerun); "
                         "for tests added since the run, or that the audit's own harness broke")
    args = ap.parse_args()
    if args.rerun and not args.reanalyse:
        sys.exit("coverage-audit: --rerun goes with --reanalyse (a full run runs everything anyway)")
    os.chdir(REPO)  # the report's file names are relative to the repository
    if args.reanalyse and not (args.scratch and (args.scratch / "fast").is_dir()):
        sys.exit("coverage-audit: --reanalyse needs the --scratch directory of an earlier run")
    scratch = (args.scratch or Path(tempfile.mkdtemp(prefix="coverage-audit-"))).resolve()
    if scratch.exists() and any(scratch.iterdir()) and not args.reanalyse:
        sys.exit(f"coverage-audit: {scratch} is not empty (its data would mix with this run's)")
    scratch.mkdir(parents=True, exist_ok=True)
    out = args.out or (scratch / "coverage-audit.json" if args.select else OUT)
    select = args.select or ["tests"]
    started = time.monotonic()
    statuses: dict[str, int] = {}

    import coverage

    lanes = {stream: slow_tests(select, stream) for stream in STREAMS}
    if args.reanalyse:
        statuses.update(earlier_statuses(scratch, lanes, fast_tier=not args.fast_data))
        statuses.update(rerun(args.rerun, lanes, scratch))
    else:
        threads = [threading.Thread(target=run_lane, name=f"lane-{stream}",
                                    args=(stream, select, scratch, not args.fast_data, lanes[stream], statuses))
                   for stream in STREAMS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if args.fast_data:
        fast_cov = coverage.Coverage(data_file=str(args.fast_data.resolve()))
        fast_cov.load()
    else:
        fast_cov = combine(scratch / "fast", fast_parts(scratch))
    fast_lines, fast_arcs, fast_totals = reached(fast_cov)

    whys = load_whys()
    tests, modules = {}, {}
    every = coverage.CoverageData(str(scratch / "with-slow.coverage"))
    every.update(fast_cov.get_data())
    for module, nodeids in sorted(m for lane in lanes.values() for m in lane.items()):
        found, modules[module], cov = audit_module(module, nodeids, scratch, (fast_lines, fast_arcs), whys)
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
        "coverage": ("fastTier: what `make test` (the tests not marked slow) reaches, --rerun's data included; "
                     "fastTierBeforeReruns (when there were reruns): the run's own fast tier, before tests added "
                     "or broken by the harness were run again into its data; withSlow: every test, which is what "
                     "`make test` ran before slow tests left it (none was deleted): the coverage before the split, "
                     "against which fastTier must not fall except by the entries below, each with its why."),
        "fastTier": percents(fast_totals),
        "fastTierBeforeReruns": first_run_fast_tier(scratch) if not args.fast_data else None,
        "withSlow": percents(reached(with_cov)[2]),
        "slowTests": tests,
        "slowModulesSubprocessOnly": modules,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    unexplained = [name for section in (tests, modules) for name, e in section.items()
                   if (e["onlyLines"] or e["onlyBranches"] or e.get("outcome", "passed") != "passed") and not e["why"]]
    print(f"coverage-audit: wrote {out}: fast tier {result['fastTier']}, with slow {result['withSlow']}; "
          f"{len(unexplained)} entries need a why; data in {scratch}")
    # a fast lane with nothing selected (--select of one stream's modules) collected nothing: not a failure
    failed = {k: v for k, v in statuses.items() if v and not (k.startswith("fast-") and v == 5 and args.select)}
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
