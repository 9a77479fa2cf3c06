"""The operator's state shared by every job: Ray, the scheduler, metrics, settings.

``Controller.start`` connects to Ray (starting an embedded head if asked),
rebuilds the scheduler's books from the VideoJob statuses and Ray's State API
(so a restarted operator never admits past its capacity and keeps its warm
groups), serves /metrics and /healthz, and runs the sweeper: idle warm groups
past their TTL, and groups whose owner no longer exists, are torn down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..api.common import API_GROUP, API_VERSION, KIND
from ..api.status import ConditionType, Reason
from ..health import ADMISSIONS, SWEEPER, Health
from ..inventory import load_inventory
from ..metrics import Metrics, serve
from ..raycluster.client import HttpRayClient, RayClient
from ..raycluster.jobtable import JobTable
from ..settings import OperatorSettings
from .kube import TIMEOUT_ATTEMPTS, VideoJobs, api_client
from . import expiry
from .admission import Admissions, pool_key
from .groups import groups_in_ray, owner_uid, teardown_groups
from .hygiene import owner_namespace, prune
from .lifecycle import TERMINAL, Context, JobLifecycle
from .outcome import clip
from .runner import JobRunner, admission_loop
from .spawning import Spawner, StopFlag

log = logging.getLogger("videojob.controller")
EXPIRE_PER_SWEEP = 1000  # finished jobs past their TTL deleted per sweep at most


class Controller:
    def __init__(self, settings: OperatorSettings, ray: RayClient | None = None,
                 jobs: VideoJobs | None = None, event: Callable | None = None):
        self.settings = settings
        self.inventory = load_inventory(settings.inventory_file)
        self.admissions = Admissions(self.inventory, settings.warm_group_ttl_s)
        self.metrics = Metrics()
        self._ray = ray
        self._jobs = jobs
        self._event = event
        self.embedded = None
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.ctx: Context | None = None
        self._lifecycles: dict[str, JobLifecycle] = {}
        self._lock = threading.Lock()
        self.alive = threading.Event()
        self.health = Health(settings.health_stall_s)
        self.runner = JobRunner(self.admissions, settings.max_workers, settings.poll_interval_s,
                                settings.queue_status_interval_s, settings.kueue_poll_interval_s)
        self.spawner = Spawner(self.run_job)  # one task per unfinished job, from kopf's events

    def _ray_client(self) -> RayClient:
        settings = self.settings
        if settings.ray_mode == "embedded":
            from ..raycluster.embedded import start_embedded_ray

            if settings.driver_resources:
                log.warning("VIDEOJOB_DRIVER_RESOURCES=%s in embedded mode: the embedded Ray head offers no such "
                            "resources, so drivers will wait for ever (WaitingForDriver); unset it here",
                            json.dumps(settings.driver_resources))

            self.embedded = start_embedded_ray(num_cpus=settings.embedded_ray_cpus)
            return HttpRayClient(self.embedded.dashboard_url, token=self.embedded.token,
                                 timeout_s=settings.ray_http_timeout_s, retries=settings.ray_http_retries)
        if not settings.ray_dashboard_url:
            raise ValueError("VIDEOJOB_RAY_MODE=address needs VIDEOJOB_RAY_DASHBOARD_URL (e.g. http://head:8265)")
        token = Path(settings.ray_token_file).read_text().strip() if settings.ray_token_file else None
        return HttpRayClient(settings.ray_dashboard_url, token=token, timeout_s=settings.ray_http_timeout_s,
                             retries=settings.ray_http_retries)

    def start(self) -> None:
        ray = self._ray or self._ray_client()
        jobs = self._jobs or VideoJobs(api_client(timeout_s=self.settings.kube_api_timeout_s))
        kueue = None
        if self.settings.admission == "kueue":
            from ..kueue import KueueApi

            kueue = KueueApi(getattr(getattr(jobs, "api", None), "api_client", None)
                             or api_client(timeout_s=self.settings.kube_api_timeout_s), self.settings.namespaces)
        self.runner.workloads = kueue.cache if kueue is not None else None  # parked kueue jobs wake on its events
        self.ctx = Context(jobs=jobs, ray=ray, admissions=self.admissions, inventory=self.inventory,
                           settings=self.settings, metrics=self.metrics, event=self._event or _no_event, kueue=kueue,
                           job_table=JobTable(ray, self.settings.poll_interval_s))
        self.rebuild()
        self.health.start_probe(ADMISSIONS, self.admissions.ping)
        self.metrics_server, self.metrics_port = serve(self.metrics, self.settings.metrics_port, self.healthz)
        self.alive.set()
        threading.Thread(target=self._sweeper, name="videojob-sweeper", daemon=True).start()
        threading.Thread(target=admission_loop, args=(self.admissions, self.alive, self.settings.poll_interval_s),
                         name="videojob-admission", daemon=True).start()
        classes = ", ".join(c.describe() for c in self.inventory.classes)
        log.info("operator ready: %s %s(s) in %s (%s), Ray at %s, drivers run %s, metrics on :%s",
                 self.inventory.capacity, self.inventory.unit, classes, self.inventory.device,
                 getattr(ray, "address", "?"), self.ctx.launch.python, self.metrics_port)

    def rebuild(self) -> None:
        """The scheduler's books from what exists: running attempts from the
        VideoJob statuses, warm groups from statuses that kept one and that Ray
        still has (the State API)."""
        default_class = self.inventory.classes[0].name
        try:
            in_ray = groups_in_ray(self.ctx.ray)
        except Exception as exc:  # noqa: BLE001 - Ray down at start: jobs re-adopt their drivers later
            log.warning("Ray's State API did not answer at start (%s); no warm groups adopted", exc)
            in_ray = {}
        classes = {c.name for c in self.inventory.classes}
        kept: list[tuple[str, str, dict[str, Any], str, str]] = []
        # Running attempts first, then kept groups: a warm group that a running job
        # reused is that job's (its GPUs counted once), even though the job that kept
        # it still says so in its own status.
        for view in self.ctx.jobs.list(self.settings.namespaces, reduce=rebuild_view):
            key, phase = view["key"], view["phase"]
            self.metrics.set_phase(key, phase)
            if "plan" not in view:
                continue  # neither running nor keeping a group: its phase is all the books need
            plan, model, group = view["plan"], view["model"], view["group"]
            pool = pool_key(model, view["source"], plan) if plan else None
            klass = plan.get("gpuClass") or default_class
            if klass not in classes:
                klass = default_class  # the inventory changed under a running job: count it somewhere
            if view["running"]:
                self.admissions.running(key, klass, int(plan.get("gpus") or 1),
                                        float(plan.get("estimatedSeconds") or 60.0), view["attemptGroup"], pool,
                                        started_at=view["attemptStartedAt"])
                continue
            if group.get("name") in in_ray and group.get("poolKey"):
                kept.append((key, klass, plan, model, group))
        for key, klass, plan, model, group in kept:
            if self.admissions.adopt_idle(group["name"], klass, int(plan.get("gpus") or 1), group["poolKey"], model):
                log.info("warm group %s of %s adopted as idle", group["name"], key)
            else:
                log.info("warm group %s of %s not adopted as idle: a running job holds it (it reused it), or "
                         "another job kept it too, or no pod of %s has room for it", group["name"], key, klass)
        self.metrics.set_capacity(self.admissions.snapshot())

    def sweep(self) -> dict[str, list[str]]:
        """One sweep: idle groups past the TTL, and groups nobody owns, are torn down."""
        ray, launch, step = self.ctx.ray, self.ctx.launch, self._sweeper_beat
        expired = self.admissions.expired()
        if expired:
            teardown_groups(ray, expired, launch, "idle past the TTL")
            self.metrics.evictions.labels(why="ttl").inc(len(expired))
            step()
        # Ray's groups first, then the VideoJobs and the books: a group that exists in
        # Ray was named in the books (``Admissions.attach``, before its driver was
        # submitted) and its job created before this listing, so a job admitted
        # meanwhile is never taken for an owner that is gone.
        in_ray = groups_in_ray(ray)
        step()
        live: dict[str, str] = {}
        due: list[expiry.Expired] = []
        ttl_s, clock = self.settings.ttl_seconds_after_finished, time.time()
        # Page by page, only uid -> phase and the expired are kept (not 30,000 whole objects).
        for uid, phase, expired_job in self.ctx.jobs.list(
                self.settings.namespaces, reduce=lambda obj: step() or sweep_view(obj, ttl_s, clock)):
            live[uid] = phase
            if expired_job is not None:
                due.append(expired_job)
        expired_jobs = self._expire(due)
        in_use = self.admissions.groups_in_use()
        # Whose is a group: the uid in its name; which namespace (a namespace-scoped operator
        # leaves alone the groups of namespaces it does not watch): its creator driver's
        # metadata, looked up only for a candidate whose job it does not see.
        scoped = set(self.settings.namespaces)
        ownerless = []
        for group in in_ray:
            step()
            if group in in_use or group in expired:
                continue
            uid = owner_uid(group)
            phase = live.get(uid) if uid else None
            # Not in use by the books: nobody will use it again, whether its job is gone, finished
            # without keeping it, or queued again under a new group (a failed teardown of its
            # attempt's group). The books name a group before its driver is submitted
            # (``Admissions.attach``), so a group being made is in use. A namespace-scoped
            # operator leaves alone the groups of jobs it does not see and does not watch.
            if not scoped or phase is not None or owner_namespace(ray, group, uid) in scoped:
                ownerless.append(group)
        if ownerless:
            teardown_groups(ray, ownerless, launch, "its owner no longer exists")
            self.metrics.evictions.labels(why="ownerless").inc(len(ownerless))
        step()
        prune(ray, live, scoped, self.settings.ray_job_retention_s)  # ended drivers leave Ray's job table
        step()
        self.metrics.set_capacity(self.admissions.snapshot())
        return {"expired": expired, "ownerless": ownerless, "jobsExpired": expired_jobs}

    def _expire(self, due: list[expiry.Expired]) -> list[str]:
        """Finished jobs past their TTL are deleted (``expiry``); at most
        ``EXPIRE_PER_SWEEP`` a sweep, oldest first, so a backlog drains without a burst."""
        gone = []
        for job in sorted(due, key=lambda e: -e.finished_s_ago)[:EXPIRE_PER_SWEEP]:
            self._sweeper_beat()
            try:
                deleted = self.ctx.jobs.delete(job.namespace, job.name, job.uid)
            except Exception as exc:  # noqa: BLE001 - e.g. RBAC without delete: the sweep goes on
                log.warning("could not delete expired %s/%s (%s); the next sweep tries again", job.namespace,
                            job.name, exc)
                break
            if deleted:
                gone.append(f"{job.namespace}/{job.name}")
                self.metrics.jobs_expired.inc()
                log.info("%s/%s expired: %s %.0f s ago, past its ttlSecondsAfterFinished; deleted", job.namespace,
                         job.name, job.phase, job.finished_s_ago)
        return gone

    def sweep_step_limit_s(self) -> float:
        """The longest a healthy sweep goes without a step done: one call to the API server
        waiting out its timeout in each of its tries (with their backoff), or Ray's tries."""
        s = self.settings
        return max(TIMEOUT_ATTEMPTS * (s.kube_api_timeout_s + 2.0), (s.ray_http_retries + 1) * s.ray_http_timeout_s)

    def _sweeper_beat(self) -> None:
        self.health.beat(SWEEPER, self.sweep_step_limit_s())

    def _sweeper(self) -> None:
        while self.alive.is_set():
            deadline = time.monotonic() + self.settings.sweep_interval_s
            while self.alive.is_set() and time.monotonic() < deadline:
                self._sweeper_beat()
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            if not self.alive.is_set():
                return
            try:
                self._sweeper_beat()
                self.sweep()
            except Exception:  # noqa: BLE001 - Ray or the API server away: next sweep
                log.warning("sweep failed; trying again in %.0f s", self.settings.sweep_interval_s, exc_info=True)

    def lifecycle(self, namespace: str, name: str, uid: str) -> JobLifecycle:
        key = f"{namespace}/{name}"
        with self._lock:
            current = self._lifecycles.get(key)
            if current is None or current.uid != uid:
                current = self._lifecycles[key] = JobLifecycle(self.ctx, namespace, name, uid)
            return current

    async def run_job(self, namespace: str, name: str, uid: str, stopped: StopFlag) -> None:
        """A job's task (spawning.py): its lifecycle on the job runner until it ends or is stopped.
        A failure the lifecycle does not handle (a 403 from RBAC the operator lacks, a bug) is
        said in the job's status before the spawner runs it again: it was only in the log."""
        lifecycle = self.lifecycle(namespace, name, uid)
        try:
            await self.runner.run(lifecycle, stopped)
        except Exception as exc:
            await asyncio.get_running_loop().run_in_executor(None, show_operator_error, lifecycle, exc,
                                                             self.spawner.retry_in(1))
            raise
        if not stopped:  # the job ended (a stopped one is the finalizer's, which drops it)
            self.forget(namespace, name, uid)

    def needs_lifecycle(self, status: dict[str, Any] | None) -> bool:
        """Whether a job kopf just found needs its lifecycle run: not one that had ended
        before this operator saw it (a restart with 20,000 finished jobs read each one
        again, a GET and a thread turn each, before the queue moved). In kueue mode
        it does: its end may not have released its Workload yet (``_kueue_release``)."""
        return self.settings.admission == "kueue" or (status or {}).get("phase") not in TERMINAL

    def forget(self, namespace: str, name: str, uid: str) -> None:
        """A lifecycle that ran to the job's end holds nothing needed later (a deletion
        reads what it needs from the API server): not kept for every finished job."""
        with self._lock:
            current = self._lifecycles.get(f"{namespace}/{name}")
            if current is not None and current.uid == uid:
                del self._lifecycles[f"{namespace}/{name}"]

    def delete(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        self.lifecycle(namespace, name, uid).delete(status)
        with self._lock:
            self._lifecycles.pop(f"{namespace}/{name}", None)

    def healthz(self) -> tuple[bool, str]:
        """/healthz: 503 before start and once stopping, or while a heartbeat is stale."""
        if not self.alive.is_set():
            return False, "not serving: the operator is starting or stopping\n"
        return self.health.check()

    def stop(self) -> None:
        self.alive.clear()
        self.runner.stop()
        self.health.stop()
        if self.ctx is not None and self.ctx.kueue is not None and self.ctx.kueue.cache is not None:
            self.ctx.kueue.cache.stop()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.embedded is not None:
            self.embedded.stop()


def rebuild_view(obj: dict[str, Any]) -> dict[str, Any]:
    """What the rebuild needs of a job: its phase; the plan, model and group only of a
    running job or one that kept its group (the few the books hold)."""
    status = obj.get("status") or {}
    meta, spec = obj["metadata"], obj.get("spec") or {}
    phase = status.get("phase", "Pending")
    view: dict[str, Any] = {"key": f"{meta['namespace']}/{meta['name']}", "phase": phase}
    attempts = status.get("attempts") or []
    running = phase not in TERMINAL and bool(attempts) and attempts[-1].get("result") == "Running"
    group = status.get("actorGroup") or {}
    if running or (phase == "Succeeded" and group.get("kept")):
        model = spec.get("model") or {}
        view.update(plan=status.get("plan") or {}, model=model.get("name", ""), source=model.get("source"),
                    group=group, running=running, attemptGroup=attempts[-1].get("group") if running else None,
                    attemptStartedAt=attempts[-1].get("startedAt") if running else None)
    return view


def sweep_view(obj: dict[str, Any], ttl_s: int, clock: float) -> tuple[str, str, expiry.Expired | None]:
    """What the sweep needs of a job: (uid, phase, its expiry if due)."""
    due = expiry.due([obj], ttl_s, clock)
    return obj["metadata"]["uid"], (obj.get("status") or {}).get("phase", "Pending"), (due[0] if due else None)


def show_operator_error(lifecycle: JobLifecycle, exc: Exception, retry_s: float) -> None:
    """The job's status says what the operator could not do, and that it tries again."""
    status = getattr(exc, "status", None)
    if status in (401, 403):
        what = (f"the Kubernetes API refused the operator ({status} {getattr(exc, 'reason', '')}): its "
                "ServiceAccount lacks a permission (the chart's ClusterRole, or Kueue's resources in kueue "
                f"mode); {clip(str(getattr(exc, 'body', '') or exc), 300)}")
    else:
        what = f"{type(exc).__name__}: {clip(str(exc), 400)}"
    message = f"the operator could not handle this job: {what}; it tries again (first in {retry_s:g} s)"
    try:
        lifecycle.book.update({"message": message, "conditions": lifecycle.book.condition(
            ConditionType.ADMITTED, "Unknown", Reason.OPERATOR_ERROR, message)})
    except Exception:  # noqa: BLE001 - the write is refused too (the same RBAC): the log says it
        log.warning("%s: could not write the operator's error to its status", lifecycle.key, exc_info=True)


def _no_event(*_args) -> None:
    pass


def object_ref(namespace: str, name: str, uid: str) -> dict[str, Any]:
    """The smallest body kopf.event needs to post an event about a VideoJob."""
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
            "metadata": {"namespace": namespace, "name": name, "uid": uid}}
