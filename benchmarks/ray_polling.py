"""Watching 500 Ray jobs through a real Ray head's dashboard: per-job polling vs the shared job table.

Issue 22: every running VideoJob used to ask Ray twice a second for its own
driver (``GET /api/jobs/<id>``) and for its whole log
(``GET /api/jobs/<id>/logs``). The operator now reads Ray's job table once per
``poll_interval_s`` for all of them (``raycluster.jobtable.JobTable``) and a
driver's last lines (``log_tail``, served by the node's log agent from the end
of the file) at most every ``progress_interval_s``. This runs both against one
real Ray head (``ray start --head`` with its dashboard, as the tests start it),
side by side, and records per mode:

- requests per second sent to the dashboard, by kind, and their latency;
- CPU seconds per second of the head's processes (dashboard, its agent, GCS,
  raylet), from /proc, and of the watchers (this process);
- how late a watcher saw its driver's status: the gap between two answers,
  p50/p99/max (a driver's end is seen at most this late).

The jobs: ``--jobs`` real Ray jobs, each a driver that printed ``--log-lines``
JSON progress lines and ended. 500 live drivers are 500 job supervisor
processes, more than this 2-core machine holds; the requests measured cost the
same for a driver that has ended (status from the GCS's job table, the log
from its file on the node), which the record says. The watchers emulate the
operator's cadence with the operator's own client classes (``HttpRayClient``,
``JobTable``), one thread per job as a busy operator has.

Writes benchmarks/results/ray_polling.json (machine.write_result). ~6 min on
2 cores, most of it starting the 500 drivers.

    python benchmarks/ray_polling.py [--jobs 500] [--seconds 30]
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests"), str(REPO / "operator")]

import psutil  # noqa: E402

from machine import write_result  # noqa: E402

# What a driver prints: one progress record a step, as runtime/videojob_runtime/driver.py does.
DRIVER = ("import json,sys\n"
          "for step in range({lines}):\n"
          "    print(json.dumps({{'videojob': 1, 'type': 'progress', 'stage': 'denoise', 'step': step,"
          " 'steps': {lines}, 'elapsedS': step * 0.5}}))\n")

# The cadence the operator used before issue 22 (watching.py then: both, twice a second).
OLD_POLL_S = 0.5


def head_processes(root_pid: int) -> dict[str, list[psutil.Process]]:
    """The head's processes that answer the watchers, by role."""
    roles: dict[str, list[psutil.Process]] = {"dashboard": [], "dashboardAgent": [], "gcs": [], "raylet": []}
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "dashboard/dashboard.py" in cmd:
            roles["dashboard"].append(proc)
        elif "dashboard/agent.py" in cmd:
            roles["dashboardAgent"].append(proc)
        elif "gcs_server" in cmd:
            roles["gcs"].append(proc)
        elif "raylet" in cmd and "agent" not in cmd:
            roles["raylet"].append(proc)
    return roles


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def make_jobs(ray, count: int, lines: int, deadline_s: float) -> list[str]:
    """``count`` drivers that printed ``lines`` progress records and ended; their submission ids."""
    ids = [f"vj-bench-poll-{i:04d}" for i in range(count)]
    entrypoint = f"{shlex.quote(sys.executable)} -c {shlex.quote(DRIVER.format(lines=lines))}"
    window = 12  # drivers starting at once: each is a job supervisor process
    start = time.monotonic()

    def one(sid: str) -> None:
        ray.submit(sid, entrypoint, metadata={"bench": "ray_polling"})
        while True:
            job = ray.job(sid)
            if job is not None and job.terminal:
                if job.status != "SUCCEEDED":
                    raise RuntimeError(f"driver {sid} ended {job.status}: {job.message}")
                return
            if time.monotonic() - start > deadline_s:
                raise TimeoutError(f"driver {sid} did not end within {deadline_s:.0f} s")
            time.sleep(0.5)

    with ThreadPoolExecutor(window) as pool:
        for n, _ in enumerate(pool.map(one, ids), 1):
            if n % 50 == 0:
                print(f"ray_polling: {n}/{count} drivers done ({time.monotonic() - start:.0f} s)", flush=True)
    return ids


class _Counted:
    """The client the job table reads through: each request it sends counted and timed."""

    def __init__(self, ray, watchers: "Watchers") -> None:
        self.ray, self.watchers = ray, watchers

    def jobs(self):
        return self.watchers._timed("GET /api/jobs/", self.ray.jobs) or []

    def job(self, sid: str):
        return self.watchers._timed("GET /api/jobs/{id}", lambda: self.ray.job(sid))


class Watchers:
    """One thread per job, polling as the operator of ``mode`` did; counts what it sent."""

    def __init__(self, mode: str, ray, ids: list[str], nodes: dict[str, str | None], settings) -> None:
        from videojob.controller.watching import LOG_TAIL_LINES
        from videojob.raycluster.jobtable import JobTable

        self.mode, self.ray, self.ids, self.nodes = mode, ray, ids, nodes
        self.tail_lines = LOG_TAIL_LINES
        self.poll_s = OLD_POLL_S if mode == "per-job" else settings.poll_interval_s
        self.progress_s = settings.progress_interval_s
        self.table = JobTable(_Counted(ray, self), settings.poll_interval_s) if mode == "job-table" else None
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.latency: dict[str, list[float]] = {}
        self.errors: Counter[str] = Counter()
        self.status_gaps: list[float] = []
        self.stop = threading.Event()

    def _timed(self, kind: str, call):
        began = time.monotonic()
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - counted, not fatal: a saturated dashboard times out
            with self.lock:
                self.errors[f"{kind}: {type(exc).__name__}"] += 1
            return None
        finally:
            with self.lock:
                self.requests[kind] += 1
                self.latency.setdefault(kind, []).append(time.monotonic() - began)

    def _status(self, sid: str):
        if self.table is None:
            return self._timed("GET /api/jobs/{id}", lambda: self.ray.job(sid))
        return self.table.job(sid)  # what reaches Ray is counted by _Counted

    def _watch(self, sid: str, offset: float) -> None:
        self.stop.wait(offset)  # spread over one interval, as jobs that started at different times are
        last_status = None
        last_log = float("-inf")
        gaps = []
        while not self.stop.is_set():
            job = self._status(sid)
            now = time.monotonic()
            if job is not None:
                if last_status is not None:
                    gaps.append(now - last_status)
                last_status = now
            if self.mode == "per-job":
                self._timed("GET /api/jobs/{id}/logs", lambda: self.ray.logs(sid))
            elif now - last_log >= self.progress_s:  # the watcher's "due": news is shown every progress_interval_s
                self._timed("GET /api/v0/logs/file", lambda: self.ray.log_tail(sid, self.tail_lines, self.nodes[sid]))
                last_log = now
            self.stop.wait(self.poll_s)
        with self.lock:
            self.status_gaps.extend(gaps)

    def run(self, seconds: float, roles: dict[str, list[psutil.Process]]) -> dict:
        me = psutil.Process()
        threads = [threading.Thread(target=self._watch, args=(sid, self.poll_s * i / len(self.ids)), daemon=True)
                   for i, sid in enumerate(self.ids)]
        for t in threads:
            t.start()
        self.stop.wait(self.poll_s * 2)  # past the spread start
        with self.lock:
            self.requests.clear(), self.latency.clear(), self.errors.clear()
        cpu0 = {role: cpu_seconds(procs) for role, procs in roles.items()}
        own0 = sum(me.cpu_times()[:2])
        began = time.monotonic()
        self.stop.wait(seconds)
        with self.lock:
            sent = dict(self.requests)
            latency = {k: list(v) for k, v in self.latency.items()}
            errors = dict(self.errors)
        wall = time.monotonic() - began
        cpu = {role: round((cpu_seconds(procs) - cpu0[role]) / wall, 3) for role, procs in roles.items()}
        own = round((sum(me.cpu_times()[:2]) - own0) / wall, 3)
        self.stop.set()
        for t in threads:
            t.join(timeout=60)
        gaps = self.status_gaps
        return {
            "mode": self.mode,
            "cadence": {"statusEveryS": self.poll_s, "logEveryS": self.poll_s if self.mode == "per-job" else self.progress_s,
                        "log": "whole log" if self.mode == "per-job" else f"last {self.tail_lines} lines"},
            "seconds": round(wall, 1),
            "requestsPerS": round(sum(sent.values()) / wall, 1),
            "requestsPerSByKind": {k: round(v / wall, 1) for k, v in sorted(sent.items())},
            "latencyS": {k: {"p50": percentile(v, 0.5), "p99": percentile(v, 0.99)} for k, v in sorted(latency.items())},
            "errors": errors,
            "headCpuCoresByProcess": cpu,
            "headCpuCores": round(sum(cpu.values()), 3),
            "watchersCpuCores": own,
            "statusGapS": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99),
                           "max": round(max(gaps), 3) if gaps else None, "target": self.poll_s},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500, help="Ray jobs watched at once")
    parser.add_argument("--log-lines", type=int, default=300, help="progress lines each driver printed")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds each mode is measured")
    parser.add_argument("--deadline-s", type=float, default=1200.0, help="give up starting the drivers after this long")
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/ray_polling.json)")
    args = parser.parse_args()

    from helpers import RayHead
    from videojob.raycluster.client import HttpRayClient
    from videojob.settings import OperatorSettings

    settings = OperatorSettings()
    with RayHead(num_cpus=2, dashboard=True) as head:
        ray = HttpRayClient(head.dashboard_url, token=head.token, timeout_s=30.0, retries=1)
        print(f"ray_polling: Ray head at {head.dashboard_url}; starting {args.jobs} drivers", flush=True)
        began = time.monotonic()
        ids = make_jobs(ray, args.jobs, args.log_lines, args.deadline_s)
        made_s = time.monotonic() - began
        nodes = {j.submission_id: j.driver_node_id for j in ray.jobs()}
        missing = [sid for sid in ids if not nodes.get(sid)]
        if missing:
            sys.exit(f"ray_polling: Ray names no driver node for {len(missing)} jobs (e.g. {missing[0]})")
        log_bytes = statistics.mean(len(ray.logs(sid).encode()) for sid in ids[:5])
        roles = head_processes(head.process.pid)
        if not roles["dashboard"]:
            sys.exit("ray_polling: found no dashboard process under the Ray head")
        modes = []
        for mode in ("per-job", "job-table"):
            print(f"ray_polling: measuring {mode} for {args.seconds:.0f} s", flush=True)
            result = Watchers(mode, ray, ids, nodes, settings).run(args.seconds, roles)
            print(f"ray_polling: {mode}: {result['requestsPerS']} requests/s, head CPU {result['headCpuCores']} cores, "
                  f"status gap p99 {result['statusGapS']['p99']} s", flush=True)
            modes.append(result)
        ray_version = ray.version().get("ray_version")

    before, after = modes
    result = {
        "benchmark": "ray_polling",
        "what": (f"{args.jobs} VideoJob watchers against one real Ray {ray_version} head's dashboard, side by side: "
                 "per-job polling (before issue 22) vs the shared job table and log tails (now)"),
        "jobs": args.jobs,
        "jobsNote": ("each a real Ray job whose driver printed its progress lines and ended (500 live drivers are 500 "
                     "job supervisor processes, more than this machine holds); status and log requests are "
                     "answered from the GCS's job table and the log file either way"),
        "driverLogBytes": int(log_bytes),
        "secondsStartingDrivers": round(made_s, 1),
        "settings": {"poll_interval_s": settings.poll_interval_s, "progress_interval_s": settings.progress_interval_s},
        "modes": modes,
        "ratios": {
            "requestsPerS": round(before["requestsPerS"] / max(after["requestsPerS"], 1e-9), 2),
            "headCpuCores": round(before["headCpuCores"] / max(after["headCpuCores"], 1e-9), 2),
        },
        "ratiosNote": "before / after, measured in this run",
    }
    path = write_result("ray_polling.json", result, args.out)
    print(f"ray_polling: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
