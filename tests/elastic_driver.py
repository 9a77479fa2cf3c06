"""A Ray driver in its own process for tests/test_elastic.py: starts and tears
down actor groups with the real runtime code and reports what the cluster and
its autoscaler see.

Why a process of its own: a pytest process may already be a driver of another
Ray (the session's embedded one, ``ray_session``), and one process is the
driver of one cluster at a time. The groups are detached, as in the operator,
so they outlive a driver anyway.

Protocol: one JSON object per line on stdin, one JSON reply per line on
stdout (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``). Anything
else that writes to stdout (Ray, libraries) is sent to stderr. The cluster
comes from ``RAY_ADDRESS``; auth from ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``.

    {"op": "start", "name": ..., "ulysses": 4, "bundle_resources": {...},
     "cpus_per_rank": 1, "timeout_s": 120, "node_type": null, "max_wait_s": null}
        -> {"ok": true, "bundle_nodes": [node id of each rank's bundle], "bundles": [...],
            "strategy": ..., "ranks": [{node_id, gpu_ids, assigned} seen inside each rank's actor],
            "health": [...], "placement": {waitedS, launchingS}, "waits": [the placement's
            waiting records]}  (a failed start: {"ok": false, "error", "waits", "seconds"})
    {"op": "teardown", "name": ...}       -> {"ok": true, "census": {...}}
    {"op": "census", "prefix": ...}       -> {"ok": true, "census": {placement groups, actors named prefix*}}
    {"op": "nodes"}                       -> {"ok": true, "nodes": [ray.nodes(), trimmed]}
    {"op": "status"}                      -> {"ok": true, "status": the autoscaler's cluster status}
    {"op": "quit"}                        -> {"ok": true}, then exits
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any


def _placement(actor) -> dict[str, Any]:
    """Run inside a rank's actor: where it runs and what Ray gave it."""
    import ray

    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "assigned": context.get_assigned_resources()}


def _node_info(n) -> dict[str, Any]:
    return {"type": n.ray_node_type_name, "instance_id": n.instance_id, "node_id": n.node_id,
            "status": n.node_status, "resources": n.total_resources()}


class Driver:
    def __init__(self):
        import ray

        self.ray = ray
        ray.init(address=os.environ["RAY_ADDRESS"], namespace="videojob", log_to_driver=False)
        self.gcs_address = ray.get_runtime_context().gcs_address
        self.groups: dict[str, Any] = {}

    def start(self, name: str, ulysses: int = 1, ring: int = 1, cfg: int = 1,
              bundle_resources: dict[str, float] | None = None, cpus_per_rank: float = 1.0,
              timeout_s: float = 120.0, node_type: str | None = None,
              max_wait_s: float | None = None, start_timeout_s: float | None = None) -> dict[str, Any]:
        import time

        from ray.util import placement_group_table

        from videojob_runtime.group import ActorGroup, GroupSpec, GroupStartError

        spec = GroupSpec(name=name, ulysses=ulysses, ring=ring, cfg=cfg, device="cpu",
                         bundle_resources=dict(bundle_resources or {}))
        waits: list[dict[str, Any]] = []
        started = time.monotonic()
        try:
            group = ActorGroup.start(spec, timeout_s=timeout_s, cpus_per_rank=cpus_per_rank, node_type=node_type,
                                     max_wait_s=max_wait_s, on_wait=waits.append, start_timeout_s=start_timeout_s)
        except GroupStartError as exc:
            return {"ok": False, "error": exc.to_dict(), "waits": waits,
                    "seconds": round(time.monotonic() - started, 3)}
        self.groups[name] = group
        table = placement_group_table(group.pg)
        nodes = table["bundles_to_node_id"]
        ranks = self.ray.get([a.__ray_call__.remote(_placement) for a in group.actors], timeout=60)
        return {"ok": True, "bundle_nodes": [nodes[i] for i in range(spec.world_size)],
                "bundles": [table["bundles"][i] for i in range(spec.world_size)], "strategy": table["strategy"],
                "ranks": ranks, "health": group.health(), "placement": group.placement, "waits": waits}

    def teardown(self, name: str) -> dict[str, Any]:
        from helpers import ray_census

        group = self.groups.pop(name)
        group.teardown()
        return {"ok": True, "census": ray_census(name)}

    def census(self, prefix: str) -> dict[str, Any]:
        from helpers import ray_census

        return {"ok": True, "census": ray_census(prefix)}

    def nodes(self) -> dict[str, Any]:
        return {"ok": True, "nodes": [{"node_id": n["NodeID"], "alive": n["Alive"], "ip": n["NodeManagerAddress"],
                                       "resources": n["Resources"]} for n in self.ray.nodes()]}

    def status(self) -> dict[str, Any]:
        from ray.autoscaler.v2.sdk import get_cluster_status

        s = get_cluster_status(self.gcs_address)
        return {"ok": True, "status": {
            "active": [_node_info(n) for n in s.active_nodes],
            "idle": [_node_info(n) for n in s.idle_nodes],
            "pending_nodes": [_node_info(n) for n in s.pending_nodes],
            "failed_nodes": [_node_info(n) for n in s.failed_nodes],
            "pending_launches": [{"type": r.ray_node_type_name, "count": r.count} for r in s.pending_launches],
            "failed_launches": [{"type": r.ray_node_type_name, "count": r.count, "details": r.details}
                                for r in s.failed_launches],
        }}


def main() -> int:
    # Replies go to the real stdout; anything else printed in this process goes to stderr.
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    driver = None
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        op = command.pop("op")
        if op == "quit":
            if driver is not None:
                driver.ray.shutdown()
            replies.write(json.dumps({"ok": True}) + "\n")
            return 0
        try:
            if driver is None:
                driver = Driver()
            reply = getattr(driver, op)(**command)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the test as a reply
            reply = {"ok": False, "error": {"reason": type(exc).__name__, "message": str(exc),
                                            "traceback": traceback.format_exc()[-3000:]}}
        replies.write(json.dumps(reply, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
