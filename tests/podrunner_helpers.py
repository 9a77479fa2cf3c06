"""Helpers for tests/test_podrunner*.py: a pod runner process for the loopback cluster,
and a small apiserver client (the admin client certificate; no kubectl process per poll,
which would cost the shared 2 cores more than the pods do)."""
from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from helpers import wait_for

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack" / "cluster"))
from podrunner.util import state_prefix  # noqa: E402

VENV_BIN = Path(sys.executable).parent
PYTHON_IMAGE = "test/python"


class Api:
    """JSON over HTTPS with the cluster's admin client certificate."""

    def __init__(self, cluster):
        pki = cluster.cluster_dir / "pki"
        self.server = cluster.server
        self.ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))

    def call(self, method: str, path: str, body: dict | None = None, ok404: bool = False,
             ctype: str = "application/json"):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": ctype, "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, context=self.ctx, timeout=30) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and ok404:
                return None
            raise AssertionError(f"{method} {path}: HTTP {exc.code}: {exc.read().decode()[:500]}") from None
        return json.loads(raw) if raw else None

    def create(self, ns: str, obj: dict) -> dict:
        kind = obj["kind"]
        if kind in ("Role", "RoleBinding"):
            base = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/{kind.lower()}s"
        else:
            plural = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Secret": "secrets",
                      "PersistentVolumeClaim": "persistentvolumeclaims", "ServiceAccount": "serviceaccounts"}[kind]
            base = f"/api/v1/namespaces/{ns}/{plural}"
        return self.call("POST", base, obj)

    def pod(self, ns: str, name: str) -> dict | None:
        return self.call("GET", f"/api/v1/namespaces/{ns}/pods/{name}", ok404=True)

    def delete_pod(self, ns: str, name: str, grace: int | None = None) -> None:
        body = {"gracePeriodSeconds": grace} if grace is not None else None
        self.call("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", body, ok404=True)

    def wait_pod(self, ns: str, name: str, what: str, pred, timeout: float = 30.0) -> dict:
        """Poll the pod until pred(pod) is true; fail naming `what` and showing its status."""
        last: dict = {}

        def probe():
            nonlocal last
            last = self.pod(ns, name) or {}
            return last if last and pred(last) else None

        try:
            return wait_for(f"pod {ns}/{name}: {what}", probe, timeout=timeout, interval=0.25)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\nstatus: {json.dumps(last.get('status'), indent=1)[:3000]}") from None


def phase(p: dict) -> str | None:
    return (p.get("status") or {}).get("phase")


def condition(p: dict, ctype: str) -> str | None:
    for c in (p.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c["status"]
    return None


def cstatus(p: dict, name: str, init: bool = False) -> dict:
    key = "initContainerStatuses" if init else "containerStatuses"
    for s in (p.get("status") or {}).get(key) or []:
        if s["name"] == name:
            return s
    return {}


def python_pod(name: str, node: str, script: str | None = None, **spec) -> dict:
    """A pod of one `python -c script` container named `main` (spec keys override)."""
    containers = spec.pop("containers", None) or [python_container("main", script)]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": spec.pop("labels", {"test": name})},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 2, "containers": containers, **spec}}


def python_container(name: str, script: str, **extra) -> dict:
    return {"name": name, "image": f"{PYTHON_IMAGE}:1", "command": ["python", "-c", script], **extra}


def free_pod_cidr() -> str:
    """A /24 under 10.200.0.0/13 that no route of this host overlaps."""
    routes = json.loads(subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True,
                                       text=True, check=True).stdout or "[]")
    taken = []
    for r in routes:
        try:
            taken.append(ipaddress.ip_network(r.get("dst", ""), strict=False))
        except ValueError:
            pass
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{random.randint(200, 207)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return str(net)
    raise RuntimeError("no free /24 under 10.200.0.0/13")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunnerProcess:
    """`python hack/cluster/podrunner ...` for the test cluster, with its own state dir,
    nodes and pod CIDR; logs to <state-dir>.log."""

    def __init__(self, cluster, state_dir: Path, nodes: list[str], image_map: Path, pod_cidr: str):
        self.cluster = cluster
        self.state_dir = state_dir
        self.nodes = nodes
        self.prefix = state_prefix(state_dir)
        self.pod_cidr = pod_cidr
        self.health_port = _free_port()
        self.log_path = state_dir.with_suffix(".log")
        self.nodes_file = state_dir.with_suffix(".nodes.yaml")
        self.nodes_file.write_text(yaml.safe_dump_all([
            {"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": n, "labels": {"videojob.io/test": "podrunner"}},
             "status": {"capacity": {"cpu": "4", "memory": "8Gi", "ephemeral-storage": "20Gi", "pods": "110"},
                        "allocatable": {"cpu": "4", "memory": "8Gi", "ephemeral-storage": "20Gi", "pods": "110"}}}
            for n in nodes]))
        self.argv = [sys.executable, str(REPO / "hack" / "cluster" / "podrunner"), "--kubeconfig",
                     str(cluster.kubeconfig), "--state-dir", str(state_dir), "--nodes", str(self.nodes_file),
                     "--pod-cidr", pod_cidr, "--image-map", str(image_map), "--health-port", str(self.health_port),
                     "--backoff-base", "1", "--backoff-max", "4", "--shutdown-grace", "3", "--log-level", "debug",
                     # kube-api-access tokens live 3607 s: renewed after ~3.6 s here
                     "--token-refresh-fraction", "0.001"]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "RunnerProcess":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

        def healthy():
            if self.proc.poll() is not None:
                raise AssertionError(f"the pod runner exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for("the pod runner's /healthz to answer 200", healthy, timeout=timeout)
        return self

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def state(self) -> dict:
        return json.loads((self.state_dir / "runner.json").read_text())

    def pod_record(self, ns: str, name: str) -> dict | None:
        return next((p for p in self.state()["pods"] if p["namespace"] == ns and p["name"] == name), None)

    def log(self, ns: str, name: str, container: str = "main") -> str:
        files = sorted((self.state_dir / "logs").glob(f"{ns}_{name}_*/{container}.log"),
                       key=lambda p: p.stat().st_mtime)
        return files[-1].read_text(errors="replace") if files else ""

    def wait_log(self, ns: str, name: str, text: str, container: str = "main", timeout: float = 30) -> str:
        return wait_for(f"{text!r} in the log of {ns}/{name}/{container}",
                        lambda: (lambda s: s if text in s else None)(self.log(ns, name, container)), timeout=timeout)

    def stop(self, timeout: float = 60) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"the pod runner ignored SIGTERM for {timeout:.0f}s:\n{self.log_tail()}") from None

    def kill(self) -> None:
        """SIGKILL: a crash, leaving its pods' processes and namespaces behind."""
        self.proc.kill()
        self.proc.wait(10)


def leftovers(prefix: str, created_paths: list[str] = ()) -> list[str]:
    """Everything of a runner prefix still on this machine."""
    out = []
    netns_dir = Path("/run/netns")
    if netns_dir.exists():
        out += [f"netns {n}" for n in os.listdir(netns_dir) if n.startswith(prefix)]
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True).stdout or "[]")
    out += [f"link {l['ifname']}" for l in links if l.get("ifname", "").startswith(prefix)]
    etc = Path("/etc/netns")
    if etc.exists():
        out += [f"/etc/netns/{d.name}" for d in etc.iterdir() if d.name.startswith(prefix)]
    if Path(f"/dev/shm/{prefix}").exists():
        out.append(f"/dev/shm/{prefix}")
    out += [f"host path {p}" for p in created_paths if os.path.lexists(p)]
    return out


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:][:1] not in ("Z", "X")
