"""An instant, in-memory stand-in for Ray, and the operator run with it.

``InstantRay`` implements ``videojob.raycluster.client.RayClient`` (version,
submit, job, logs, jobs, stop, delete, actors, placement_groups) without any
process or HTTP behind it: a submitted driver is SUCCEEDED at once (or after
``delay_s``), and its logs hold a progress record and the ``result`` record a
real driver prints (``videojob.driver_protocol``), so the operator finishes
the job exactly as it would after a real run. No actors or placement groups
ever exist (``[]``): a group is "gone" as soon as it is asked about.

Run as a script, it is the operator of the load benchmark
(``benchmarks/operator_load.py``): the real controller, the real kopf handlers
(``videojob.controller.handlers.build_registry``), the real Kubernetes client,
with only Ray replaced::

    python benchmarks/fake_ray.py --namespace NS --stats stats.json [--delay-s 0]

It writes ``--stats`` (JSON, replaced atomically about twice a second and at
exit): its calls to the API server (count and seconds, by kind), events
posted, planning and admission seconds, Ray calls, threads, and its own RSS
and peak RSS (VmHWM) read from /proc/self/status.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from videojob.driver_protocol import DriverRequest, record
from videojob.raycluster.client import RayJob


@dataclass
class _Driver:
    submission_id: str
    entrypoint: str
    metadata: dict[str, str]
    submitted: float
    stopped: bool = False
    request: dict[str, Any] = field(default_factory=dict)


class InstantRay:
    """``RayClient`` in memory: drivers end (SUCCEEDED) ``delay_s`` after their submission."""

    address = "instant-ray (in memory)"

    def __init__(self, delay_s: float = 0.0, peak_gib: float = 20.0):
        self.delay_s = delay_s
        self.peak_gib = peak_gib
        self._drivers: dict[str, _Driver] = {}
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()

    # -- Jobs API --------------------------------------------------------------

    def version(self) -> dict[str, Any]:
        self.calls["version"] += 1
        return {"version": "instant", "ray_version": "instant", "ray_commit": "none"}

    def submit(self, submission_id: str, entrypoint: str, *, runtime_env: dict[str, Any] | None = None,
               metadata: dict[str, str] | None = None, entrypoint_num_cpus: float = 0,
               entrypoint_resources: dict[str, float] | None = None) -> bool:
        self.calls["submit"] += 1
        request: dict[str, Any] = {}
        if " --request " in entrypoint:  # a job's driver (teardown drivers carry --teardown)
            request = DriverRequest.decode(entrypoint.split(" --request ", 1)[1].split()[0]).model_dump()
        with self._lock:
            if submission_id in self._drivers:
                return False  # Ray answers "already exists": the caller adopts it
            self._drivers[submission_id] = _Driver(submission_id, entrypoint, dict(metadata or {}), time.monotonic(),
                                                   request=request)
            return True

    def _status(self, driver: _Driver) -> str:
        if driver.stopped:
            return "STOPPED"
        return "SUCCEEDED" if time.monotonic() - driver.submitted >= self.delay_s else "RUNNING"

    def _ray_job(self, driver: _Driver) -> RayJob:
        status = self._status(driver)
        start_ms = int(driver.submitted * 1000)
        return RayJob(driver.submission_id, status, "" if status != "STOPPED" else "stopped",
                      start_time_ms=start_ms, end_time_ms=start_ms if status != "RUNNING" else None,
                      metadata=dict(driver.metadata))

    def job(self, submission_id: str) -> RayJob | None:
        self.calls["job"] += 1
        with self._lock:
            driver = self._drivers.get(submission_id)
            return self._ray_job(driver) if driver is not None else None

    def log_tail(self, submission_id: str, lines: int, node_id: str | None = None) -> str:
        self.calls["log_tail"] += 1
        return "\n".join(self._log(submission_id).splitlines()[-lines:])

    def logs(self, submission_id: str) -> str:
        self.calls["logs"] += 1
        return self._log(submission_id)

    def _log(self, submission_id: str) -> str:
        with self._lock:
            driver = self._drivers.get(submission_id)
            if driver is None:
                return ""
            status = self._status(driver)
        request = driver.request
        if not request:  # a teardown driver: it found nothing (no actors exist here)
            return record("result", ok=True, removed=[]) + "\n" if status != "RUNNING" else ""
        job = request.get("job") or {}
        group = request.get("group") or {}
        steps = int(job.get("steps") or job.get("num_inference_steps") or 50)
        lines = [record("group", name=group.get("name"), reused=False, world=1, seconds=0.0),
                 record("progress", step=steps if status != "RUNNING" else 0, steps=steps, stage="denoise")]
        if status == "SUCCEEDED":
            name = request.get("name", "video")
            uri = request.get("output_uri") or f"pvc://videos/{name}"  # the directory holding NAME.mp4
            lines.append(record(
                "result", ok=True, steps=steps, groupName=group.get("name"), groupKept=bool(group.get("keep")),
                groupReused=False, framesDigest="sha256:" + "0" * 64,
                output={"uri": uri, "bytes": 1_000_000},
                measured={"peakGiB": self.peak_gib, "loadSeconds": 0.0, "denoiseSeconds": 0.0,
                          "decodeSeconds": 0.0}))
        elif status == "STOPPED":
            lines.append(record("result", ok=False, error={"reason": "Cancelled", "stage": "run",
                                                            "message": "stopped"}))
        return "\n".join(lines) + "\n"

    def jobs(self) -> list[RayJob]:
        self.calls["jobs"] += 1
        with self._lock:
            return [self._ray_job(d) for d in self._drivers.values()]

    def stop(self, submission_id: str) -> bool:
        self.calls["stop"] += 1
        with self._lock:
            driver = self._drivers.get(submission_id)
            if driver is None:
                return False
            if self._status(driver) == "RUNNING":
                driver.stopped = True
            return True

    def delete(self, submission_id: str) -> bool:
        self.calls["delete"] += 1
        with self._lock:
            return self._drivers.pop(submission_id, None) is not None

    # -- State API -------------------------------------------------------------

    def actors(self, name_prefix: str = "", alive_only: bool = True,
               where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        self.calls["actors"] += 1
        return []

    def placement_groups(self, name_prefix: str = "", live_only: bool = True,
                         where: dict[str, str] | None = None) -> list[dict[str, Any]]:
        self.calls["placement_groups"] += 1
        return []

    @property
    def submitted(self) -> int:
        with self._lock:
            return len(self._drivers)


# -- the operator with InstantRay --------------------------------------------


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS) in KiB and Threads, from /proc/<pid>/status."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM", "Threads"):
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


class _Timed:
    """Counts and seconds per call kind (thread-safe enough: one lock per update)."""

    def __init__(self):
        self.count: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.count[kind] += 1
            self.seconds[kind] += seconds

    def wrap(self, kind: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(kind, time.perf_counter() - start)
        return timed

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {k: {"calls": self.count[k], "seconds": round(self.seconds[k], 3)} for k in sorted(self.count)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namespace", required=True, action="append",
                        help="a namespace to watch (repeat for several)")
    parser.add_argument("--stats", required=True, help="JSON file the counters are written to")
    parser.add_argument("--delay-s", type=float, default=0.0, help="seconds a driver runs before SUCCEEDED")
    parser.add_argument("--api-pool", type=int, default=None,
                        help="experiment: urllib3 pool size of the operator's own Kubernetes client "
                             "(default: the client's own, 5 x CPUs)")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--memory-profile", help="diagnosis: where the operator's Python memory is (tracemalloc, "
                                                 "4 frames; slows it), the top sites written to this file each 10 s")
    args = parser.parse_args(argv)
    if args.memory_profile:
        import tracemalloc

        tracemalloc.start(4)

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Per-admission and per-job INFO lines are the operator's normal output; kept.

    import kopf

    from videojob.controller import handlers, lifecycle
    from videojob.controller.kube import VideoJobs
    from videojob.controller.operator import Controller
    from videojob.settings import OperatorSettings

    timed = _Timed()
    events = Counter()

    class TimedVideoJobs(VideoJobs):
        """The real client; each call counted and timed (what the operator asks of the API server)."""

        def _call(self, kind, fn, *call_args, **call_kwargs):
            start = time.perf_counter()
            try:
                return fn(*call_args, **call_kwargs)
            except Exception as exc:
                # Failed calls by HTTP status (409 Conflict, 404 Gone, 429 Too Many Requests, ...)
                code = getattr(exc, "status", None) or {"Conflict": 409, "Gone": 404}.get(type(exc).__name__)
                timed.add(f"{kind}.failed.{code or type(exc).__name__}", 0.0)
                raise
            finally:
                timed.add(kind, time.perf_counter() - start)

        def get(self, namespace, name):
            return self._call("api.get", super().get, namespace, name)

        def list(self, namespaces, **kwargs):
            return self._call("api.list", super().list, namespaces, **kwargs)

        def patch_status(self, namespace, name, status, expect=None, uid=None, known=None):
            return self._call("api.patchStatus", super().patch_status, namespace, name, status, expect, uid, known)

    def post_event(*event_args) -> None:
        events[event_args[4]] += 1  # by reason (the phase)
        handlers._post_event(*event_args)

    # Planning time, measured where the lifecycle calls the planner (no behaviour change).
    lifecycle.plan_classes = timed.wrap("planner.planClasses", lifecycle.plan_classes)

    settings = OperatorSettings().model_copy(update={"namespaces": list(args.namespace)})
    ray = InstantRay(delay_s=args.delay_s)
    api = None
    if args.api_pool:
        from kubernetes import client as k8s
        from kubernetes import config as k8s_config

        configuration = k8s.Configuration()
        k8s_config.load_kube_config(client_configuration=configuration)
        configuration.connection_pool_maxsize = args.api_pool
        api = k8s.ApiClient(configuration)
    controller = Controller(settings, ray=ray, jobs=TimedVideoJobs(api), event=post_event)
    controller.admissions.request = timed.wrap("admissions.request", controller.admissions.request)
    registry, controller = handlers.build_registry(settings, controller)

    kopf_settings: dict[str, Any] = {}

    @kopf.on.startup(registry=registry)
    def _record_kopf_settings(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Registered after the operator's own startup handler: what it configured.
        kopf_settings.update({
            "execution.max_workers": settings.execution.max_workers,
            "queueing.worker_limit": settings.queueing.worker_limit,
            "queueing.idle_timeout": settings.queueing.idle_timeout,
            "posting.worker_limit": settings.posting.worker_limit,
            "posting.level": logging.getLevelName(settings.posting.level),
            "watching.server_timeout": settings.watching.server_timeout,
            "watching.client_timeout": settings.watching.client_timeout,
            "background.instant_exit_timeout": settings.background.instant_exit_timeout,
            "persistence.finalizer": settings.persistence.finalizer,
        })

    started = time.time()
    stop = threading.Event()
    peak = {"threads": 0}
    stats_path = Path(args.stats)

    def write_stats() -> None:
        document = {
            "pid": os.getpid(), "started": started, "at": time.time(), "proc": proc_status(),
            "threadsPython": threading.active_count(),
            "threadsPythonPeak": max(peak["threads"], threading.active_count()), "calls": timed.snapshot(),
            "statusWrites": timed.count["api.patchStatus"] - sum(
                n for k, n in timed.count.items() if k.startswith("api.patchStatus.failed.")),
            "apiPool": args.api_pool, "events": dict(events),
            "ray": dict(ray.calls), "raySubmitted": ray.submitted, "kopf": kopf_settings,
            "parked": controller.runner.parked, "lifecycles": len(controller._lifecycles),
            "operatorSettings": {k: getattr(settings, k) for k in (
                "max_workers", "poll_interval_s", "queue_status_interval_s", "progress_interval_s",
                "watch_timeout_s", "warm_group_ttl_s", "sweep_interval_s", "ray_retry_s")},
        }
        tmp = stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(document, indent=1))
        os.replace(tmp, stats_path)

    def memory_profile() -> None:
        import tracemalloc

        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        top = snapshot.statistics("traceback")[:40]
        lines = [f"traced {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MiB; lifecycles "
                 f"{len(controller._lifecycles)}; parked {controller.runner.parked}"]
        for stat in top:
            lines.append(f"{stat.size / 2**20:8.1f} MiB {stat.count:9d} blocks")
            lines.extend(f"      {frame.filename}:{frame.lineno}" for frame in stat.traceback)
        Path(args.memory_profile).write_text("\n".join(lines) + "\n")

    def stats_loop() -> None:
        ticks = 0
        while not stop.wait(0.5):
            ticks += 1
            if args.memory_profile and ticks % 20 == 0:
                memory_profile()
            request = stats_path.parent / "census.request"
            if request.exists():
                request.unlink()
                try:
                    census()
                except Exception:  # noqa: BLE001 - a diagnosis must never stop the operator
                    logging.getLogger("bench").exception("memory census failed")
            peak["threads"] = max(peak["threads"], threading.active_count())
            try:
                write_stats()
            except OSError:
                pass

    def census() -> None:
        """The live objects by type (count, shallow bytes), written next to --stats when
        ``census.request`` appears there (the stats thread looks twice a second): what each
        job costs in memory, without tracemalloc's slowdown. Off kopf's loop: a signal
        handler ran on it, and an object whose size cannot be read stopped the operator."""
        import gc

        counts: Counter[str] = Counter()
        sizes: Counter[str] = Counter()
        for obj in gc.get_objects():
            kind = f"{type(obj).__module__}.{type(obj).__qualname__}"  # __module__ is not always a str
            counts[kind] += 1
            try:
                sizes[kind] += sys.getsizeof(obj)
            except Exception:  # noqa: BLE001 - an object whose __sizeof__ fails: counted, not sized
                pass
        lines = [f"lifecycles {len(controller._lifecycles)} parked {controller.runner.parked} "
                 f"rss {proc_status().get('VmRSS')} KiB"]
        lines += [f"{sizes[k] / 2**20:9.1f} MiB {counts[k]:9d} {k}" for k, _ in sizes.most_common(60)]
        tmp = stats_path.parent / "census.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, stats_path.parent / "census.txt")

    threading.Thread(target=stats_loop, name="bench-stats", daemon=True).start()
    try:
        kopf.run(registry=registry, standalone=True, namespaces=list(args.namespace), clusterwide=False,
                 memo=kopf.Memo(controller=controller))
    finally:
        stop.set()
        controller.stop()
        write_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
