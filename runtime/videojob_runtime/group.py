"""An actor group: N Ray actors (one per GPU, or per CPU slot) in one placement group.

* One pod: the placement group is always STRICT_PACK. A group spread over
  several nodes could never rendezvous the way xfuser runs it (and with an
  autoscaler, PACK would let Ray launch N one-GPU pods for an N-GPU job).
* Named after its owner: ``vj-<owner uid>[-<tag>]``; the placement group is
  ``<group>-pg`` and the actors ``<group>-rank<i>``, detached, in namespace
  ``videojob``. A restarted operator re-attaches by name (actors and
  placement group), and a sweeper can find groups whose owner is gone.
* Nothing leaks: every step of ``start`` runs under cleanup (placement group
  not ready, an actor that fails to start, a rendezvous that fails), and
  ``teardown`` removes the actors and the placement group whatever state
  they are in.
* Rank 0 binds the rendezvous on its node's IP (never 127.0.0.1, which only
  works when every rank is on rank 0's machine).
* A job where one rank fails: that rank aborts its process groups, so the
  others fail within a second; ranks still running after a grace period are
  killed. Unless the failure was agreed by all ranks (cancel) or refused
  before the job began, the group is torn down: its communicator may be
  broken. A rank whose actor died is reported as ``ActorDied`` with its rank.
* A group that does not form is told apart by whether a rank is gone. A rank
  whose process or node died (SIGKILL, the OOM killer, a lost pod) while the
  actors start or meet is ``ActorDied`` with its rank and stage: the same lost
  rank as one that dies a moment later in a job, which the operator retries.
  With every rank alive the failure keeps its own reason and is not retried,
  because it would repeat: an actor whose ``__init__`` raised
  (``ActorStartFailed``: an import or a setting that fails), a rank whose
  ``init_distributed`` raised or a rendezvous that timed out
  (``RendezvousFailed``: an address the peers cannot reach, a bad layout).
  The first error Ray hands back may be a survivor's (its peer's store went
  away), so after any failure every rank is asked whether it is alive.
  One exception: rank 0's store port taken by another process between the
  moment rank 0 found it free and the moment it listened (EADDRINUSE, seen
  under the chaos soak) is ``GroupStartFailed``, retried: the next group gets
  another port.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .placement import Autoscaler, NoPlacement, wait_placed
from .request import FaultInjection, JobRequest
from .worker import RankWorker

NAMESPACE = "videojob"
from videojob.driver_protocol import GROUP_PREFIX  # noqa: E402 - one definition
log = logging.getLogger("videojob.runtime.group")
# After a start step failed: how long every rank may take to say it is alive.
DEATH_PROBE_S = 20.0


class GroupStartError(RuntimeError):
    """A group could not start; ``reason`` and ``stage`` say where (nothing was left behind)."""

    def __init__(self, reason: str, stage: str, message: str, rank: int | None = None):
        super().__init__(message)
        self.reason, self.stage, self.message, self.rank = reason, stage, message, rank

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"reason": self.reason, "stage": self.stage, "message": self.message}
        if self.rank is not None:
            out["rank"] = self.rank
        return out


@ray.remote(max_concurrency=4)
class RankActor:
    """Ray wrapper of RankWorker; spare threads answer progress/cancel during a run."""

    def __init__(self, rank: int, world_size: int, ulysses: int, ring: int, cfg: int, device: str,
                 fail_on_start: bool = False, exit_on_start: bool = False):
        if fail_on_start:  # test hook: an actor that cannot start (GroupSpec.inject_start_fault)
            raise RuntimeError(f"injected fault: rank {rank} failed to start")
        if exit_on_start:  # test hook: its process dies while it starts (GroupSpec.inject_start_exit)
            os._exit(17)
        self.worker = RankWorker(rank, world_size, ulysses, ring, cfg, device)

    def ready(self):
        return self.worker.health()

    def rendezvous_address(self, timeout_s: float = 300.0):
        return self.worker.rendezvous_address(ray.util.get_node_ip_address(), timeout_s)

    def init_distributed(self, addr: str, port: int, timeout_s: float, fail: bool = False,
                         fault: dict[str, Any] | None = None):
        if fail:  # test hook: a rendezvous that fails on this rank
            raise RuntimeError(f"injected fault: rank {self.worker.rank} failed the rendezvous")
        if fault is not None:  # test hook: GroupSpec.rendezvous_fault
            _rendezvous_fault(FaultInjection(**fault), self.worker.rank)
        return self.worker.init_distributed(addr, port, timeout_s)

    def run(self, request: dict):
        return self.worker.run(request)

    def progress(self):
        return self.worker.get_progress()

    def cancel(self, job_id: str | None = None, checkpoint: bool = False):
        return self.worker.cancel(job_id, checkpoint)

    def health(self):
        return self.worker.health()

    def shutdown(self):
        self.worker.shutdown()


_RAY_HINTS = re.compile(r"\s+(?:There are some potential root causes|Common causes include|Some common causes)")


def _headline(exc: BaseException, limit: int = 300) -> str:
    """The line of a Ray error that says what happened: why the actor is dead, else the
    last line (the exception a method or ``__init__`` raised); the rest are ids and hints."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    said = next((line for line in lines if "is dead because" in line), None)  # a process or node died
    if said is None:
        said = lines[-1] if lines else type(exc).__name__
    said = _RAY_HINTS.split(said)[0]
    return said if len(said) <= limit else said[:limit] + "..."


_PORT_TAKEN = re.compile(r"EADDRINUSE|address already in use", re.I)


def start_failure_reason(reason: str, problem: str) -> str:
    """The reason a group start that failed with every rank alive reports: ``reason``,
    except a store port another process took meanwhile (a race, not the job's fault:
    ``GroupStartFailed``, which the operator retries)."""
    return "GroupStartFailed" if _PORT_TAKEN.search(problem) else reason


def _rendezvous_fault(fault: FaultInjection, rank: int) -> None:
    """A test fault on ``rank`` before it joins the process group (its peers may already wait in it)."""
    if not fault.applies("rendezvous", rank):
        return
    if fault.kind == "stall":  # no job yet, so no cancel to end it: its seconds, or until released
        ended = fault.stall()
        log.info("injected stall in the rendezvous on rank %d: %s", rank, ended)
    elif fault.kind == "exit":
        log.error("injected fault: exiting the process in the rendezvous on rank %d", rank)
        os._exit(17)
    else:
        raise RuntimeError(f"injected fault: rank {rank} failed the rendezvous")


def _gcs_address() -> str | None:
    """The GCS this process is connected to (where the autoscaler reports), if it can be told."""
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - not connected the usual way: no autoscaler is asked
        return None


def group_name(owner_uid: str, tag: str = "") -> str:
    """The group's name, derived from the job that owns it (its uid): the protocol's one rule."""
    from videojob.driver_protocol import group_name as named

    return named(owner_uid, tag)


def owner_of(name: str, uid_length: int = 36) -> str | None:
    """The owner uid a group, placement group or actor name was derived from (None: not ours)."""
    if not name.startswith(GROUP_PREFIX):
        return None
    return name[len(GROUP_PREFIX):len(GROUP_PREFIX) + uid_length] or None


@dataclass(frozen=True)
class GroupSpec:
    name: str
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    device: str = "cpu"
    # Extra resources every bundle (and its rank's actor) asks for: a GPU class's custom
    # resource; "CPU"/"GPU" here override the device's defaults.
    bundle_resources: dict[str, float] = field(default_factory=dict)
    # Test hooks: ranks whose actor fails to start, or whose process exits while it
    # starts, or that fail the rendezvous; a FaultInjection dict of stage "rendezvous".
    inject_start_fault: tuple[int, ...] = ()
    inject_start_exit: tuple[int, ...] = ()
    inject_rendezvous_fault: tuple[int, ...] = ()
    rendezvous_fault: dict[str, Any] | None = None

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg

    @property
    def pg_name(self) -> str:
        return f"{self.name}-pg"

    def actor_name(self, rank: int) -> str:
        return f"{self.name}-rank{rank}"


class ActorGroup:
    def __init__(self, spec: GroupSpec, actors: list, pg=None):
        self.spec, self.actors, self.pg = spec, actors, pg
        self.torn_down = False
        self.placement: dict[str, float] = {}  # how long the placement waited (start only)

    # -- lifecycle ---------------------------------------------------------

    @classmethod
    def start(cls, spec: GroupSpec, timeout_s: float = 300.0, cpus_per_rank: float | None = None,
              node_type: str | None = None, max_wait_s: float | None = None,
              on_wait: Callable[[dict[str, Any]], None] | None = None,
              start_timeout_s: float | None = None,
              stopping: Callable[[], bool] | None = None) -> "ActorGroup":
        """Placement group (bounded by ``timeout_s``), then actors and rendezvous
        (each bounded by ``start_timeout_s``, default ``timeout_s``: a short
        placement timeout must not cut short the imports of ranks on a fresh
        worker). The placement waits longer while the autoscaler launches a node
        of ``node_type`` (``placement.wait_placed``: up to ``max_wait_s`` in all;
        ``on_wait`` gets its waiting records). Raises ``GroupStartError`` and
        leaves nothing behind when any step fails. ``stopping()`` true (the driver
        is being stopped): no further rank is created, so the stopper's teardown
        sees every rank there will be."""
        start_s = timeout_s if start_timeout_s is None else start_timeout_s
        world = spec.world_size
        if spec.device == "cpu":
            if cpus_per_rank is None:
                cpus_per_rank = min(1.0, ray.cluster_resources().get("CPU", 1.0) / world)
            bundle: dict[str, float] = {"CPU": cpus_per_rank}
            actor_resources: dict[str, Any] = {"num_cpus": cpus_per_rank}
        else:
            bundle = {"GPU": 1, "CPU": 1}
            actor_resources = {"num_gpus": 1, "num_cpus": 1}
        bundle.update(spec.bundle_resources)
        # The actor asks for what its bundle holds; Ray takes CPU and GPU only as num_cpus/num_gpus.
        if "CPU" in spec.bundle_resources:
            actor_resources["num_cpus"] = spec.bundle_resources["CPU"]
        if "GPU" in spec.bundle_resources:
            actor_resources["num_gpus"] = spec.bundle_resources["GPU"]
        custom = {k: v for k, v in spec.bundle_resources.items() if k not in ("CPU", "GPU")}
        if custom:
            actor_resources["resources"] = custom
        group = cls(spec, [], None)
        try:
            group.pg = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK",
                                       name=spec.pg_name, lifetime="detached")
            ready_ref = group.pg.ready()
            try:
                group.placement = wait_placed(
                    lambda seconds: bool(ray.wait([ready_ref], timeout=seconds)[0]),
                    what=f"{spec.name}'s {world} x {bundle} in one pod", timeout_s=timeout_s, max_wait_s=max_wait_s,
                    node_type=node_type, autoscaler=Autoscaler(_gcs_address()), on_wait=on_wait)
            except NoPlacement as exc:
                raise GroupStartError("NoPlacement", "placement", exc.message) from None
            for rank in range(world):
                if stopping is not None and stopping():
                    raise GroupStartError("Cancelled", "start", f"{spec.name}: stopped while starting")
                group.actors.append(RankActor.options(
                    name=spec.actor_name(rank), namespace=NAMESPACE, lifetime="detached",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group.pg, placement_group_bundle_index=rank),
                    **actor_resources,
                ).remote(rank, world, spec.ulysses, spec.ring, spec.cfg, spec.device,
                         rank in spec.inject_start_fault, rank in spec.inject_start_exit))
            group._wait_all("actors", "ActorStartFailed", [a.ready.remote() for a in group.actors], start_s)
            addr, port = group._wait_all("rendezvous", "RendezvousFailed",
                                         [group.actors[0].rendezvous_address.remote(start_s)], start_s)[0]
            group._wait_all("rendezvous", "RendezvousFailed",
                            [a.init_distributed.remote(addr, port, start_s, rank in spec.inject_rendezvous_fault,
                                                       spec.rendezvous_fault)
                             for rank, a in enumerate(group.actors)], start_s)
        except BaseException as exc:
            group.teardown()
            if isinstance(exc, GroupStartError):
                raise
            raise GroupStartError("GroupStartFailed", "start", f"{spec.name}: {type(exc).__name__}: {exc}") from exc
        return group

    def _wait_all(self, stage: str, reason: str, refs: list, timeout_s: float) -> list:
        """Every ref's value; else ``GroupStartError``: ``ActorDied`` naming the first rank
        whose actor is gone, ``reason`` when every rank is alive (see the module's notes)."""
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            problem = f"{stage} did not finish within {timeout_s:.0f}s"
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            problem = f"{stage} failed: {_headline(exc)}"
        dead = self._dead_ranks()
        if dead:
            rank, why = dead[0]
            others = f" (ranks {[r for r, _ in dead]} are gone)" if len(dead) > 1 else ""
            raise GroupStartError("ActorDied", stage, f"{self.spec.name}: rank {rank}'s actor died during "
                                                      f"{stage}{others}: {why}", rank=rank)
        raise GroupStartError(start_failure_reason(reason, problem), stage, f"{self.spec.name}: {problem}")

    def _dead_ranks(self, within_s: float = DEATH_PROBE_S) -> list[tuple[int, str]]:
        """(rank, Ray's word) for each rank whose actor is gone: its process or node died.
        An actor whose ``__init__`` raised is not (it would fail again); one that does
        not answer within ``within_s`` is not known to be gone."""
        probes = [actor.health.remote() for actor in self.actors]
        ray.wait(probes, num_returns=len(probes), timeout=within_s)
        dead = []
        for rank, probe in enumerate(probes):
            try:
                ray.get(probe, timeout=0)
            except ray.exceptions.RayActorError as exc:
                if not exc.actor_init_failed:
                    dead.append((rank, _headline(exc)))
            except Exception:  # noqa: BLE001 - no answer yet, or its health failed: alive as far as known
                pass
        return dead

    @classmethod
    def attach(cls, spec: GroupSpec) -> "ActorGroup":
        """Re-attach to a running detached group by name: its actors and its placement group."""
        actors = [ray.get_actor(spec.actor_name(r), namespace=NAMESPACE) for r in range(spec.world_size)]
        try:
            pg = ray.util.get_placement_group(spec.pg_name)
        except ValueError:
            pg = None
        return cls(spec, actors, pg)

    def teardown(self) -> None:
        """Kill every actor and remove the placement group; safe on a broken or half-built group."""
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=5)
            except Exception:  # noqa: BLE001 - tearing down a broken group must still finish
                pass
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        if self.pg is None:
            try:
                self.pg = ray.util.get_placement_group(self.spec.pg_name)
            except ValueError:
                self.pg = None
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
        self.torn_down = True

    # -- queries -----------------------------------------------------------

    def health(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        return ray.get([a.health.remote() for a in self.actors], timeout=timeout_s)

    def progress(self) -> dict[str, Any]:
        return ray.get(self.actors[0].progress.remote(), timeout=30)

    def cancel(self, job_id: str | None = None, checkpoint: bool = False) -> list[dict[str, Any]]:
        """Ask every rank to stop ``job_id`` (None: the job running now) at its next boundary;
        ``checkpoint``: saving the step's checkpoint first (a preemption). One record per rank:
        ``{"rank", "asked": True, "job"}`` (the job id the rank recorded; None: it runs none),
        or ``{"rank", "asked": False, "error"}`` for a rank that could not be asked. The ranks'
        vote takes the highest level any of them holds, so one rank asked stops them all."""
        refs = [actor.cancel.remote(job_id, checkpoint) for actor in self.actors]
        answers = []
        for rank, ref in enumerate(refs):
            try:
                answers.append({"rank": rank, "asked": True, "job": ray.get(ref, timeout=10)})
            except Exception as exc:  # noqa: BLE001 - a dead rank cannot be asked; run() reports it
                answers.append({"rank": rank, "asked": False, "error": _headline(exc)})
        return answers

    # -- one job -----------------------------------------------------------

    def run(self, request: JobRequest, timeout_s: float = 3600.0,
            on_progress: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 0.2,
            grace_s: float = 5.0) -> dict[str, Any]:
        """Run one job on every rank; returns the rank result that holds the video,
        with every rank's collective count, or a structured error naming the rank
        and stage that failed (``groupTornDown`` when the group had to go)."""
        refs = [a.run.remote(request.to_dict()) for a in self.actors]
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        cancelled_for_timeout = False
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=poll_s)
            for ref in ready:
                rank = index[ref]
                results[rank] = self._collect(ref, rank)
                if not results[rank]["ok"] and failed_at is None:
                    failed_at = time.monotonic()
            now = time.monotonic()
            if now > deadline and not cancelled_for_timeout:
                self.cancel(request.job_id)
                cancelled_for_timeout = True
                failed_at = failed_at or now
            if pending and failed_at is not None and now - failed_at > grace_s:
                # A rank failed and these did not follow within the grace period: stop them.
                for ref in pending:
                    results[index[ref]] = {"ok": False, "rank": index[ref], "consistent": False, "error": {
                        "reason": "Stopped", "rank": index[ref], "stage": "",
                        "message": f"stopped {grace_s:.0f}s after another rank failed"}}
                self.teardown()
                pending = []
            if on_progress is not None and pending:
                try:
                    on_progress(self.progress())
                except Exception:  # noqa: BLE001 - progress is best effort; the result says what happened
                    pass
        ordered = [results[r] for r in range(len(self.actors))]
        if cancelled_for_timeout and all(r["ok"] or r["error"]["reason"] == "Cancelled" for r in ordered):
            ordered = [{**r, "ok": False, "error": {"reason": "Timeout", "stage": "run", "rank": r["rank"],
                                                     "message": f"job {request.job_id} did not finish within "
                                                                f"{timeout_s:.0f}s; cancelled"}}
                       for r in ordered]
        failed = [r for r in ordered if not r["ok"]]
        if failed:
            return self._failure(ordered, failed)
        main = next((r for r in ordered if r.get("output") or r.get("frames") is not None), ordered[-1])
        # Rank 0 writes the checkpoints: its report has their size and time.
        return {**main, "checkpoints": ordered[0].get("checkpoints"),
                "collectives_per_rank": [r["collectives"] for r in ordered],
                "reused_all": all(r["reused"] for r in ordered), "ranks_ok": len(ordered)}

    def _collect(self, ref, rank: int) -> dict[str, Any]:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            return {"ok": False, "rank": rank, "consistent": False, "error": {
                "reason": "ActorDied", "rank": rank, "stage": "",
                "message": f"rank {rank}'s actor died during the job: {str(exc).strip().splitlines()[0]}"}}
        except ray.exceptions.RayError as exc:
            return {"ok": False, "rank": rank, "consistent": False, "error": {
                "reason": "RayError", "rank": rank, "stage": "", "message": f"{type(exc).__name__}: {exc}"}}

    def _failure(self, ordered: list[dict[str, Any]], failed: list[dict[str, Any]]) -> dict[str, Any]:
        secondary = ("PeerFailed", "Stopped", "Busy")
        primary = next((r for r in failed if r["error"]["reason"] not in secondary), failed[0])
        error = dict(primary["error"])
        error.setdefault("rank", primary["rank"])
        if error["reason"] == "ActorDied":
            error["stage"] = next((r["error"].get("stage") for r in failed if r["error"].get("stage")), "") or "run"
        others = sorted(r["rank"] for r in failed if r is not primary)
        consistent = all(r.get("consistent", False) for r in ordered if not r["ok"]) and not self.torn_down
        if not consistent and not self.torn_down:
            self.teardown()
        where = f"rank {error['rank']} failed in {error.get('stage') or 'run'}"
        if error.get("step"):
            where += f" after step {error['step']}"
        error["summary"] = where + (f"; ranks {others} stopped" if others else "")
        error["groupTornDown"] = self.torn_down
        return {"ok": False, "error": error, "ranks": [{k: v for k, v in r.items() if k != "frames"} for r in ordered]}
