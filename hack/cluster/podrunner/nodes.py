"""The Nodes the runner is the kubelet of: registered from a manifest (created when
missing, labels/annotations/taints merged when present), kept Ready with a Lease in
kube-node-lease renewed every 10 s and a status heartbeat, so the node lifecycle
controller never marks them NotReady or taints them."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import threading
import uuid
from pathlib import Path

import yaml

from .kube import Api, ApiError
from .util import info, now_rfc3339, warn

LEASE_SECONDS = 40
RENEW_SECONDS = 10
STATUS_SECONDS = 30
KWOK_ANNOTATION = "kwok.x-k8s.io/node"


class NodeError(Exception):
    pass


def micro_time() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def load_manifest(path: Path) -> list[dict]:
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except (OSError, yaml.YAMLError) as exc:
        raise NodeError(f"--nodes {path}: {exc}") from exc
    nodes = []
    for d in docs:
        if d.get("kind") == "List":
            docs.extend(d.get("items") or [])
            continue
        if d.get("kind") != "Node" or not d.get("metadata", {}).get("name"):
            raise NodeError(f"--nodes {path}: every document must be a Node with metadata.name "
                            f"(got kind {d.get('kind')!r})")
        if KWOK_ANNOTATION in (d["metadata"].get("annotations") or {}):
            raise NodeError(f"--nodes {path}: node {d['metadata']['name']} has the annotation {KWOK_ANNOTATION}, "
                            f"so KWOK would manage it too; remove the annotation for pod-runner nodes")
        nodes.append(d)
    if not nodes:
        raise NodeError(f"--nodes {path}: no Node in the file")
    return nodes


class Nodes:
    def __init__(self, api: Api, manifest: list[dict], internal_ip: str, stop: threading.Event,
                 kubelet_port: int = 0):
        self.api = api
        self.manifest = {n["metadata"]["name"]: n for n in manifest}
        self.names = list(self.manifest)
        self.internal_ip = internal_ip
        self.stop = stop
        self.kubelet_port = kubelet_port
        self.created: list[str] = []
        self.ready = threading.Event()
        self._boot_id = str(uuid.uuid4())
        try:
            self._version = api.get("/version").get("gitVersion", "v1.34.0")
        except (ApiError, OSError):
            self._version = "v1.34.0"
        self._thread = threading.Thread(target=self._loop, name="node-heartbeat", daemon=True)

    def allocatable(self, name: str) -> dict:
        status = self.manifest.get(name, {}).get("status") or {}
        return dict(status.get("allocatable") or status.get("capacity") or {})

    def _status(self, name: str) -> dict:
        want = self.manifest[name].get("status") or {}
        now = now_rfc3339()

        def cond(ctype, status, reason, message):
            return {"type": ctype, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": self._transitions.get((name, ctype), now)}

        conds = [cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                 cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                 cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                 cond("Ready", "True", "KubeletReady", "kubelet is posting ready status (podrunner)")]
        for c in conds:
            self._transitions.setdefault((name, c["type"]), c["lastTransitionTime"])
        capacity = dict(want.get("capacity") or {"cpu": str(os.cpu_count()), "memory": "8Gi", "pods": "110"})
        return {
            "capacity": capacity, "allocatable": dict(want.get("allocatable") or capacity),
            "conditions": conds,
            "addresses": [{"type": "InternalIP", "address": self.internal_ip}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
            "nodeInfo": {"machineID": uuid.uuid5(uuid.NAMESPACE_DNS, name).hex, "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
                         "bootID": self._boot_id, "kernelVersion": platform.release(), "osImage": "podrunner (local processes)",
                         "containerRuntimeVersion": "podrunner://0.1", "kubeletVersion": self._version,
                         "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": _arch()},
        }

    def register(self) -> None:
        self._transitions: dict = {}
        for name, want in self.manifest.items():
            meta = want["metadata"]
            existing = self.api.get_or_none(f"/api/v1/nodes/{name}")
            if existing is None:
                body = {"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": name, "labels": {**(meta.get("labels") or {}),
                                                              "kubernetes.io/hostname": name},
                                     "annotations": {**(meta.get("annotations") or {}),
                                                     "podrunner.videojob.io/managed": "true"}},
                        "spec": dict(want.get("spec") or {}), "status": self._status(name)}
                try:
                    self.api.post("/api/v1/nodes", body)
                    self.created.append(name)
                    info("node created", node=name)
                except ApiError as exc:
                    if exc.status != 409:
                        raise
            else:
                patch = {"metadata": {"labels": {**(meta.get("labels") or {}), "kubernetes.io/hostname": name},
                                      "annotations": {**(meta.get("annotations") or {}),
                                                      "podrunner.videojob.io/managed": "true"}}}
                if (want.get("spec") or {}).get("taints") is not None:
                    patch["spec"] = {"taints": want["spec"]["taints"]}
                self.api.patch(f"/api/v1/nodes/{name}", patch)
                info("node adopted", node=name)
            self.api.patch(f"/api/v1/nodes/{name}/status", {"status": self._status(name)})
            self._renew_lease(name)
        self.ready.set()
        self._thread.start()

    def _renew_lease(self, name: str) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        lease = self.api.get_or_none(path)
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": micro_time()}
        if lease is None:
            node = self.api.get(f"/api/v1/nodes/{name}")
            self.api.post("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", {
                "metadata": {"name": name, "namespace": "kube-node-lease",
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name,
                                                  "uid": node["metadata"]["uid"]}]},
                "spec": spec})
        else:
            lease["spec"].update(spec)
            self.api.put(path, lease)

    def _loop(self) -> None:
        ticks = 0
        while not self.stop.wait(RENEW_SECONDS):
            ticks += 1
            for name in self.names:
                try:
                    self._renew_lease(name)
                    if ticks % (STATUS_SECONDS // RENEW_SECONDS) == 0:
                        self.api.patch(f"/api/v1/nodes/{name}/status", {"status": self._status(name)})
                except (ApiError, OSError) as exc:
                    warn("node heartbeat failed", node=name, error=str(exc)[:300])

    def shutdown(self, delete_created: bool) -> None:
        if not delete_created:
            return
        for name in self.created:
            for path in (f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}",
                         f"/api/v1/nodes/{name}"):
                try:
                    self.api.delete(path)
                except ApiError as exc:
                    if exc.status != 404:
                        warn("could not delete", path=path, error=str(exc)[:200])
                except OSError as exc:
                    warn("could not delete", path=path, error=str(exc)[:200])
            info("node deleted", node=name)


def _arch() -> str:
    m = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(m, m)
