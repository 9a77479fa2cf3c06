"""kopf handlers: they only translate kopf's calls into the controller's.

One task per unfinished VideoJob (spawning.py, started from kopf's watch
events) runs its lifecycle (plan, queue, submit, watch, finish) through the job
runner and ends when the job does; the deletion handler is the finalizer (stop
the driver, remove its group, release the ranks, and wait for the job's task).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

import aiohttp
import kopf

from ..api.common import API_GROUP, API_VERSION, PLURAL
from ..health import install_fault_signals
from ..settings import OperatorSettings
from .operator import Controller, object_ref
from .outcome import clip

FINALIZER = f"{API_GROUP}/finalizer"
EVENT_POSTERS = 32
EVENT_POSTER_IDLE_S = 0.05
FINALIZER_WAIT_S = 15.0  # a deleted job's task: asked to stop, cancelled after 5 s, given up on (retried) after this
DELETION_WORKERS = 64  # kopf's executor: finalizers (and the other sync handlers) at once
KOPF_CONNECTIONS = 32  # kopf's HTTPS connections to the API server at once, besides one per watch


def bounded_session(info: kopf.ConnectionInfo, watches: int) -> kopf.AiohttpSession:
    """kopf's own session, with a bounded connection pool.

    Why: kopf's session has no limit on connections, and each TLS connection on
    asyncio holds a 256 KiB read buffer for as long as the pool keeps it. 2,000
    jobs created at once opened 1,205 connections for kopf's finalizer patches
    (census of the 2,000-job run: 1,205 asyncio SSL transports; RSS 533 MiB of
    which ~70 MiB were Python objects), and the pool kept them. Bounded, a burst
    waits for a connection instead (``KOPF_CONNECTIONS``, plus one per watch
    stream, which holds its connection for its whole life)."""
    connector = aiohttp.TCPConnector(limit=KOPF_CONNECTIONS + max(1, watches), ssl=info.as_ssl_context())
    session = aiohttp.ClientSession(connector=connector, headers=info.as_http_headers(), proxy=info.proxy_url,
                                    trust_env=info.trust_env)
    return kopf.AiohttpSession(aiohttp_session=session, server=info.server, priority=info.priority,
                               default_namespace=info.default_namespace, expiration=info.expiration)


class NoDiffBase(kopf.DiffBaseStorage):
    """Keep no last-handled-configuration: we have no create/update/resume
    handlers that would diff against it (the daemon reads the object itself,
    the spec is immutable), and storing it cost one PATCH per job, plus the
    watch event it echoes, for nothing. Every event then looks like a
    creation to kopf, which has no handler for it and does nothing."""

    def build(self, *, body: Any, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: Any) -> Any:
        return None

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        return None


EVENT_HANDLER_ID = "videojob-lifecycle"


class QuietEventHandler(logging.Filter):
    """Drops kopf's "Handler 'videojob-lifecycle' succeeded." line: kopf logs it for every
    watch event of every job (each status write echoes one), tens of thousands of lines
    that say nothing. Its failures are still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != f"Handler {EVENT_HANDLER_ID!r} succeeded."


def _post_event(namespace: str, name: str, uid: str, kind: str, reason: str, message: str) -> None:
    kopf.event(object_ref(namespace, name, uid), type=kind, reason=reason, message=clip(message, 1024))


def build_registry(settings: OperatorSettings, controller: Controller | None = None) -> tuple[kopf.OperatorRegistry,
                                                                                              Controller]:
    """The handlers, registered on their own registry (nothing global)."""
    registry = kopf.OperatorRegistry()
    controller = controller or Controller(settings, event=_post_event)

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any):
        # Our own registry has none of kopf's default login handlers: the
        # kubernetes client's (in-cluster ServiceAccount, else $KUBECONFIG), in a
        # session of our own (async: made on kopf's loop) with a bounded pool.
        info = kopf.login_via_client(**kwargs)
        if info is None:
            return None
        return bounded_session(info, watches=len(getattr(settings, "namespaces", None) or []))

    @kopf.on.startup(registry=registry)
    async def heartbeat(**_: Any) -> None:
        # On kopf's own loop (an async handler runs there): /healthz fails if the loop stops.
        controller.health.start_loop_heartbeat()
        if controller.settings.allow_fault_injection:
            install_fault_signals(controller.admissions.hold_for_ever)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        # Handler progress in annotations of our own prefix; never in status (its schema is ours).
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
        settings.persistence.diffbase_storage = NoDiffBase()
        settings.posting.level = logging.WARNING  # our own events say what happens; kopf's only when wrong
        quiet = QuietEventHandler()
        for kopf_logger in ("kopf.objects", "kopf"):
            if not any(isinstance(f, QuietEventHandler) for f in logging.getLogger(kopf_logger).filters):
                logging.getLogger(kopf_logger).addFilter(quiet)
        # Events are posted by a bounded set of tasks, not one per job: kopf's connection
        # pool has no limit, so hundreds of concurrent posts opened (and TLS-handshook)
        # hundreds of connections, 18% of the operator's CPU under 1,000 new jobs
        # (py-spy --gil). A poster serves one job's events and lingers idle_timeout for
        # more: kopf's 1 s default would cap posting at EVENT_POSTERS jobs per second.
        settings.posting.worker_limit = EVENT_POSTERS
        settings.posting.idle_timeout = EVENT_POSTER_IDLE_S
        # The resources are known: no discovery watches (they would need RBAC on CRDs and namespaces).
        settings.scanning.disabled = True
        # kopf's executor runs the sync handlers (finalizers); the jobs' threads are the
        # runner's own pool, lent only while a job has work (queued jobs hold none).
        settings.execution.max_workers = DELETION_WORKERS
        settings.watching.server_timeout = controller.settings.watch_timeout_s
        settings.watching.client_timeout = controller.settings.watch_timeout_s + 10
        # kopf's other calls (patches, finalizers, events) give up as the operator's own do
        # (its default waited 5 minutes, and a connection dropped silently held a worker that long).
        settings.networking.request_timeout = controller.settings.kube_api_timeout_s
        settings.networking.connect_timeout = min(10.0, controller.settings.kube_api_timeout_s)
        controller.start()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await controller.spawner.close()  # the jobs' tasks first (they use the runner's threads)
        await asyncio.to_thread(controller.stop)

    @kopf.on.event(API_GROUP, API_VERSION, PLURAL, registry=registry, id=EVENT_HANDLER_ID)
    async def lifecycle(type: str | None, namespace: str, name: str, uid: str, status: dict, meta: dict,
                        **_: Any) -> None:
        # Not kopf.daemon: kopf keeps every daemon's object's body for its whole life
        # (controller/spawning.py). A task per unfinished job, lent a thread by the job
        # runner only while it has work (a queued job waits without one; runner.py).
        controller.spawner.notice(namespace, name, uid, wanted=controller.needs_lifecycle(dict(status or {})),
                                  deleting=bool((meta or {}).get("deletionTimestamp")), gone=type == "DELETED")

    @kopf.on.delete(API_GROUP, API_VERSION, PLURAL, registry=registry, backoff=2)
    def finalize(namespace: str, name: str, uid: str, status: dict, **_: Any) -> None:
        controller.delete(namespace, name, uid, dict(status or {}))
        # As kopf held the finalizer for a daemon: until the job's task ended (cancelled after a grace).
        if not controller.spawner.wait_stopped(namespace, name, uid, timeout_s=FINALIZER_WAIT_S):
            raise kopf.TemporaryError(f"{namespace}/{name}: its lifecycle is still stopping", delay=2)

    return registry, controller


def identity() -> str:
    """kopf's peering identity, given so kopf never asks the password database: its
    default (``getpass.getuser()``) raises KeyError for a uid that /etc/passwd lacks,
    such as OpenShift's arbitrary UIDs or a runAsUser the image does not list."""
    return f"videojob-operator@{socket.gethostname()}/{os.getpid()}"


def run(settings: OperatorSettings, namespaces: list[str], standalone: bool = True) -> None:
    settings = settings.model_copy(update={"namespaces": list(namespaces)})  # what the rebuild and the sweeper list
    registry, controller = build_registry(settings)
    try:
        kopf.run(registry=registry, standalone=standalone, namespaces=namespaces, clusterwide=not namespaces,
                 memo=kopf.Memo(controller=controller), identity=identity())
    finally:
        controller.stop()
