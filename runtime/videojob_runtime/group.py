"""An actor group: N Ray actors (one per GPU, or per CPU slot) in one placement group.

Groups are detached and named (``<name>-rank<i>`` in the ``videojob``
namespace), so they outlive the process that made them: an operator that
restarts re-attaches with ``ActorGroup.attach(name)``. Rank 0 picks the
rendezvous port; every rank then joins torch.distributed (nccl on GPUs,
gloo on a CPU) and xfuser's parallel groups for the layout.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .worker import JobRequest, RankWorker

NAMESPACE = "videojob"


@ray.remote(max_concurrency=4)
class RankActor:
    """Ray wrapper of RankWorker; spare threads answer progress/cancel during a run."""

    def __init__(self, rank: int, world_size: int, ulysses: int, ring: int, cfg: int, device: str):
        self.worker = RankWorker(rank, world_size, ulysses, ring, cfg, device)

    def free_port(self):
        return self.worker.free_port()

    def init_distributed(self, addr: str, port: int, timeout_s: float):
        return self.worker.init_distributed(addr, port, timeout_s)

    def run(self, request: dict):
        return self.worker.run(request)

    def progress(self):
        return self.worker.get_progress()

    def cancel(self):
        self.worker.cancel()

    def health(self):
        return self.worker.health()

    def shutdown(self):
        self.worker.shutdown()


def pack_strategy(bundles: list[dict[str, float]]) -> str:
    """STRICT_PACK when one node can hold every bundle (the usual case: one pod
    per job), else PACK, which lets Ray spill to a second node."""
    needed = {key: sum(b.get(key, 0.0) for b in bundles) for key in bundles[0]}
    for node in ray.nodes():
        if node.get("Alive") and all(node["Resources"].get(k, 0.0) >= v for k, v in needed.items()):
            return "STRICT_PACK"
    return "PACK"


@dataclass(frozen=True)
class GroupSpec:
    name: str
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    device: str = "cpu"

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg


class ActorGroup:
    def __init__(self, spec: GroupSpec, actors: list, pg=None):
        self.spec, self.actors, self.pg = spec, actors, pg

    @classmethod
    def start(cls, spec: GroupSpec, timeout_s: float = 300.0, cpus_per_rank: float | None = None) -> "ActorGroup":
        """Create the placement group and actors, then rendezvous (waits at most ``timeout_s``)."""
        world = spec.world_size
        if spec.device == "cpu":
            if cpus_per_rank is None:
                cpus_per_rank = min(1.0, ray.cluster_resources().get("CPU", 1.0) / world)
            bundles = [{"CPU": cpus_per_rank} for _ in range(world)]
            actor_resources: dict[str, Any] = {"num_cpus": cpus_per_rank}
        else:
            bundles = [{"GPU": 1, "CPU": 1} for _ in range(world)]
            actor_resources = {"num_gpus": 1, "num_cpus": 1}
        pg = placement_group(bundles, strategy=pack_strategy(bundles), name=f"{spec.name}-pg", lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise TimeoutError(
                f"placement group for {spec.name} ({world} x {bundles[0]}) not ready after {timeout_s:.0f}s: "
                "the cluster lacks the resources"
            ) from None
        actors = [
            RankActor.options(
                name=f"{spec.name}-rank{rank}",
                namespace=NAMESPACE,
                lifetime="detached",
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                     placement_group_bundle_index=rank),
                **actor_resources,
            ).remote(rank, world, spec.ulysses, spec.ring, spec.cfg, spec.device)
            for rank in range(world)
        ]
        group = cls(spec, actors, pg)
        try:
            addr, port = ray.get(actors[0].free_port.remote(), timeout=timeout_s)
            ray.get([a.init_distributed.remote(addr, port, timeout_s) for a in actors], timeout=timeout_s)
        except Exception:
            group.teardown()
            raise
        return group

    @classmethod
    def attach(cls, spec: GroupSpec) -> "ActorGroup":
        """Re-attach to a running detached group by name (after a restart)."""
        actors = [ray.get_actor(f"{spec.name}-rank{r}", namespace=NAMESPACE) for r in range(spec.world_size)]
        return cls(spec, actors, pg=None)

    def health(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        return ray.get([a.health.remote() for a in self.actors], timeout=timeout_s)

    def progress(self) -> dict[str, Any]:
        return ray.get(self.actors[0].progress.remote(), timeout=30)

    def cancel(self) -> None:
        ray.get([a.cancel.remote() for a in self.actors], timeout=30)

    def run(self, request: JobRequest, timeout_s: float = 3600.0,
            on_progress: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 0.2) -> dict[str, Any]:
        """Run one job on every rank; returns the rank result that holds the video,
        with every rank's collective count, or the first structured error."""
        refs = [a.run.remote(asdict(request)) for a in self.actors]
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            if time.monotonic() > deadline:
                self.cancel()
                raise TimeoutError(f"job {request.job_id} did not finish within {timeout_s:.0f}s")
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=poll_s)
            if on_progress is not None:
                on_progress(self.progress())
        results = ray.get(refs)
        failed = [r for r in results if not r["ok"]]
        if failed:
            return {"ok": False, "error": failed[0]["error"], "ranks": results}
        main = next((r for r in results if r.get("output") or r.get("frames") is not None), results[-1])
        return {**main, "collectives_per_rank": [r["collectives"] for r in results],
                "reused_all": all(r["reused"] for r in results)}

    def teardown(self) -> None:
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - tearing down a broken group must still finish
                pass
            ray.kill(actor)
        if self.pg is not None:
            remove_placement_group(self.pg)
