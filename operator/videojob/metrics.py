"""Prometheus metrics (``videojob_*``) and the liveness endpoint, on one port.

GET /metrics   the registry, in the Prometheus text format
GET /healthz   200 "ok ..." while ``health()`` says so, else 503 with what is stale (videojob/health.py)

A thread per connection, each with a socket timeout: a scraper or client that
connects and sends nothing must not keep the liveness probe from an answer.
"""

from __future__ import annotations

import socket
import socketserver
import sys
import threading
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

PHASES = ("Pending", "Planned", "Queued", "Running", "Succeeded", "Failed", "Cancelled")


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.jobs = Gauge("videojob_jobs", "VideoJobs by phase", ["phase"], registry=r)
        self.queue_length = Gauge("videojob_queue_length", "VideoJobs waiting for GPUs", registry=r)
        self.gpus_allocated = Gauge("videojob_gpus_allocated", "GPUs (or CPU ranks) held by running jobs and "
                                    "idle warm groups, per GPU class", ["gpu_class"], registry=r)
        self.gpus_free = Gauge("videojob_gpus_free", "GPUs (or CPU ranks) free, per GPU class", ["gpu_class"],
                               registry=r)
        self.gpus_idle = Gauge("videojob_gpus_idle", "GPUs held by idle warm groups (loaded, no job), per GPU class",
                               ["gpu_class"], registry=r)
        self.warm_groups = Gauge("videojob_warm_groups", "Idle warm actor groups, by model", ["model"], registry=r)
        self.evictions = Counter("videojob_warm_group_evictions_total", "Idle warm groups torn down",
                                 ["why"], registry=r)
        self.attempts = Counter("videojob_attempts_total", "Attempts that ended, by result", ["result"], registry=r)
        self.memory_ratio = Histogram(
            "videojob_peak_memory_measured_over_estimated", "Measured peak memory per GPU / the plan's estimate",
            buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0), registry=r)
        self.job_seconds = Histogram("videojob_job_duration_seconds", "Wall time of finished jobs",
                                     buckets=(10, 30, 60, 120, 300, 600, 1200, 3600, 7200, 21600), registry=r)
        self.stage_seconds = Histogram("videojob_stage_duration_seconds", "Seconds per stage of finished jobs",
                                       ["stage"], buckets=(0.1, 0.5, 1, 5, 10, 30, 60, 300, 1200, 3600), registry=r)
        self.cache_skip_ratio = Histogram("videojob_cache_skip_ratio", "Share of denoiser work a step cache reused",
                                          buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.jobs_expired = Counter("videojob_jobs_expired_total",
                                    "Finished VideoJobs deleted past their ttlSecondsAfterFinished", registry=r)
        self.submissions = Counter("videojob_ray_submissions_total", "Drivers submitted to Ray", registry=r)
        self.ray_errors = Counter("videojob_ray_errors_total", "Calls to Ray that failed after retries", registry=r)
        self._phases: dict[str, str] = {}
        self._counts: dict[str, int] = {p: 0 for p in PHASES}
        self._published = False
        self._lock = threading.Lock()

    def set_phase(self, key: str, phase: str | None) -> None:
        """Move one job between phase counts: O(1), not a walk over every known job
        (at a restart with tens of thousands of jobs that walk made the rebuild quadratic)."""
        with self._lock:
            before = self._phases.pop(key, None) if phase is None else self._phases.get(key)
            if phase is not None:
                self._phases[key] = phase
            if before == phase:
                return
            for name, delta in ((before, -1), (phase, 1)):
                if name is not None:
                    self._counts[name] = self._counts.get(name, 0) + delta
            changed = {name: self._counts.get(name, 0) for name in (before, phase) if name is not None}
            if not self._published:  # every phase shows from the first change, zeros included
                changed = {p: self._counts.get(p, 0) for p in (*PHASES, *self._counts)}
                self._published = True
            for phase_name, count in changed.items():
                self.jobs.labels(phase=phase_name).set(count)

    def set_capacity(self, snapshot: dict) -> None:
        """From ``Admissions.snapshot()``: per class allocated/free/idle, queue, warm groups by model."""
        for name, c in snapshot["classes"].items():
            self.gpus_allocated.labels(gpu_class=name).set(c["allocated"])
            self.gpus_free.labels(gpu_class=name).set(c["free"])
            self.gpus_idle.labels(gpu_class=name).set(c["idle"])
        self.queue_length.set(snapshot["queued"])
        with self._lock:
            seen = getattr(self, "_models_seen", set())
            for model in seen - set(snapshot["idleGroupsByModel"]):
                self.warm_groups.labels(model=model).set(0)
            for model, count in snapshot["idleGroupsByModel"].items():
                self.warm_groups.labels(model=model).set(count)
            self._models_seen = seen | set(snapshot["idleGroupsByModel"])


CLIENT_TIMEOUT_S = 10.0  # a connection that sends (or reads) nothing for this long is dropped


class _Quiet(WSGIRequestHandler):
    timeout = CLIENT_TIMEOUT_S  # StreamRequestHandler sets it on the socket

    def log_message(self, *args) -> None:  # scrapes every few seconds: not worth a log line
        pass


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stuck client's thread must not hold up the process's exit
    block_on_close = False

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], (socket.timeout, ConnectionError)):
            return  # a client that went quiet or away: nothing to report
        super().handle_error(request, client_address)


def serve(metrics: Metrics, port: int, health: Callable[[], tuple[bool, str]],
          host: str = "0.0.0.0") -> tuple[WSGIServer, int]:
    """Serve /metrics and /healthz on ``port`` (0: a free one) in a daemon thread; returns (server, port).
    ``health()``: (healthy, the body to answer)."""
    metrics_app = make_wsgi_app(metrics.registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/healthz":
            ok, body = health()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [body.encode()]
        return metrics_app(environ, start_response)

    server = make_server(host, port, app, server_class=_ThreadingServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="videojob-metrics", daemon=True).start()
    return server, server.server_port
