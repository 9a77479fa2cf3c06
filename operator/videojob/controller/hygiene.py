"""Ray hygiene: the operator's drivers leave Ray's job table once their end is on record.

Every driver the operator submits (one per attempt, and the teardown drivers)
is a Ray job whose record, entrypoint included (an attempt's carries its
base64 request, prompts and all), stays in the head's job table until it is
deleted (``DELETE /api/jobs/{id}``, which Ray allows once the job is
terminal). Here:

- ``after_end(lifecycle)``: called right AFTER an attempt's end was written to
  the VideoJob status, hands that attempt's driver to the sweeper for deletion
  (see settling, below). Never before: a driver deleted before a status write
  that then fails would look, to a restarted operator, like an attempt still
  Running whose driver Ray no longer knows, and it would submit the driver
  again (a doubled run).
- The driver that created a group kept warm stays while that group is alive:
  its metadata is the only record of the group's namespace, which a
  namespace-scoped sweeper needs (``owner_namespace``). It goes once the group
  is gone (``prune``).
- ``forget_drivers(ray, attempts)``: a deleted job's drivers (its finalizer).
- Teardown drivers are remembered when submitted (``remember``) and deleted
  once terminal.
- Settling: Ray's job manager watches each job's supervisor actor once a
  second; a record deleted before that actor has exited is written again
  (status FAILED, "Job supervisor actor died", no metadata, entrypoint
  "Entrypoint not found."). So a driver is deleted only ``SETTLE_S`` after
  its end was written (so after Ray's ``end_time``): until then it is owed, and
  a sweep after that deletes it with one request. A record re-created all the same (a supervisor slower than
  that) holds no request; the table scan deletes it.
- ``prune(ray, live, scoped, retention_s)``, once per sweep: deletes what is
  remembered and terminal (teardowns, deletes that failed while Ray was away,
  creators whose group is gone), and, at the first sweep and then at most once
  per ``retention_s`` (VIDEOJOB_RAY_JOB_RETENTION_S), scans the job table for
  what a crash left (a driver whose end was written but not deleted, a
  teardown of an earlier life): an attempt's driver ended more than
  ``retention_s`` ago whose VideoJob is terminal or gone, and any ended
  teardown, are deleted. The table stays small, so the scan stays cheap.

Nothing here raises: hygiene never fails a job; what it could not do is
remembered and tried again at the next sweep.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..driver_protocol import GROUP_PREFIX, group_name
from ..raycluster.client import RayClient
from .context import TERMINAL
from .groups import groups_in_ray

log = logging.getLogger("videojob.controller")
TEARDOWN_KEY = "videojob.io/teardown"
UID_KEY = "videojob.io/uid"
NAMESPACE_KEY = "videojob.io/namespace"
ATTEMPT_KEY = "videojob.io/attempt"
SETTLE_S = 10.0  # seconds after a driver's end before its record is deleted (see the module)
RECREATED = "Entrypoint not found."  # the entrypoint of a record Ray wrote again after a delete
_NAMESPACE_CACHE = 4096  # uid -> namespace answers kept (a uid's namespace never changes)


@dataclass
class Ledger:
    """What one operator still owes Ray's job table (per Ray client)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    # sid -> (time.monotonic() before which nothing is asked, whether to ask Ray first):
    # an ended attempt's driver is deleted at once SETTLE_S after its end was written;
    # a teardown (SETTLE_S after its submission) or a failed delete is asked about first.
    owed: dict[str, tuple[float, bool]] = field(default_factory=dict)
    creators: dict[str, str] = field(default_factory=dict)  # sid -> its kept group: delete once the group is gone
    next_scan: float = 0.0  # time.monotonic() of the next job-table scan (0: at the next sweep)
    namespaces: dict[str, str | None] = field(default_factory=dict)  # group owner uid -> namespace


_ledgers: dict[int, Ledger] = {}  # clients that take no attribute (``__slots__``), by id
_ledgers_lock = threading.Lock()


def ledger(ray: RayClient) -> Ledger:
    """The ledger of ``ray`` (one per client object: one per operator), kept on the client."""
    with _ledgers_lock:
        found = getattr(ray, "_videojob_ledger", None) or _ledgers.get(id(ray))
        if found is None:
            found = Ledger()
            try:
                ray._videojob_ledger = found
            except (AttributeError, TypeError):
                _ledgers[id(ray)] = found
        return found


def remember(ray: RayClient, submission_id: str) -> None:
    """``submission_id`` (a teardown driver) is deleted once it is terminal."""
    book = ledger(ray)
    with book.lock:
        book.owed[submission_id] = (time.monotonic() + SETTLE_S, True)


def _delete(ray: RayClient, sid: str) -> bool | None:
    """Delete ``sid`` if terminal and settled: True deleted (or already gone), False not
    yet (running, or ended less than ``SETTLE_S`` ago), None Ray did not answer."""
    try:
        job = ray.job(sid)
        if job is None:
            return True
        if not job.terminal or (job.end_time_ms is not None and time.time() * 1000.0 - job.end_time_ms
                                < SETTLE_S * 1000.0):
            return False
        ray.delete(sid)
        return True
    except Exception as exc:  # noqa: BLE001 - hygiene never fails a job: the next sweep tries again
        log.info("Ray job %s not deleted yet (%s); the sweeper tries again", sid, exc)
        return None


def _kept_creator(status: dict[str, Any], attempt: dict[str, Any], uid: str) -> str | None:
    """The group ``attempt`` created and left warm (None: it kept none, or reused another's)."""
    group = status.get("actorGroup") or {}
    name = group.get("name")
    if (group.get("kept") and not group.get("reused") and attempt.get("result") == "Succeeded"
            and name == attempt.get("group") == group_name(uid, f"a{attempt.get('number')}")):
        return name
    return None


def after_end(lifecycle) -> None:
    """After the write that recorded an attempt's end: its driver is owed to the sweeper (see the module).
    ``lifecycle`` is the job's ``JobLifecycle`` (its ``book`` holds the status as written).
    In kueue mode the job's Workloads are marked Finished first: Kueue frees their quota."""
    release = getattr(lifecycle, "_kueue_release", None)
    if release is not None:
        release("its attempt ended")
    try:
        attempts = lifecycle.book.status.get("attempts") or []
        attempt = attempts[-1] if attempts else {}
        sid = attempt.get("submissionId")
        if not sid or attempt.get("result") in (None, "Running"):
            return
        ray = lifecycle.ctx.ray
        kept = _kept_creator(lifecycle.book.status, attempt, lifecycle.uid)
        book = ledger(ray)
        if kept:
            with book.lock:
                book.creators[sid] = kept
            return
        with book.lock:  # it ended a moment ago: a sweep deletes it once settled
            book.owed[sid] = (time.monotonic() + SETTLE_S, False)
    except Exception:  # noqa: BLE001 - hygiene never fails a job
        log.warning("%s: an ended driver was not handed over for deletion", getattr(lifecycle, "key", "?"),
                    exc_info=True)


def forget_drivers(ray: RayClient, attempts: Iterable[dict[str, Any]], uid: str, kept: str | None = None) -> None:
    """A deleted job's drivers: deleted now if terminal, else once they are; the
    creator of ``kept`` (the job's warm group) once that group is gone."""
    book = ledger(ray)
    alive = set(groups_in_ray(ray)) if kept else set()
    for attempt in attempts:
        sid = attempt.get("submissionId")
        if not sid:
            continue
        own = attempt.get("group")
        if kept and own == kept and kept in alive and own == group_name(uid, f"a{attempt.get('number')}"):
            with book.lock:
                book.creators[sid] = kept
            continue
        with book.lock:
            book.creators.pop(sid, None)
        if _delete(ray, sid) is not True:
            with book.lock:
                book.owed[sid] = (0.0, True)


def owner_namespace(ray: RayClient, group: str, uid: str | None) -> str | None:
    """The namespace of the job that created ``group`` (None: unknown), looked up
    through the Ray job that created its placement group or ranks (the State API's
    creator job id, then ``GET /api/jobs/{job id}``): a few small requests per group;
    the whole job table only where that finds no driver of the group's uid. Answers
    are cached per uid (a uid's namespace never changes)."""
    book = ledger(ray)
    if uid is not None and uid in book.namespaces:
        return book.namespaces[uid]
    job_ids = [pg.get("creator_job_id") for pg in ray.placement_groups(where={"name": f"{group}-pg"})]
    if not any(job_ids):  # rank 0 by name, then (rank 0 gone) any rank of the group
        job_ids = ([a.get("job_id") for a in ray.actors(where={"name": f"{group}-rank0"})]
                   or [a.get("job_id") for a in ray.actors(f"{group}-rank")])
    job_id = next((j for j in job_ids if j), None)
    job = ray.job(job_id) if job_id else None
    if (job is None or job.metadata.get(UID_KEY) != uid) and uid is not None:
        # No creator to ask (this Ray does not say, or its record is gone): any driver of that uid, once.
        job = next((j for j in ray.jobs() if j.metadata.get(UID_KEY) == uid), None)
    namespace = (job.metadata.get(NAMESPACE_KEY) if job is not None else None) or None
    if uid is not None:
        with book.lock:
            if len(book.namespaces) >= _NAMESPACE_CACHE:
                book.namespaces.clear()
            book.namespaces[uid] = namespace
    return namespace


def prune(ray: RayClient, live: dict[str, str], scoped: Iterable[str] = (), retention_s: float = 300.0,
          now: float | None = None) -> dict[str, int]:
    """One sweep's hygiene (see the module). ``live``: uid -> phase of the VideoJobs the
    operator sees; ``scoped``: the namespaces it watches (empty: all). Returns counts:
    deleted, owed (still owed), scanned (job-table rows read; 0 when no scan ran)."""
    book = ledger(ray)
    deleted = 0
    clock = time.monotonic()
    with book.lock:
        owed, creators = dict(book.owed), dict(book.creators)
    for sid, (settled, ask) in owed.items():
        if clock < settled:
            continue  # not settled yet: not even a request
        if not ask:  # ended and settled: one DELETE (not a GET of its whole record first)
            try:
                done = ray.delete(sid)
            except Exception:  # noqa: BLE001 - Ray away: the next sweep
                continue
            if not done:  # already gone, or Ray refused: ask first next time
                with book.lock:
                    book.owed[sid] = (0.0, True)
                continue
        elif _delete(ray, sid) is not True:
            continue
        deleted += 1
        with book.lock:
            book.owed.pop(sid, None)
    alive: set[str] | None = None
    if creators:
        alive = set(groups_in_ray(ray))
        for sid, group in creators.items():
            if group not in alive and _delete(ray, sid) is True:
                deleted += 1
                with book.lock:
                    book.creators.pop(sid, None)
    scanned = 0
    if clock >= book.next_scan:
        book.next_scan = clock + retention_s
        scanned, found = _scan(ray, live, set(scoped), retention_s, alive, now)
        deleted += found
    with book.lock:
        left = len(book.owed) + len(book.creators)
    return {"deleted": deleted, "owed": left, "scanned": scanned}


def _scan(ray: RayClient, live: dict[str, str], scoped: set[str], retention_s: float, alive: set[str] | None,
          now: float | None) -> tuple[int, int]:
    """(rows read, deleted) of one look at the whole job table for what a crash left."""
    book = ledger(ray)
    table = ray.jobs()
    cutoff_ms = ((time.time() if now is None else now) - retention_s) * 1000.0
    deleted = 0
    for job in table:
        meta = job.metadata or {}
        if not job.terminal or job.end_time_ms is None or job.end_time_ms > cutoff_ms:
            continue  # running, or ended lately (its lifecycle may still be writing its end)
        if TEARDOWN_KEY in meta or (not meta and job.entrypoint == RECREATED
                                    and job.submission_id.startswith(GROUP_PREFIX)):
            deleted += bool(_delete(ray, job.submission_id))  # a teardown, or a record Ray wrote again
            continue
        uid = meta.get(UID_KEY)
        if not uid or (scoped and meta.get(NAMESPACE_KEY) not in scoped):
            continue  # not ours, or another namespace's operator's
        phase = live.get(uid)
        if phase is not None and phase not in TERMINAL:
            continue  # its job goes on (its earlier attempts' drivers go when it ends)
        if alive is None:
            alive = set(groups_in_ray(ray))
        try:
            own = group_name(uid, f"a{int(meta.get(ATTEMPT_KEY) or 0)}")
        except ValueError:
            own = None
        if own in alive:
            with book.lock:
                book.creators[job.submission_id] = own  # its warm group lives: it goes with it
            continue
        deleted += bool(_delete(ray, job.submission_id))
    return len(table), deleted


__all__ = ["Ledger", "after_end", "forget_drivers", "ledger", "owner_namespace", "prune", "remember"]
