"""Where `make test`'s time goes: benchmarks/results/test_suite.json from the timings
that tests/suite_timings.py wrote during the run (out/test-timings.json).

    python benchmarks/test_suite.py --make-test-seconds 1800 [--timings out/test-timings.json]

.ci/run calls it after `make test` with the seconds it measured. The file
(test_suite_no_caches.json for a run that found no cache: issue 35's two budgets) holds
makeTestSeconds, setupSeconds (the seconds before the tests started: the cold venv and
control plane build side by side, or a check of the caches), setup (out/setup-timings.json:
when each part was ready, and which Go tools built beside the tests), ciSeconds, which caches were there at the start
(noCaches: none), pytestSeconds, the test count by outcome, goBuildSeconds (the
cold Go builds of the cached tools, as each build recorded them: measured once
per machine; builds side by side share the cores, so their sum exceeds the wall), seconds by module, the 30 longest tests and the 30 longest
long-lived fixture set-ups, and the service start-ups (Ray heads, ...).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import REPO, write_result  # noqa: E402

TOOLS = ["tools", "kwok", "kuberay", "kueue", "helm"]
SETUP_TIMINGS = REPO / "out" / "setup-timings.json"


def go_build_seconds() -> dict[str, int | None]:
    """Each cached Go tool's cold build seconds (None: built before builds recorded them)."""
    out: dict[str, int | None] = {}
    for tool in TOOLS:
        script = "build-tools.sh" if tool == "tools" else "build-gotool.sh"
        args = ["bash", str(REPO / "hack" / "cluster" / script)] + ([] if tool == "tools" else [tool]) + ["--print"]
        res = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
        bin_dir = Path(res.stdout.strip()) if res.returncode == 0 and res.stdout.strip() else None
        record = bin_dir / ".build-seconds" if bin_dir else None
        out[tool] = int(record.read_text()) if record and record.is_file() else None
    return out


def _cores(busy: float | None, wall: float | None, cpus: int | None) -> float | None:
    """Busy CPU seconds over wall seconds; None under a second of wall time, where the
    kernel's 10 ms ticks make the ratio noise (and never above the machine's cores)."""
    if busy is None or not wall or wall < 1.0:
        return None
    return round(min(busy / wall, cpus or busy / wall), 2)


def summarize(timings: dict, top: int = 30) -> dict:
    tests = timings["tests"]
    seconds = {nodeid: round(t["setup"] + t["call"] + t["teardown"], 2) for nodeid, t in tests.items()}
    by_module: dict[str, float] = defaultdict(float)
    busy_by_module: dict[str, float] = defaultdict(float)
    wall_by_module: dict[str, float] = defaultdict(float)
    for nodeid, secs in seconds.items():
        by_module[nodeid.split("::")[0]] += secs
        busy_by_module[nodeid.split("::")[0]] += tests[nodeid].get("busyCpuSeconds") or 0.0
        wall_by_module[nodeid.split("::")[0]] += tests[nodeid].get("wallSeconds") or 0.0
    fixtures: dict[str, dict] = {}
    for f in timings["fixtures"]:
        entry = fixtures.setdefault(f["fixture"], {"fixture": f["fixture"], "scope": f["scope"],
                                                   "setups": 0, "seconds": 0.0})
        entry["setups"] += 1
        entry["seconds"] = round(entry["seconds"] + f["seconds"], 2)
    starts: dict[str, dict] = {}
    for s in timings.get("starts", []):
        entry = starts.setdefault(s["kind"], {"starts": 0, "seconds": 0.0})
        entry["starts"] += 1
        entry["seconds"] = round(entry["seconds"] + s["seconds"], 2)
    longest = sorted(seconds.items(), key=lambda kv: -kv[1])[:top]
    return {
        "pytestSeconds": timings["pytestSeconds"],
        "pytestExitStatus": timings["exitStatus"],
        # the machine's cores kept busy while pytest ran (all processes: the suite's and any other)
        "cpuBusyFraction": timings.get("cpuBusyFraction"),
        "cpuCount": timings.get("cpuCount"),
        "pytestArgs": timings.get("args"),
        # `make test` runs two pytest processes at once (hack/test_streams.sh): each one's seconds
        "streams": timings.get("streams"),
        "tests": len(tests),
        "outcomes": dict(Counter(t["outcome"] for t in tests.values())),
        "testSecondsSum": round(sum(seconds.values()), 1),
        "modules": {m: round(s, 1) for m, s in sorted(by_module.items(), key=lambda kv: -kv[1])},
        # cores the machine kept busy on average while each module ran (of cpuCount)
        "moduleBusyCores": {m: _cores(busy_by_module[m], wall_by_module[m], timings.get("cpuCount"))
                            for m, _ in sorted(by_module.items(), key=lambda kv: -kv[1])},
        "longestTests": [{"test": nodeid, "seconds": secs, **{k: tests[nodeid][k] for k in
                                                              ("setup", "call", "teardown")},
                          # cores the machine kept busy on average while it ran (of cpuCount)
                          "busyCores": _cores(tests[nodeid].get("busyCpuSeconds"), tests[nodeid].get("wallSeconds"),
                                              timings.get("cpuCount"))}
                         for nodeid, secs in longest],
        "longestFixtures": sorted(fixtures.values(), key=lambda f: -f["seconds"])[:top],
        "serviceStarts": starts,
    }


STREAM_TIMINGS = [REPO / "out" / f"test-timings-{name}.json" for name in ("cluster", "local")]


def result_name(no_caches: bool) -> str:
    """The results file: one for each of issue 35's budgets (30 min with the Go tools cached,
    40 with no cache at all), so that a run of one does not replace the other's."""
    return "test_suite_no_caches.json" if no_caches else "test_suite.json"


def default_timings() -> list[Path]:
    """`make test`'s two streams' files when both are there, else one process's file."""
    if all(p.is_file() for p in STREAM_TIMINGS):
        return STREAM_TIMINGS
    return [REPO / "out" / "test-timings.json"]


def merge(documents: list[dict], names: list[str]) -> dict:
    """One timings document from the streams that ran side by side: their tests together;
    pytestSeconds the longer stream's (the wall time); the machine's busy fraction from the
    longer stream (it spans the other); each stream's own seconds and test count kept."""
    if len(documents) == 1:
        return documents[0]
    longest = max(documents, key=lambda d: d["pytestSeconds"])
    return {"pytestSeconds": longest["pytestSeconds"],
            "exitStatus": max(int(d["exitStatus"]) for d in documents),
            "cpuBusyFraction": longest.get("cpuBusyFraction"), "cpuCount": longest.get("cpuCount"),
            "args": longest.get("args"),
            "tests": {k: v for d in documents for k, v in d["tests"].items()},
            "fixtures": [f for d in documents for f in d["fixtures"]],
            "starts": [s for d in documents for s in d.get("starts", [])],
            "streams": [{"stream": name, "pytestSeconds": d["pytestSeconds"], "tests": len(d["tests"]),
                         "exitStatus": d["exitStatus"]} for name, d in zip(names, documents)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timings", type=Path, nargs="+", default=None,
                    help="the timings files (default: the two streams' of `make test`, "
                         "out/test-timings-{cluster,local}.json, else out/test-timings.json)")
    ap.add_argument("--make-test-seconds", type=float, required=True,
                    help="`make test`'s wall seconds, venv and Go tools included (.ci/run measures it)")
    ap.add_argument("--setup-seconds", type=float, help="the seconds before the tests started (default: "
                    "streamsStartSeconds of out/setup-timings.json, which hack/test_streams.sh writes)")
    ap.add_argument("--setup-timings", type=Path, default=SETUP_TIMINGS,
                    help="when each part of `make test`'s setup was ready (default out/setup-timings.json)")
    ap.add_argument("--ci-seconds", type=float, help=".ci/run's wall seconds up to the end of `make test`")
    ap.add_argument("--caches", nargs="*", default=[], metavar="NAME=present|empty",
                    help="which caches .ci/run found at its start (videojobTools, goBuild, goModules, pip)")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/test_suite.json, or "
                    "test_suite_no_caches.json when --caches says every cache was empty (the two budgets)")
    args = ap.parse_args()
    paths = args.timings or default_timings()
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        print(f"test_suite: no timings at {', '.join(missing) or 'out/'} (tests/suite_timings.py writes them)",
              file=sys.stderr)
        return 1
    timings = merge([json.loads(p.read_text()) for p in paths], [p.stem.removeprefix("test-timings-") for p in paths])
    builds = go_build_seconds()
    caches = dict(c.split("=", 1) for c in args.caches if "=" in c)
    setup = json.loads(args.setup_timings.read_text()) if args.setup_timings.is_file() else None
    setup_seconds = args.setup_seconds if args.setup_seconds is not None else (setup or {}).get("streamsStartSeconds")
    no_caches = bool(caches) and all(v == "empty" for v in caches.values())
    result = {"makeTestSeconds": round(args.make_test_seconds, 1),
              "setupSeconds": None if setup_seconds is None else round(float(setup_seconds), 1),
              "setup": setup,
              "ciSeconds": None if args.ci_seconds is None else round(args.ci_seconds, 1),
              "cachesAtStart": caches or None,
              "noCaches": no_caches,
              **summarize(timings),
              "goBuildSeconds": sum(v for v in builds.values() if v) if any(builds.values()) else None,
              "goBuildSecondsByTool": builds}
    path = write_result(result_name(no_caches), result, args.out)
    print(f"test_suite: wrote {path}: make test {result['makeTestSeconds']} s, pytest "
          f"{result['pytestSeconds']} s, {result['tests']} tests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
