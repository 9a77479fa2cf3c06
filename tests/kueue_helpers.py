"""Kueue objects for tests against the real Kueue of the `kueue` fixture.

KueueSetup creates ResourceFlavors, ClusterQueues, LocalQueues,
WorkloadPriorityClasses and Workloads (kueue.x-k8s.io/v1beta2, the version the
v0.17 CRDs store) and deletes them all on exit, waiting until they are gone:
ClusterQueues and ResourceFlavors are cluster-scoped and other tests share the
cluster, so their names get a random suffix, and Kueue keeps a ClusterQueue
(finalizer) until its Workloads are gone. start_kueue() is the fixture's body.
"""
from __future__ import annotations

import datetime
import json
import os
import secrets
import sys
from pathlib import Path

import pytest

from helpers import cluster_required, wait_for

REPO = Path(__file__).resolve().parents[1]
GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"
DEFAULT_PREEMPTION = {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"}
# kinds by plural, in the order cleanup deletes them
PLURALS = {"Workload": "workloads", "LocalQueue": "localqueues", "ClusterQueue": "clusterqueues",
           "ResourceFlavor": "resourceflavors", "WorkloadPriorityClass": "workloadpriorityclasses"}


def _lc():
    """hack/cluster/lc (the loopback cluster's code) and its ClusterError."""
    if str(REPO / "hack" / "cluster") not in sys.path:
        sys.path.insert(0, str(REPO / "hack" / "cluster"))
    from lc import kueue
    from lc.common import ClusterError

    return kueue, ClusterError


def start_kueue(cluster, workdir: Path):
    """Kueue's manager on ``cluster`` (an lc.kueue.Kueue: stop() it). Builds it unless
    VIDEOJOB_CLUSTER_NO_BUILD=1; what is missing or fails skips, or FAILS when the
    cluster is required (VIDEOJOB_REQUIRE_CLUSTER=1 or CI)."""
    kueue, ClusterError = _lc()
    build = os.environ.get("VIDEOJOB_CLUSTER_NO_BUILD", "").strip() != "1"
    try:
        exe = kueue.kueue_bin_dir(build) / "kueue-manager"
        return kueue.start(cluster.state, workdir, exe)
    except ClusterError as exc:
        msg = f"Kueue could not start: {exc}"
        if cluster_required():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class KueueSetup:
    """Creates Kueue objects and deletes them on exit (use ``with``)."""

    def __init__(self, cluster):
        self.cluster = cluster
        self._made: list[tuple[str, str | None, str]] = []  # (resource, namespace, name)

    def __enter__(self) -> KueueSetup:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _create(self, obj: dict) -> dict:
        res = self.cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(obj))
        made = json.loads(res.stdout)
        meta = made["metadata"]
        self._made.append((f"{PLURALS[obj['kind']]}.{GROUP}", meta.get("namespace"), meta["name"]))
        return made

    @staticmethod
    def unique(base: str) -> str:
        return f"{base}-{secrets.token_hex(3)}"

    def resource_flavor(self, base: str, node_labels: dict[str, str] | None = None) -> str:
        """A ResourceFlavor named ``<base>-<random>``; returns its name."""
        spec = {"nodeLabels": node_labels} if node_labels else {}
        return self._create({"apiVersion": API_VERSION, "kind": "ResourceFlavor",
                             "metadata": {"name": self.unique(base)}, "spec": spec})["metadata"]["name"]

    def cluster_queue(self, base: str, quotas: dict[str, dict[str, str | int]], *,
                      cohort: str | None = None,
                      borrowing_limits: dict[str, dict[str, str | int]] | None = None,
                      preemption: dict | None = None) -> str:
        """A ClusterQueue ``<base>-<random>`` for every namespace, one resource group:
        quotas {flavor: {resource: nominalQuota}} (flavors tried in this order; each
        lists the same resources), borrowing_limits {flavor: {resource: limit}}."""
        if not quotas:
            raise ValueError("cluster_queue needs at least one flavor")
        resources = list(next(iter(quotas.values())))
        if any(sorted(q) != sorted(resources) for q in quotas.values()):
            raise ValueError(f"every flavor must list the same resources: {quotas}")
        limits = borrowing_limits or {}
        covered = {(f, r) for f in quotas for r in resources}
        unknown = {(f, r) for f, rs in limits.items() for r in rs} - covered
        if unknown:
            raise ValueError(f"borrowing limits for flavors/resources without quota: {sorted(unknown)}")
        flavors = [{"name": flavor, "resources": [
            {"name": r, "nominalQuota": str(q[r]),
             **({"borrowingLimit": str(limits[flavor][r])} if r in limits.get(flavor, {}) else {})}
            for r in resources]} for flavor, q in quotas.items()]
        spec = {"namespaceSelector": {}, "preemption": preemption or DEFAULT_PREEMPTION,
                "resourceGroups": [{"coveredResources": resources, "flavors": flavors}]}
        if cohort:
            spec["cohortName"] = cohort
        return self._create({"apiVersion": API_VERSION, "kind": "ClusterQueue",
                             "metadata": {"name": self.unique(base)}, "spec": spec})["metadata"]["name"]

    def local_queue(self, namespace: str, name: str, cluster_queue: str) -> str:
        self._create({"apiVersion": API_VERSION, "kind": "LocalQueue",
                      "metadata": {"name": name, "namespace": namespace},
                      "spec": {"clusterQueue": cluster_queue}})
        return name

    def priority_class(self, base: str, value: int) -> str:
        """A WorkloadPriorityClass ``<base>-<random>`` of ``value``; returns its name."""
        return self._create({"apiVersion": API_VERSION, "kind": "WorkloadPriorityClass",
                             "metadata": {"name": self.unique(base)}, "value": value})["metadata"]["name"]

    def workload(self, namespace: str, name: str, queue: str, requests: dict[str, str | int], *,
                 count: int = 1, priority_class: tuple[str, int] | None = None) -> dict:
        """A minimal Workload: one pod set `main` of ``count`` pods, each requesting
        ``requests``; priority_class is (WorkloadPriorityClass name, its value): the
        CRD wants spec.priority set whenever priorityClassRef is."""
        container = {"name": "main", "image": "none",
                     "resources": {"requests": {k: str(v) for k, v in requests.items()}}}
        spec = {"queueName": queue, "podSets": [{"name": "main", "count": count,
                                                 "template": {"spec": {"containers": [container]}}}]}
        if priority_class:
            spec["priorityClassRef"] = {"group": GROUP, "kind": "WorkloadPriorityClass",
                                        "name": priority_class[0]}
            spec["priority"] = priority_class[1]
        return self._create({"apiVersion": API_VERSION, "kind": "Workload",
                             "metadata": {"name": name, "namespace": namespace}, "spec": spec})

    def get_workload(self, namespace: str, name: str) -> dict:
        return self.cluster.get_json(f"workloads.{GROUP}", name, "-n", namespace)

    def conditions(self, namespace: str, name: str) -> dict[str, dict]:
        """The Workload's status conditions by type."""
        wl = self.get_workload(namespace, name)
        return {c["type"]: c for c in wl.get("status", {}).get("conditions", [])}

    def wait_condition(self, namespace: str, name: str, type_: str, status: str = "True",
                       reason: str | None = None, timeout: float = 60) -> dict:
        """Waits until the Workload has condition ``type_`` with ``status`` (and reason)."""
        def probe():
            c = self.conditions(namespace, name).get(type_)
            return c if c and c["status"] == status and reason in (None, c["reason"]) else None
        return wait_for(f"Workload {namespace}/{name} condition {type_}={status}"
                        + (f" ({reason})" if reason else ""), probe, timeout, interval=0.5)

    def _patch_status(self, namespace: str, name: str, patch: dict) -> None:
        self.cluster.kubectl("patch", f"workloads.{GROUP}", name, "-n", namespace, "--subresource=status",
                             "--type=merge", "-p", json.dumps({"status": patch}))

    def release_quota(self, namespace: str, name: str) -> None:
        """The owner's answer to an eviction (what Kueue's job integrations do once the
        job stopped): admission cleared, QuotaReserved=False (Pending), Admitted=False,
        Requeued=True with the eviction's reason; Kueue then queues it again."""
        conds = self.conditions(namespace, name)
        evicted = conds.get("Evicted")
        if not evicted or evicted["status"] != "True":
            raise ValueError(f"Workload {namespace}/{name} is not evicted: {conds}")
        now, msg = _now(), evicted["message"]
        conds["QuotaReserved"] = {"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                  "message": msg, "lastTransitionTime": now}
        conds["Admitted"] = {"type": "Admitted", "status": "False", "reason": "NoReservation",
                             "message": "The workload has no reservation", "lastTransitionTime": now}
        conds["Requeued"] = {"type": "Requeued", "status": "True", "reason": evicted["reason"],
                             "message": msg, "lastTransitionTime": now}
        self._patch_status(namespace, name, {"admission": None, "conditions": list(conds.values())})

    def finish(self, namespace: str, name: str, reason: str = "Succeeded", message: str = "done") -> None:
        """Finished=True: Kueue releases the Workload's quota (admission stays recorded)."""
        conds = self.conditions(namespace, name)
        conds["Finished"] = {"type": "Finished", "status": "True", "reason": reason,
                             "message": message, "lastTransitionTime": _now()}
        self._patch_status(namespace, name, {"conditions": list(conds.values())})

    def cleanup(self) -> None:
        """Deletes what was made, Workloads first, waiting (90 s each kind at most)."""
        for resource in (f"{plural}.{GROUP}" for plural in PLURALS.values()):
            for ns in sorted({n or "" for r, n, _ in self._made if r == resource}):
                names = [name for r, n, name in self._made if r == resource and (n or "") == ns]
                self.cluster.kubectl("delete", resource, *names, *(["-n", ns] if ns else []),
                                     "--ignore-not-found", "--wait=true", "--timeout=90s", timeout=120)
        self._made.clear()
