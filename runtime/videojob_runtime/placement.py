"""Waiting for a group's placement group, with the autoscaler in mind.

A group's STRICT_PACK placement group may have to wait for its node: on
KubeRay a worker group of the job's class scaled from zero, plus an image
pull, takes minutes. Failing after a fixed timeout would fail jobs whose node
is on its way, so ``wait_placed`` asks Ray's autoscaler (v2: the cluster
status it reports to the GCS, ``ray.autoscaler.v2.sdk.get_cluster_status``)
whether a node of the group's type is being launched (a pending launch, or a
pending node: requested, allocated, starting Ray):

- while one is, the wait goes on (it is not counted against ``timeout_s``),
  bounded in all by ``max_wait_s``;
- while none is (the cluster is full, the type is at its maximum, no
  autoscaler), the time counts against ``timeout_s``, as a plain timeout.

Without an autoscaler (embedded Ray, a static cluster, autoscaler v1, an SDK
that does not answer) nothing is ever launching: the wait is the plain
timeout. KubeRay names node types after worker groups, and the chart names
worker groups after GPU classes: the operator sends the class as
``node_type``. Without one, any requested launch counts (it may be for
this group).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("videojob.runtime.placement")


class NoPlacement(Exception):
    """The placement group was not placed in time; ``message`` says why, for a person."""

    def __init__(self, message: str, waited_s: float, launching_s: float):
        super().__init__(message)
        self.message, self.waited_s, self.launching_s = message, waited_s, launching_s


@dataclass
class Launching:
    """What the autoscaler is launching for a node type: one line for a person."""

    node_type: str
    what: str  # e.g. "1 launch requested" or "1 node starting (ALLOCATED)"


class Autoscaler:
    """Ray's autoscaler v2, as the GCS at ``gcs_address`` reports it; asked at
    most every ``min_interval_s``. ``present``: None until asked, then whether an
    autoscaler has reported to the GCS at all."""

    def __init__(self, gcs_address: str | None, min_interval_s: float = 1.0, rpc_timeout_s: int = 5,
                 retry_after_failure_s: float = 30.0):
        self.gcs_address = gcs_address
        self.min_interval_s, self.rpc_timeout_s = min_interval_s, rpc_timeout_s
        self.retry_after_failure_s = retry_after_failure_s
        self.present: bool | None = None
        self._next = float("-inf")
        self._last: Launching | None = None
        self._failed_once = False

    def launching(self, node_type: str | None) -> Launching | None:
        """A launch in progress of ``node_type`` (any type when None), or None."""
        if not self.gcs_address or time.monotonic() < self._next:
            return self._last
        self._last = self._ask(node_type)
        self._next = time.monotonic() + (self.min_interval_s if self.present is not False or not self._failed_once
                                         else self.retry_after_failure_s)
        return self._last

    def _ask(self, node_type: str | None) -> Launching | None:
        try:
            from ray.autoscaler.v2.sdk import get_cluster_status

            status = get_cluster_status(self.gcs_address, timeout=self.rpc_timeout_s)
        except Exception as exc:  # noqa: BLE001 - no SDK, an old GCS, a timeout: nothing is known to launch
            if not self._failed_once:
                log.warning("the autoscaler's cluster status is not available (%s: %s): waiting as a plain "
                            "timeout", type(exc).__name__, exc)
            self._failed_once = True
            self.present = False
            return None
        # The version of the state an autoscaler last reported: "0" (or none) when none ever has.
        self.present = str(getattr(status.stats, "autoscaler_version", None) or "0") != "0"
        return launching_in(status, node_type)


def launching_in(status: Any, node_type: str | None) -> Launching | None:
    """The launch of ``node_type`` in an autoscaler ``ClusterStatus``, or None.
    Without a type, any requested launch counts, but no pending node: the head
    itself shows as one while it registers."""
    launches = sum(r.count for r in status.pending_launches
                   if node_type is None or r.ray_node_type_name == node_type)
    starting = [n for n in status.pending_nodes if node_type is not None and n.ray_node_type_name == node_type]
    if not launches and not starting:
        return None
    kind = node_type or next(iter([r.ray_node_type_name for r in status.pending_launches]
                                  + [n.ray_node_type_name for n in starting]), "?")
    parts = []
    if launches:
        parts.append(f"{launches} launch(es) requested")
    if starting:
        states = sorted({n.node_status or n.details or "pending" for n in starting})
        parts.append(f"{len(starting)} node(s) starting ({', '.join(states)})")
    return Launching(kind, ", ".join(parts))


def wait_placed(ready: Callable[[float], bool], *, what: str, timeout_s: float, max_wait_s: float | None,
                node_type: str | None, autoscaler: Autoscaler,
                on_wait: Callable[[dict[str, Any]], None] | None = None, poll_s: float = 1.0,
                report_every_s: float = 10.0) -> dict[str, float]:
    """Wait until ``ready(seconds)`` (block up to that long; True once placed).

    Returns {"waitedS", "launchingS"}. Raises NoPlacement after ``timeout_s`` of
    waiting with nothing launching, or ``max_wait_s`` (at least ``timeout_s``)
    in all. ``on_wait`` gets a record whenever the state changes (and every
    ``report_every_s``): {"state": "waiting-for-node" | "waiting-for-room", ...}."""
    max_wait_s = max(timeout_s, max_wait_s if max_wait_s is not None else timeout_s)
    started = time.monotonic()
    idle_s = launching_s = 0.0
    last_state, last_report = None, float("-inf")
    while True:
        clock = time.monotonic()
        if ready(min(poll_s, max(0.05, max_wait_s - (clock - started)))):
            return {"waitedS": round(time.monotonic() - started, 3), "launchingS": round(launching_s, 3)}
        now = time.monotonic()
        step = now - clock
        launch = autoscaler.launching(node_type)
        if launch is not None:
            launching_s += step
        else:
            idle_s += step
        waited = now - started
        state = "waiting-for-node" if launch is not None else "waiting-for-room"
        if on_wait is not None and (state != last_state or now - last_report >= report_every_s):
            on_wait({"state": state, "nodeType": (launch.node_type if launch else node_type), "waitedS": round(waited),
                     "launching": launch.what if launch else "", "idleS": round(idle_s),
                     "timeoutS": timeout_s, "maxWaitS": max_wait_s, "autoscaler": autoscaler.present})
            last_state, last_report = state, now
        if idle_s >= timeout_s or waited >= max_wait_s:
            raise NoPlacement(_why(what, node_type, idle_s, launching_s, waited, timeout_s, max_wait_s,
                                   autoscaler.present, launch), waited, launching_s)


def _why(what: str, node_type: str | None, idle_s: float, launching_s: float, waited: float, timeout_s: float,
         max_wait_s: float, present: bool | None, launch: Launching | None) -> str:
    kind = f"node type {node_type}" if node_type else "any node type"
    if waited >= max_wait_s and launch is not None:
        return (f"no node could hold {what} within {max_wait_s:.0f}s, the most a placement may wait "
                f"(VIDEOJOB_PLACEMENT_MAX_WAIT_S), although the autoscaler was still launching ({launch.what} of "
                f"{launch.node_type}) for {launching_s:.0f}s of it: check why the node does not start (the pod's "
                "events: image pull, quota, node selectors)")
    if present:
        autoscaler = (f"and the autoscaler launched no node of {kind} for {idle_s:.0f}s of it"
                      + (f" (it launched for {launching_s:.0f}s before)" if launching_s >= 1 else "")
                      + ": the class's worker group may be at its maxReplicas, or its pods cannot be scheduled")
    else:
        autoscaler = "and no autoscaler reports launching nodes: the cluster lacks the resources"
    return f"no node could hold {what} within {timeout_s:.0f}s (STRICT_PACK), {autoscaler}"


__all__ = ["Autoscaler", "Launching", "NoPlacement", "launching_in", "wait_placed"]
