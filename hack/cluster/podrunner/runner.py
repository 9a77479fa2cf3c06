"""The runner: a kubelet for the nodes in its manifest, with processes for containers.

Start-up: lock the state dir; clean up what a crashed runner of the same state dir left
(keeping the sandboxes of pods whose processes still run: those are adopted); bridge;
nodes registered and kept Ready; informers for Services, EndpointSlices and the pods of
its nodes; one PodWorker per pod; /healthz. Stop: every pod's containers get SIGTERM
(SIGKILL after their grace period), pods are marked Failed as on a node shutdown, and
everything created is removed."""
from __future__ import annotations

import http.server
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .cleanup import SHM, kill_recorded, lock_state_dir, read_state
from .containers import proc_start_time
from .events import Recorder
from .hostpaths import HostPaths, release_prefix
from .hosts import Record, service_records
from .images import Image, ImageMap
from .kube import Api, ApiError, Informer, KubeConfig
from .network import RUN_NETNS, Network, cleanup_prefix
from .nodes import Nodes, load_manifest
from .podworker import PodWorker
from .proxy import ApiProxy
from .util import atomic_write, info, state_prefix, warn

_KIND_PATHS = {"ConfigMap": "configmaps", "Secret": "secrets", "PersistentVolumeClaim": "persistentvolumeclaims"}


@dataclass
class Config:
    kubeconfig: Path
    state_dir: Path
    nodes: Path
    pod_cidr: str
    image_map: Path
    health_port: int | None = None
    backoff_base: float = 10.0
    backoff_max: float = 300.0
    shutdown_grace: float = 30.0
    keep_nodes: bool = False
    token_refresh_fraction: float = 0.8   # of a projected token's life; tests shorten it


class RunnerError(Exception):
    pass


class Runner:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.state_dir = Path(cfg.state_dir).resolve()
        self.prefix = state_prefix(self.state_dir)
        self.shm_root = SHM / self.prefix
        self.image_map_path = Path(cfg.image_map).resolve()
        self.backoff_base, self.backoff_max = cfg.backoff_base, cfg.backoff_max
        self.shutdown_grace = cfg.shutdown_grace
        self.stop_event = threading.Event()
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()
        self._lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._records: list[Record] = []
        self._records_dirty = threading.Event()
        self._lockfile = None
        self._health: http.server.ThreadingHTTPServer | None = None
        self.api_service: tuple[str, int] | None = None
        self.started = False

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        cfg = self.cfg
        if os.geteuid() != 0:
            raise RunnerError("the pod runner needs root (network namespaces, bind mounts, other uids)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lockfile = lock_state_dir(self.state_dir)
        manifest = load_manifest(cfg.nodes)
        self._image_map = ImageMap(self.image_map_path)
        self._image_map_mtime = self.image_map_path.stat().st_mtime
        kc = KubeConfig(cfg.kubeconfig, self.state_dir / "kube")
        self.api = Api(kc)
        try:
            self.api.get("/version")
        except (ApiError, OSError) as exc:
            raise RunnerError(f"cannot reach the apiserver {kc.server} with {cfg.kubeconfig}: {exc}") from exc
        self.network = Network(self.prefix, cfg.pod_cidr)
        adoptable = self._adoptable(read_state(self.state_dir), [n["metadata"]["name"] for n in manifest])
        keep_netns = {r["netns"] for r in adoptable.values() if r.get("netns")}
        keep_links = ({self.network.bridge} | {r["veth"] for r in adoptable.values() if r.get("veth")}) if adoptable else set()
        old = read_state(self.state_dir)
        if not adoptable:
            kill_recorded(old)
        for what in cleanup_prefix(self.prefix, keep_netns, keep_links):
            info("removed a leftover", what=what)
        self.host_paths = HostPaths(self.prefix, self.save_state)
        if not adoptable:
            for p in release_prefix(self.prefix):
                info("removed a leftover", what=f"host path {p}")
            shutil.rmtree(self.shm_root, ignore_errors=True)
            shutil.rmtree(self.state_dir / "pods", ignore_errors=True)
        self.network.setup(reuse=bool(adoptable))
        for rec in adoptable.values():
            if rec.get("podIP"):
                self.network.reserve(rec["podIP"])
        svc = self.api.get_or_none("/api/v1/namespaces/default/services/kubernetes")
        if svc:
            port = next((p["port"] for p in svc["spec"].get("ports", []) if p.get("name") == "https"),
                        svc["spec"]["ports"][0]["port"])
            self.api_service = (svc["spec"]["clusterIP"], int(port))
        else:
            warn("no Service default/kubernetes: pods get no in-cluster apiserver address")
        self.proxy = ApiProxy((kc.host, kc.port))
        self.events = Recorder(self.api, manifest[0]["metadata"]["name"])
        self.nodes = Nodes(self.api, manifest, self.network.gateway, self.stop_event)
        self.nodes.register()
        self._adopt = adoptable
        n_adopt = len(adoptable)
        self.svc_informer = Informer(self.api, "/api/v1/services", self._on_service, self.stop_event, name="services")
        self.eps_informer = Informer(self.api, "/apis/discovery.k8s.io/v1/endpointslices", self._on_service,
                                     self.stop_event, name="endpointslices")
        for inf in (self.svc_informer, self.eps_informer):
            inf.start()
        for inf in (self.svc_informer, self.eps_informer):
            if not inf.synced.wait(60):
                raise RunnerError(f"{inf.name}: no initial list from the apiserver within 60 s")
        self._refresh_records()
        threading.Thread(target=self._hosts_loop, name="hosts", daemon=True).start()
        self.pod_informers = [Informer(self.api, "/api/v1/pods", self._on_pod, self.stop_event,
                                       field_selector=f"spec.nodeName={n}", name=f"pods on {n}")
                              for n in self.nodes.names]
        for inf in self.pod_informers:
            inf.start()
        for inf in self.pod_informers:
            if not inf.synced.wait(60):
                raise RunnerError(f"{inf.name}: no initial list from the apiserver within 60 s")
        if cfg.health_port is not None:
            self._serve_health(cfg.health_port)
        self.started = True
        self.save_state()
        info("pod runner ready", nodes=",".join(self.nodes.names), bridge=self.network.bridge,
             cidr=str(self.network.cidr), state=str(self.state_dir), adopting=n_adopt)

    def _adoptable(self, old: dict, nodes: list[str]) -> dict[str, dict]:
        """Pods of the previous runner whose pod still exists here and whose processes still run."""
        out = {}
        for rec in old.get("pods", []):
            if rec.get("terminal") or rec.get("node") not in nodes or not rec.get("netns"):
                continue
            if not (RUN_NETNS / rec["netns"]).exists():
                continue
            if not any(c.get("pid") and proc_start_time(c["pid"]) == c.get("pidStart") for c in rec.get("containers", [])):
                continue
            out[rec["uid"]] = rec
        return out

    def healthy(self) -> tuple[bool, str]:
        if self.stop_event.is_set():
            return False, "stopping"
        if not self.started or not self.nodes.ready.is_set():
            return False, "starting"
        for inf in [self.svc_informer, self.eps_informer, *self.pod_informers]:
            if not inf.is_alive() or not inf.watching.is_set():
                return False, f"{inf.name} not watching"
        return True, "ok"

    def _serve_health(self, port: int) -> None:
        runner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path.startswith("/healthz"):
                    ok, why = runner.healthy()
                    body, code = why.encode(), 200 if ok else 503
                elif self.path.startswith("/state"):
                    body, code = json.dumps(runner.state()).encode(), 200
                else:
                    body, code = b"not found", 404
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._health = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self._health.serve_forever, name="healthz", daemon=True).start()

    # ------------------------------------------------------------------ informer handlers
    def _on_pod(self, event: str, old: dict | None, new: dict | None) -> None:
        pod = new or old
        uid = pod["metadata"]["uid"]
        with self._lock:
            if self.stop_event.is_set():
                return
            w = self.workers.get(uid)
            if event == "DELETED":
                if w:
                    w.object_deleted()
                self.finished.discard(uid)
                return
            if w:
                w.update(pod)
                return
            phase = (pod.get("status") or {}).get("phase")
            if uid in self.finished or phase in ("Succeeded", "Failed"):
                if pod["metadata"].get("deletionTimestamp"):
                    threading.Thread(target=self.delete_pod, args=(pod,), daemon=True).start()
                return
            w = PodWorker(self, pod, adopt=self._adopt.pop(uid, None))
            self.workers[uid] = w
            w.start()

    def worker_done(self, w: PodWorker) -> None:
        with self._lock:
            if self.workers.get(w.uid) is w:
                del self.workers[w.uid]
            if not w.gone:
                self.finished.add(w.uid)
        self.save_state()

    def _on_service(self, event: str, old, new) -> None:
        self._records_dirty.set()

    def _refresh_records(self) -> None:
        routed = {("default", "kubernetes"): self.api_service[0]} if self.api_service else {}
        records = service_records(self.svc_informer.items(), self.eps_informer.items(), routed)
        with self._lock:
            changed = records != self._records
            self._records = records
            workers = list(self.workers.values())
        if changed:
            for w in workers:
                w.sandbox.refresh_hosts(w.pod)

    def _hosts_loop(self) -> None:
        while not self.stop_event.is_set():
            if self._records_dirty.wait(1.0):
                self._records_dirty.clear()
                time.sleep(0.05)   # batch a burst of slice updates
                self._refresh_records()

    # ------------------------------------------------------------------ used by pod workers
    def host_records(self) -> list[Record]:
        with self._lock:
            return list(self._records)

    def images(self) -> ImageMap:
        try:
            mtime = self.image_map_path.stat().st_mtime
            if mtime != self._image_map_mtime:
                self._image_map = ImageMap(self.image_map_path)
                self._image_map_mtime = mtime
                info("image map reloaded", path=str(self.image_map_path))
        except Exception as exc:  # noqa: BLE001 - keep the last good map
            warn("image map not reloaded; keeping the previous one", error=str(exc))
        return self._image_map

    def profile_file(self, image: Image) -> Path | None:
        if image.profile is None:
            return None
        path = self.state_dir / "images" / f"{image.digest[:16]}.profile"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, image.profile)
        return path

    def services(self) -> list[dict]:
        return self.svc_informer.items()

    def allocatable(self, node: str) -> dict:
        return self.nodes.allocatable(node)

    def get_object(self, kind: str, namespace: str, name: str) -> dict | None:
        if kind == "PersistentVolume":
            return self.api.get_or_none(f"/api/v1/persistentvolumes/{name}")
        return self.api.get_or_none(f"/api/v1/namespaces/{namespace}/{_KIND_PATHS[kind]}/{name}")

    def request_token(self, namespace: str, service_account: str, pod: dict, audience: str | None,
                      seconds: int) -> tuple[str, float]:
        from .util import parse_rfc3339

        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"audiences": [audience] if audience else [], "expirationSeconds": seconds,
                         "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                            "uid": pod["metadata"]["uid"]}}}
        out = self.api.post(f"/api/v1/namespaces/{namespace}/serviceaccounts/{service_account}/token", body)
        return out["status"]["token"], parse_rfc3339(out["status"]["expirationTimestamp"])

    def patch_status(self, pod: dict, status: dict) -> bool:
        """Write the pod's status; False when it did not reach the API server and is worth
        trying again (a pod that is gone or was replaced is not)."""
        meta = pod["metadata"]
        try:
            self.api.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                           {"metadata": {"uid": meta["uid"]}, "status": status}, kind="strategic")
        except ApiError as exc:
            if exc.status in (404, 409, 422):
                return True
            warn("status update failed", pod=f"{meta['namespace']}/{meta['name']}", error=str(exc)[:300])
            return False
        except OSError as exc:
            warn("status update failed", pod=f"{meta['namespace']}/{meta['name']}", error=str(exc)[:300])
            return False
        return True

    def delete_pod(self, pod: dict) -> None:
        meta = pod["metadata"]
        try:
            self.api.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                            {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                             "preconditions": {"uid": meta["uid"]}})
        except ApiError as exc:
            if exc.status not in (404, 409):
                warn("pod delete failed", pod=f"{meta['namespace']}/{meta['name']}", error=str(exc)[:300])
        except OSError as exc:
            warn("pod delete failed", pod=f"{meta['namespace']}/{meta['name']}", error=str(exc)[:300])

    # ------------------------------------------------------------------ state file
    def state(self) -> dict:
        with self._lock:
            workers = list(self.workers.values())
        return {"version": 1, "pid": os.getpid(), "prefix": self.prefix, "stateDir": str(self.state_dir),
                "bridge": self.network.bridge, "gateway": self.network.gateway, "podCIDR": str(self.network.cidr),
                "nodes": list(self.nodes.names) if hasattr(self, "nodes") else [],
                "apiserverClusterIP": list(self.api_service) if self.api_service else None,
                "hostPaths": list(self.host_paths.used),
                "pods": [w.record() for w in workers]}

    def save_state(self) -> None:
        if not hasattr(self, "network") or not hasattr(self, "host_paths"):
            return
        with self._state_lock:
            atomic_write(self.state_dir / "runner.json", json.dumps(self.state(), indent=1))

    # ------------------------------------------------------------------ stop
    def stop(self, reason: str = "Pod was terminated in response to imminent node shutdown.") -> None:
        """Stop every pod's processes and remove everything the runner created."""
        if self._lockfile is None:
            return   # never got the state dir: nothing here is ours to remove
        info("pod runner stopping")
        self.stop_event.set()
        with self._lock:
            workers = list(self.workers.values())
        for w in workers:
            w.stop(reason)
        for w in workers:
            w.done.wait(self.shutdown_grace + 30)
        if hasattr(self, "nodes"):
            self.nodes.shutdown(delete_created=not self.cfg.keep_nodes)
        if hasattr(self, "proxy"):
            self.proxy.close()
        for what in cleanup_prefix(self.prefix):
            info("removed", what=what)
        if hasattr(self, "host_paths"):
            self.host_paths.release()
        shutil.rmtree(self.shm_root, ignore_errors=True)
        shutil.rmtree(self.state_dir / "pods", ignore_errors=True)
        if hasattr(self, "network"):
            self.save_state()
        if self._health is not None:
            self._health.shutdown()
        if self._lockfile is not None:
            self._lockfile.close()
        info("pod runner stopped")
