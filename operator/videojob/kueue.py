"""Kueue admission mode: a VideoJob's attempt as a Kueue ``Workload``, and what Kueue says back.

Pure functions (``workload_for``, ``read_workload``, ``priority_class_for``)
and a thin client (``KueueApi``). The planner still picks the class and the
layout; Kueue decides when, and on which flavor (quota), the attempt runs.
One Workload per attempt and class, named from the job's uid, so a restarted
operator finds the one it created (``workload_name``). Kueue only reserves
quota for a Workload it created no pods for: stopping the work on eviction,
and telling Kueue the work is done (condition ``Finished``), are ours.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from .controller.kube import DEFAULT_API_TIMEOUT_S, request_timeout
from .inventory import ClusterInventory, GpuClass

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
WATCH_TIMEOUT_S = 300  # the server ends each Workload watch after this; the cache lists again


def api_timeout_s(api: k8s.CustomObjectsApi) -> float:
    """The client-side timeout of ``api``'s calls (kube.TimedApiClient), else the default."""
    return float(getattr(api.api_client, "timeout_s", DEFAULT_API_TIMEOUT_S))
GPU_RESOURCE = "nvidia.com/gpu"
LABEL_UID, LABEL_ATTEMPT, LABEL_CLASS = "videojob.io/uid", "videojob.io/attempt", "videojob.io/gpu-class"
POD_SET = "ranks"
log = logging.getLogger("videojob.kueue")


def workload_name(name: str, uid: str, attempt: int, klass: str) -> str:
    """``<name>-<uid8>-a<N>-<class>``, at most 63 characters (a label value, as
    Kueue uses it); a long job name is cut and a hash keeps it unique."""
    tail = f"-{uid[:8]}-a{attempt}-{klass}"
    head = re.sub(r"[^a-z0-9-]", "-", name.lower()).strip("-") or "videojob"
    if len(head) + len(tail) > 63:
        digest = hashlib.sha256(name.encode()).hexdigest()[:6]
        head = head[: max(1, 63 - len(tail) - 7)].rstrip("-") + "-" + digest
    return (head + tail)[:63].rstrip("-")


def priority_class_name(priority: int) -> str:
    """The WorkloadPriorityClass of a VideoJob priority (-1000..1000)."""
    return f"videojob-priority-{'m' if priority < 0 else ''}{abs(int(priority))}"


def priority_class_for(priority: int) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "WorkloadPriorityClass",
            "metadata": {"name": priority_class_name(priority),
                         "labels": {"app.kubernetes.io/managed-by": "videojob-operator"}},
            "value": int(priority),
            "description": f"VideoJobs of spec.resources.priority {priority} (created by the videojob operator)"}


def pod_set_requests(klass: GpuClass, gpus: int, device: str, cpus_per_rank: float | None) -> dict[str, str]:
    """What one attempt holds: its ranks' GPUs (CPU ranks on a cpu inventory), a CPU
    per rank at least, and its share of the pod's host memory."""
    share = gpus / klass.gpus_per_pod
    memory_mi = max(256, int(klass.node.host_memory * share / 2**20))
    cpus = gpus * (cpus_per_rank or 1.0)
    requests = {"cpu": f"{int(round(cpus * 1000))}m", "memory": f"{memory_mi}Mi"}
    if device == "cuda":
        requests[GPU_RESOURCE] = str(gpus)
    return requests


def workload_for(*, namespace: str, name: str, uid: str, attempt: int, plan: dict[str, Any], queue: str,
                 priority: int, inventory: ClusterInventory, cpus_per_rank: float | None,
                 active: bool = True) -> dict[str, Any]:
    """The Workload of ``attempt`` with ``plan``: one pod set of the plan's GPUs, CPU and
    memory with the class's node selector, in LocalQueue ``queue``, owned by the
    VideoJob (deleted with it), with the job's priority's WorkloadPriorityClass.
    ``active`` False: made deactivated (the job's last Workload was deactivated by someone:
    Kueue admits this one only once they set its spec.active true)."""
    klass = inventory.get(plan["gpuClass"]) if plan.get("gpuClass") else inventory.classes[0]
    spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [{
        "name": "ranks", "image": "videojob-ranks",  # never run: Kueue reads the requests
        "resources": {"requests": pod_set_requests(klass, int(plan["gpus"]), inventory.device, cpus_per_rank)}}]}
    if klass.node_selector:
        spec["nodeSelector"] = dict(klass.node_selector)
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload",
        "metadata": {
            "name": workload_name(name, uid, attempt, klass.name), "namespace": namespace,
            "labels": {LABEL_UID: uid, LABEL_ATTEMPT: str(attempt), LABEL_CLASS: klass.name,
                       "app.kubernetes.io/managed-by": "videojob-operator"},
            "ownerReferences": [{"apiVersion": "videojob.io/v1alpha1", "kind": "VideoJob", "name": name,
                                 "uid": uid, "controller": True, "blockOwnerDeletion": False}]},
        "spec": {"queueName": queue, "priority": int(priority),
                 "priorityClassRef": {"group": GROUP, "kind": "WorkloadPriorityClass",
                                      "name": priority_class_name(priority)},
                 "podSets": [{"name": POD_SET, "count": 1, "template": {"spec": spec}}],
                 **({} if active else {"active": False})},
    }


@dataclass(frozen=True)
class WorkloadState:
    """What Kueue says about one Workload."""

    admitted: bool
    flavor: str | None  # the flavor the pod set's first resource was admitted on
    evicted: tuple[str, str] | None  # (reason, message) while Kueue evicts or preempted it
    finished: bool
    waiting: str  # Kueue's message while it is not admitted
    deactivated: bool = False  # its spec.active is false: Kueue evicts it and admits it no more until true


# Kueue's eviction reasons for a Workload whose spec.active was set false (v1beta1/v1beta2
# WorkloadDeactivated; older releases said InactiveWorkload): a pause, not a preemption.
DEACTIVATED_REASONS = frozenset({"Deactivated", "InactiveWorkload"})


def _conditions(wl: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in (wl.get("status") or {}).get("conditions") or []}


def read_workload(wl: dict[str, Any]) -> WorkloadState:
    conds = _conditions(wl)
    status = wl.get("status") or {}
    admission = status.get("admission") or {}
    flavors: dict[str, str] = {}
    for assignment in admission.get("podSetAssignments") or []:
        flavors.update(assignment.get("flavors") or {})
    flavor = flavors.get(GPU_RESOURCE) or flavors.get("cpu") or next(iter(flavors.values()), None)
    admitted = (conds.get("Admitted") or {}).get("status") == "True" and bool(admission)
    evicted = None
    for kind in ("Evicted", "Preempted"):
        c = conds.get(kind)
        if c and c.get("status") == "True":
            evicted = (str(c.get("reason") or kind), str(c.get("message") or ""))
            break
    finished = (conds.get("Finished") or {}).get("status") == "True"
    quota = conds.get("QuotaReserved") or {}
    waiting = str(quota.get("message") or "") if quota.get("status") != "True" else ""
    if not waiting and not admitted:
        waiting = "Kueue has not looked at the Workload yet" if not conds else "admission checks pending"
    deactivated = (wl.get("spec") or {}).get("active") is False
    return WorkloadState(admitted, flavor, evicted, finished, waiting, deactivated)


def class_of_flavor(flavor: str | None, flavors: dict[str, dict[str, str]], inventory: ClusterInventory) -> str | None:
    """The GPU class a flavor stands for: the class of that name, else the class whose
    node selector the flavor's node labels (``flavors``: name -> nodeLabels) include."""
    if not flavor:
        return None
    names = {c.name for c in inventory.classes}
    if flavor in names:
        return flavor
    labels = flavors.get(flavor) or {}
    for c in inventory.classes:
        if c.node_selector and all(labels.get(k) == v for k, v in c.node_selector):
            return c.name
    return None


class WorkloadCache:
    """The operator's Workloads as one watch per namespace keeps them (or one for the
    cluster): every waiting or running job looks at its Workload every poll interval,
    and a thousand jobs must not mean a thousand GETs a second."""

    def __init__(self, api: k8s.CustomObjectsApi, namespaces: list[str]):
        self.api, self.namespaces = api, list(namespaces) or [""]
        self._items: dict[tuple[str, str], dict[str, Any]] = {}
        self._synced: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listeners: dict[tuple[str, str], Callable[[], None]] = {}

    def start(self) -> "WorkloadCache":
        for namespace in self.namespaces:
            threading.Thread(target=self._run, args=(namespace,), name=f"kueue-watch-{namespace or 'all'}",
                             daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def get(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        """(known, the Workload): known is False until the watch of its namespace has
        listed, and for a Workload it has not seen (just created): ask the API server."""
        with self._lock:
            item = self._items.get((namespace, name))
            return (item is not None, item)

    def synced(self, namespace: str) -> bool:
        """Whether the watch of ``namespace`` (or of every one: "") has listed."""
        with self._lock:
            return namespace in self._synced

    def listen(self, namespace: str, name: str, wake: Callable[[], None]) -> None:
        """``wake()`` at the next change of that Workload the watch sees (and after each
        relist of its namespace, which may have missed some): a job waiting for Kueue
        parks without a thread and is called again only then."""
        with self._lock:
            self._listeners[(namespace, name)] = wake

    def unlisten(self, namespace: str, name: str) -> None:
        with self._lock:
            self._listeners.pop((namespace, name), None)

    def _wake(self, keys) -> None:
        with self._lock:
            wakes = [self._listeners[k] for k in keys if k in self._listeners]
        for wake in wakes:
            try:
                wake()
            except Exception:  # noqa: BLE001 - a listener's loop closed (shutdown): nothing to wake
                log.debug("a Workload listener failed", exc_info=True)

    def _run(self, namespace: str) -> None:
        from kubernetes import watch

        selector = "app.kubernetes.io/managed-by=videojob-operator"
        while not self._stop.is_set():
            try:
                if namespace:
                    listed = self.api.list_namespaced_custom_object(GROUP, VERSION, namespace, "workloads",
                                                                    label_selector=selector)
                else:
                    listed = self.api.list_cluster_custom_object(GROUP, VERSION, "workloads", label_selector=selector)
                with self._lock:
                    for key in [k for k in self._items if not namespace or k[0] == namespace]:
                        del self._items[key]
                    for item in listed.get("items", []):
                        self._items[(item["metadata"]["namespace"], item["metadata"]["name"])] = item
                    self._synced.add(namespace)
                    relisted = [k for k in self._listeners if not namespace or k[0] == namespace]
                self._wake(relisted)
                version = listed["metadata"]["resourceVersion"]
                # The client gives up WATCH_TIMEOUT_S + the API timeout after the last byte: a
                # connection dropped silently no longer stops the cache (and every eviction) for good.
                kwargs = dict(label_selector=selector, resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
                              allow_watch_bookmarks=True,
                              _request_timeout=request_timeout(WATCH_TIMEOUT_S + api_timeout_s(self.api)))
                args = (GROUP, VERSION, namespace, "workloads") if namespace else (GROUP, VERSION, "workloads")
                call = (self.api.list_namespaced_custom_object if namespace
                        else self.api.list_cluster_custom_object)
                for event in watch.Watch().stream(call, *args, **kwargs):
                    if self._stop.is_set():
                        return
                    obj, kind = event["object"], event["type"]
                    if kind == "ERROR":  # 410 Gone (too old a resourceVersion): list again
                        break
                    if kind == "BOOKMARK":
                        continue
                    key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                    with self._lock:
                        if kind == "DELETED":
                            self._items.pop(key, None)
                        else:
                            self._items[key] = obj
                    self._wake([key])
            except Exception:  # noqa: BLE001 - the API server away: list again shortly; jobs ask it meanwhile
                log.warning("the watch of Workloads in %s stopped; listing again", namespace or "every namespace",
                            exc_info=True)
                with self._lock:
                    self._synced.discard(namespace)
                self._stop.wait(1.0)


class KueueApi:
    """The few calls kueue mode makes: Workloads in the job's namespace, WorkloadPriorityClasses."""

    def __init__(self, api: k8s.ApiClient, namespaces: list[str] | None = None, watch: bool = True):
        self.api = k8s.CustomObjectsApi(api)
        self.cache = WorkloadCache(self.api, namespaces or []).start() if watch else None

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Workload, from the watch's cache where it has it (else asked)."""
        if self.cache is not None:
            known, item = self.cache.get(namespace, name)
            if known:
                return item
        return self.fetch(namespace, name)

    def fetch(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.api.get_namespaced_custom_object(GROUP, VERSION, namespace, "workloads", name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create, or return the one already there (a restarted operator's)."""
        try:
            return self.api.create_namespaced_custom_object(GROUP, VERSION, body["metadata"]["namespace"],
                                                            "workloads", body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        found = self.fetch(body["metadata"]["namespace"], body["metadata"]["name"])
        if found is None:  # deleted between the two calls: once more
            return self.api.create_namespaced_custom_object(GROUP, VERSION, body["metadata"]["namespace"],
                                                            "workloads", body)
        return found

    def of_job(self, namespace: str, uid: str) -> list[dict[str, Any]]:
        return self.api.list_namespaced_custom_object(GROUP, VERSION, namespace, "workloads",
                                                      label_selector=f"{LABEL_UID}={uid}").get("items", [])

    def finish(self, namespace: str, name: str, reason: str, message: str) -> None:
        """Condition Finished: Kueue releases the quota (nothing else would: no pods end)."""
        from .controller.status import now

        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload",
                "metadata": {"name": name, "namespace": namespace},
                "status": {"conditions": [{"type": "Finished", "status": "True", "reason": reason,
                                           "message": message[:1000], "lastTransitionTime": now()}]}}
        try:  # server-side apply: conditions are a map by type, so only this one is ours
            self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, "workloads", name, body, field_manager="videojob-operator", force=True,
                _content_type="application/apply-patch+yaml")
        except ApiException as exc:
            if exc.status != 404:
                raise

    def requeue(self, namespace: str, name: str) -> None:
        """The owner's answer to an eviction of a Workload whose attempt never started
        (what Kueue's job integrations do once their pods are gone): admission cleared,
        QuotaReserved and Admitted False, Requeued with the eviction's reason; Kueue
        frees the quota and queues the same Workload again. A merge patch of the whole
        condition list, guarded by the resourceVersion it was computed from."""
        from .controller.status import now

        wl = self.fetch(namespace, name)
        if wl is None:
            return
        state = read_workload(wl)
        if not (state.admitted and state.evicted is not None):  # a stale look: Kueue moved on already
            return
        conds = {c["type"]: c for c in (wl.get("status") or {}).get("conditions") or []}
        evicted = conds.get("Evicted") or conds.get("Preempted") or {}
        stamp, message = now(), str(evicted.get("message") or "evicted")[:1000]
        conds["QuotaReserved"] = {"type": "QuotaReserved", "status": "False", "reason": "Pending",
                                  "message": message, "lastTransitionTime": stamp}
        conds["Admitted"] = {"type": "Admitted", "status": "False", "reason": "NoReservation",
                             "message": "The workload has no reservation", "lastTransitionTime": stamp}
        conds["Requeued"] = {"type": "Requeued", "status": "True", "reason": str(evicted.get("reason") or "Evicted"),
                             "message": message, "lastTransitionTime": stamp}
        body = {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]},
                "status": {"admission": None, "conditions": list(conds.values())}}
        try:
            self.api.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "workloads", name, body,
                                                           _content_type="application/merge-patch+json")
        except ApiException as exc:
            if exc.status not in (404, 409):  # gone, or changed meanwhile: looked at again next poll
                raise

    def delete(self, namespace: str, name: str) -> None:
        try:
            self.api.delete_namespaced_custom_object(GROUP, VERSION, namespace, "workloads", name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def ensure_priority_class(self, priority: int) -> None:
        body = priority_class_for(priority)
        try:
            self.api.create_cluster_custom_object(GROUP, VERSION, "workloadpriorityclasses", body)
        except ApiException as exc:
            if exc.status != 409:
                raise

    def flavors(self) -> dict[str, dict[str, str]]:
        """Every ResourceFlavor's node labels (an admitted flavor's class)."""
        items = self.api.list_cluster_custom_object(GROUP, VERSION, "resourceflavors").get("items", [])
        return {i["metadata"]["name"]: dict((i.get("spec") or {}).get("nodeLabels") or {}) for i in items}


__all__ = ["DEACTIVATED_REASONS", "GPU_RESOURCE", "KueueApi", "WorkloadCache", "WorkloadState", "class_of_flavor", "priority_class_for",
           "priority_class_name", "read_workload", "workload_for", "workload_name"]
