"""Actor groups as the operator sees them over Ray's State API: which exist,
and removing one by submitting a teardown driver (the operator decides,
drivers carry it out; the operator never imports ray).

Names: a group is ``vj-<uid of the job that started it>-a<attempt>``; its
ranks are ``<group>-rank<i>`` and its placement group ``<group>-pg``.

Every driver the operator submits, an attempt's or a teardown's, goes
through ``DriverLaunch.submit``: 0 CPUs, and the Ray resources of
VIDEOJOB_DRIVER_RESOURCES as the Ray job's ``entrypoint_resources``. Ray's
Jobs API schedules the job's supervisor actor (and so the driver process, its
child) with those resources, so with ``{"vj-driver": 1}`` drivers run only on
nodes that advertise ``vj-driver`` (the chart's drivers worker group), never
on the head; where no node offers them the job stays PENDING (and an
autoscaler may launch one). Without them Ray pins the driver to the head.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..driver_protocol import GROUP_PREFIX, preempt_entrypoint, teardown_entrypoint
from ..raycluster.client import RayClient

log = logging.getLogger("videojob.controller")
UID_LENGTH = 36


def group_of(ray_name: str) -> str | None:
    """The group an actor or placement group named ``ray_name`` belongs to."""
    if not ray_name or not ray_name.startswith(GROUP_PREFIX):
        return None
    if "-rank" in ray_name:
        return ray_name.rsplit("-rank", 1)[0]
    if ray_name.endswith("-pg"):
        return ray_name[:-3]
    return None


def owner_uid(group: str) -> str | None:
    """The uid of the job that started ``group`` (None for a name of another shape)."""
    body = group[len(GROUP_PREFIX):]
    uid = body[:UID_LENGTH]
    return uid if len(uid) == UID_LENGTH and uid.count("-") == 4 else None


def groups_in_ray(ray: RayClient) -> dict[str, int]:
    """Every group with a live rank or placement group: name -> ranks alive."""
    found: dict[str, int] = {}
    for actor in ray.actors(GROUP_PREFIX):
        group = group_of(actor.get("name") or "")
        if group:
            found[group] = found.get(group, 0) + 1
    for pg in ray.placement_groups(GROUP_PREFIX):
        group = group_of(pg.get("name") or "")
        if group:
            found.setdefault(group, 0)
    return found


def present(ray: RayClient, group: str) -> bool:
    """Whether ``group`` still has a placement group or a live rank, asking Ray for this
    group's rows only (its placement group by name, then the live actors in it): teardown
    waits poll this, and a listing of every actor in a busy cluster per poll would load
    the dashboard with the cluster's size. A group whose placement group Ray no longer
    lists at all (never made, or forgotten) is looked for by its rank 0's name (a rank
    left without both is an orphan for the sweeper's whole listing, ``groups_in_ray``)."""
    pgs = ray.placement_groups(live_only=False, where={"name": f"{group}-pg"})
    if any(pg.get("state") != "REMOVED" for pg in pgs):
        return True
    ids = {pg.get("placement_group_id") for pg in pgs} - {None, ""}
    if ids:
        return any(ray.actors(f"{group}-rank", where={"placement_group_id": pg_id}) for pg_id in sorted(ids))
    return bool(ray.actors(where={"name": f"{group}-rank0"}))


@dataclass(frozen=True)
class DriverLaunch:
    """How every driver is started: the entrypoint's Python and the Ray resources
    its job asks for (settings: driver_python, as ``driver_interpreter`` resolves it; driver_resources)."""

    python: str = "python"
    resources: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, settings) -> "DriverLaunch":
        return cls(settings.driver_interpreter, settings.entrypoint_resources)

    def submit(self, ray: RayClient, submission_id: str, entrypoint: str, metadata: dict[str, str],
               runtime_env: dict[str, Any] | None = None) -> bool:
        """Submit one driver (True: created; False: it existed, adopt it); ``runtime_env``:
        what ``DriverRequest.submission`` keeps off the command line."""
        return ray.submit(submission_id, entrypoint, entrypoint_num_cpus=0, runtime_env=runtime_env,
                          entrypoint_resources=dict(self.resources) or None, metadata=metadata)


def submit_teardown(ray: RayClient, group: str, world: int, launch: DriverLaunch, why: str) -> str:
    """Submit a driver that removes ``group``; returns its submission id."""
    sid = f"vj-teardown-{uuid.uuid4().hex[:12]}"
    launch.submit(ray, sid, teardown_entrypoint(group, world, launch.python),
                  metadata={"videojob.io/teardown": group, "videojob.io/why": why[:100]})
    from .hygiene import remember  # here: hygiene imports this module

    remember(ray, sid)  # deleted from Ray's job table once it has run
    log.info("group %s: teardown driver %s submitted (%s)", group, sid, why)
    return sid


def submit_preempt(ray: RayClient, group: str, job_id: str, world: int, launch: DriverLaunch, why: str) -> str:
    """Submit a driver that asks ``group``'s ranks to checkpoint and stop ``job_id``."""
    sid = f"vj-preempt-{uuid.uuid4().hex[:12]}"
    launch.submit(ray, sid, preempt_entrypoint(group, job_id, world, launch.python),
                  metadata={"videojob.io/preempt": group, "videojob.io/why": why[:100]})
    from .hygiene import remember  # here: hygiene imports this module

    remember(ray, sid)
    log.info("group %s: preempt driver %s submitted (%s)", group, sid, why)
    return sid


def teardown_groups(ray: RayClient, groups: Iterable[str], launch: DriverLaunch, why: str, wait_s: float = 0.0,
                    world: int = 8) -> list[str]:
    """Remove ``groups``; with ``wait_s`` wait up to that long for them to be gone.
    Returns the groups still present at the end (empty when all went)."""
    groups = [g for g in groups if g]
    for group in groups:
        submit_teardown(ray, group, world, launch, why)
    deadline = time.monotonic() + wait_s
    left = list(groups)
    while left and time.monotonic() < deadline:
        left = [g for g in left if present(ray, g)]
        if left:
            time.sleep(0.3)
    return [g for g in left if wait_s <= 0 or present(ray, g)] if wait_s > 0 else left


__all__ = ["DriverLaunch", "group_of", "groups_in_ray", "owner_uid", "present", "submit_preempt", "submit_teardown",
           "teardown_groups"]
