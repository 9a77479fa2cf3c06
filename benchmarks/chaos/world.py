"""The real parts the soak runs on, and what it sees of them while it runs.

``Cluster``   the loopback kube-apiserver in its own cluster dir (so restarting
              its API server disturbs no other test's cluster), held with
              ``up --ephemeral --holder`` like tests/conftest.py, released at the end.
``Observer``  two sampler threads: Ray's job table (every second: the operator
              deletes finished Ray jobs, so what the table held must be kept as it
              is seen) and the VideoJobs (every two seconds: statuses, attempts,
              when each job was seen gone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from machine import REPO

LOCALCLUSTER = REPO / "hack" / "cluster" / "localcluster.py"
CRD_FILE = REPO / "crds" / "videojob.io_videojobs.yaml"
DEFAULT_CLUSTER_DIR = Path(os.environ.get("VIDEOJOB_CHAOS_CLUSTER_DIR") or REPO / ".cluster-chaos")
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def log(message: str) -> None:
    print(f"chaos {time.strftime('%H:%M:%S')}: {message}", file=sys.stderr, flush=True)


def localcluster(cluster_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LOCALCLUSTER), "--cluster-dir", str(cluster_dir), *args],
                          capture_output=True, text=True, timeout=timeout)


class Cluster:
    """The chaos soak's own loopback cluster (what tests/operator_harness.py needs of one:
    ``kubectl(...)``, ``kubeconfig_for(...)``), plus ``restart_apiserver()``."""

    def __init__(self, cluster_dir: Path = DEFAULT_CLUSTER_DIR, state: dict | None = None):
        """``state``: a cluster someone else holds (the test's fixture); else it is started here."""
        self.dir, self.owned = Path(cluster_dir), state is None
        if state is None:
            args = ["up", "--ephemeral", "--holder", str(os.getpid()), "--json"]
            if os.environ.get("VIDEOJOB_CLUSTER_NO_BUILD", "").strip() == "1":
                args.append("--no-build")
            res = localcluster(self.dir, *args, timeout=float(os.environ.get("VIDEOJOB_CLUSTER_UP_TIMEOUT", "3600")))
            if res.returncode != 0:
                raise RuntimeError(f"the chaos cluster in {self.dir} could not start:\n{res.stderr[-4000:]}")
            state = json.loads(res.stdout)
        self.state = state
        self.kubeconfig = Path(state["kubeconfig"])
        self.kubectl_bin = state["kubectl"]
        self.server = state["server"]

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        argv = [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", "--request-timeout=20s", *map(str, args)]
        res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(map(str, args))} failed: {res.stderr.strip()[-2000:]}")
        return res

    def kubeconfig_for(self, namespace: str, service_account: str, out: Path, duration: str = "1h") -> Path:
        # Longer than any soak: an expired token would look like an operator fault.
        res = localcluster(self.dir, "kubeconfig-for", "--namespace", namespace, "--service-account",
                           service_account, "--duration", "6h", "--out", str(out), timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"kubeconfig-for failed: {res.stderr[-2000:]}")
        return Path(out)

    def restart_apiserver(self) -> dict:
        """``localcluster.py restart-apiserver``: same port and flags, etcd keeps its data."""
        res = localcluster(self.dir, "restart-apiserver", timeout=400)
        if res.returncode != 0:
            raise RuntimeError(f"restart-apiserver failed: {res.stderr[-2000:]}")
        return json.loads(res.stdout)

    def apply_crd(self) -> None:
        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        wait("the CRD to be Established", lambda: self.kubectl(
            "wait", "--for=condition=Established", "--timeout=10s", "crd/videojobs.videojob.io",
            check=False).returncode == 0, 90)

    def release(self) -> None:
        if self.owned:
            localcluster(self.dir, "release", "--holder", str(os.getpid()), timeout=120)


def wait(what: str, probe, timeout: float, interval: float = 0.5):
    """Poll ``probe`` until truthy; TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = probe()
        except Exception as exc:  # noqa: BLE001 - a busy machine or a restarting server: try again
            value, error = None, exc
        else:
            error = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}"
                               + (f" (last error: {error})" if error else ""))
        time.sleep(interval)


class Observer:
    """What Ray's job table and the VideoJobs held during the soak, kept as seen."""

    def __init__(self, ray_url: str, token: str, cluster: Cluster, namespace: str):
        from videojob.raycluster.client import HttpRayClient

        # No retries: a sample that fails (dashboard frozen, machine busy) is just skipped.
        self.ray = HttpRayClient(ray_url, token=token, timeout_s=5, retries=0)
        self.cluster, self.namespace = cluster, namespace
        self.submissions: dict[str, dict] = {}   # submission id -> what was seen of it
        self.jobs: dict[str, dict] = {}          # uid -> name, last status, attempts seen, gone_at
        self.samples = {"ray": 0, "rayFailed": 0, "kube": 0, "kubeFailed": 0}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(self.sample_ray, 1.0), daemon=True),
                         threading.Thread(target=self._loop, args=(self.sample_kube, 2.0), daemon=True)]

    def start(self) -> "Observer":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _loop(self, sample, interval: float) -> None:
        while not self._stop.is_set():
            sample()
            self._stop.wait(interval)

    def sample_ray(self) -> None:
        try:
            rows = self.ray._json("GET", "/api/jobs/") or []
        except Exception:  # noqa: BLE001 - counted; the next sample tries again
            self.samples["rayFailed"] += 1
            return
        now = time.time()
        self.samples["ray"] += 1
        with self._lock:
            for row in rows:
                sid = row.get("submission_id")
                if not sid:
                    continue
                meta = row.get("metadata") or {}
                seen = self.submissions.setdefault(sid, {
                    "uid": meta.get("videojob.io/uid"), "name": meta.get("videojob.io/name"),
                    "teardown": meta.get("videojob.io/teardown"), "firstSeen": now, "statuses": []})
                seen["lastSeen"] = now
                seen["status"] = row.get("status")
                if not seen["statuses"] or seen["statuses"][-1] != row.get("status"):
                    seen["statuses"].append(row.get("status"))
                if row.get("status") not in TERMINAL:
                    seen["lastSeenLive"] = now
                for key, field in (("start", "start_time"), ("end", "end_time")):
                    if row.get(field):
                        seen[key] = row[field] / 1000
                pid = (row.get("driver_info") or {}).get("pid")
                if pid:
                    seen["driverPid"] = int(pid)

    def sample_kube(self) -> None:
        try:
            items = json.loads(self.cluster.kubectl("get", "vj", "-n", self.namespace, "-o", "json",
                                                    timeout=30).stdout)["items"]
        except Exception:  # noqa: BLE001 - the API server may be restarting
            self.samples["kubeFailed"] += 1
            return
        now = time.time()
        self.samples["kube"] += 1
        with self._lock:
            present = set()
            for obj in items:
                uid, status = obj["metadata"]["uid"], obj.get("status") or {}
                present.add(uid)
                job = self.jobs.setdefault(uid, {"name": obj["metadata"]["name"], "attempts": set(),
                                                 "firstSeen": now})
                job["phase"], job["status"], job["lastSeen"] = status.get("phase"), status, now
                job["deleting"] = bool(obj["metadata"].get("deletionTimestamp"))
                job["attempts"] |= {a["submissionId"] for a in status.get("attempts") or [] if a.get("submissionId")}
            for uid, job in self.jobs.items():
                if uid not in present and "goneAt" not in job:
                    job["goneAt"] = now

    # -- what the fault injector asks ----------------------------------------------

    def phase_of(self, name: str) -> str | None:
        with self._lock:
            return next((j.get("phase") for j in self.jobs.values() if j["name"] == name and "goneAt" not in j),
                        None)

    def running(self) -> list[dict]:
        """Jobs last seen Running and not being deleted: name, uid."""
        with self._lock:
            return [{"name": j["name"], "uid": uid} for uid, j in self.jobs.items()
                    if j.get("phase") == "Running" and not j.get("deleting") and "goneAt" not in j]

    def live_drivers(self) -> list[dict]:
        """Job drivers (not teardowns) last seen RUNNING with a driver pid."""
        with self._lock:
            return [{"sid": sid, **s} for sid, s in self.submissions.items()
                    if s.get("uid") and s.get("status") == "RUNNING" and s.get("driverPid")]

    def snapshot(self) -> tuple[dict, dict]:
        with self._lock:
            return ({k: dict(v, statuses=list(v["statuses"])) for k, v in self.submissions.items()},
                    {k: dict(v, attempts=set(v["attempts"])) for k, v in self.jobs.items()})
