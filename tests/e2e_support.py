"""What tests/test_cluster_e2e.py (and benchmarks/head_memory.py) need around a
release of the chart on the cluster whose pods really run (the e2e_cluster
fixture: `localcluster.py up --full --pod-runner`).

The chart is installed as a user would (`helm install -f ci/kuberay-cpu.yaml`),
with what that file says the installer provides: the token Secret, a
PersistentVolume pre-bound to the chart's claim (hostPath: a directory of the
test's, which the pods mount through the pod runner, so the test reads the
files the pods wrote), and the watched namespace. The pods run the commands
KubeRay and the chart generate, as processes of this checkout's venv.
"""
from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from helpers import REPO, helm_binary, running_ready, wait_for

CHART = REPO / "charts" / "videojob"
CPU_VALUES = CHART / "ci" / "kuberay-cpu.yaml"
RELEASE = "videojob"
RAYCLUSTER = f"{RELEASE}-ray"
CLAIM = f"{RELEASE}-data"
TOKEN_SECRET = "videojob-ray-token"
RUNTIME_UID = 65532  # the images' USER and the chart's podSecurityContext
DATA_MOUNT = f"/mnt/videojob/{CLAIM}"  # persistence.mountRoot/<claim>, as the chart mounts it
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"
HELM_TIMEOUT_S = 180
S3_SECRET = "videojob-s3"  # the admin's Secret with the store's key pair (runtime.s3.credentialsSecret)
S3_BUCKET = "videos"  # the one bucket the release lets jobs name (runtime.s3.buckets)


@dataclass
class Release:
    """One install of the chart in its own namespace on the e2e cluster."""

    cluster: object  # conftest.E2ECluster
    namespace: str
    data: Path  # the PersistentVolume's directory: what the pods see at DATA_MOUNT
    token: str
    helm_home: Path
    extra_args: list[str] = field(default_factory=list)
    inputs: "HttpsInputs | None" = None
    store: object = None  # hack/cluster/lc/s3.S3Server on the pod runner's gateway

    # -- helm and kubectl --------------------------------------------------------------------
    def helm(self, *args: str, check: bool = True, timeout: float = HELM_TIMEOUT_S) -> subprocess.CompletedProcess:
        env = {**os.environ, "KUBECONFIG": str(self.cluster.kubeconfig),
               "HELM_CONFIG_HOME": str(self.helm_home / "config"), "HELM_CACHE_HOME": str(self.helm_home / "cache"),
               "HELM_DATA_HOME": str(self.helm_home / "data")}
        result = subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env, cwd=REPO,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
        return result

    def kubectl(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return self.cluster.kubectl(*args, **kw)

    def get(self, *args: str) -> dict:
        return self.cluster.get_json(*args, "-n", self.namespace)

    def pods(self, selector: str) -> list[dict]:
        return self.get("pods", "-l", selector)["items"]

    def install_args(self) -> list[str]:
        return ["-f", str(CPU_VALUES), "--set", f"watch.namespaces={{{self.namespace}}}", *self.extra_args]

    def install(self) -> None:
        self.helm("install", RELEASE, str(CHART), "--namespace", self.namespace, *self.install_args())

    def uninstall(self) -> None:
        self.helm("uninstall", RELEASE, "--namespace", self.namespace, "--ignore-not-found", "--wait",
                  "--timeout=120s")

    # -- pods ------------------------------------------------------------------------------------
    def wait_ready(self, selector: str, count: int = 1, timeout: float = 300) -> list[dict]:
        """Exactly ``count`` pods of ``selector`` Running with every container Ready."""
        def ready():
            found = self.pods(selector)
            up = [p for p in found if running_ready(p)]
            return up if len(found) == count and len(up) == count else None
        try:
            return wait_for(f"{count} Ready pod(s) `{selector}` in {self.namespace}", ready, timeout=timeout,
                            interval=1)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; pods now: {self.describe_pods()}") from None

    def describe_pods(self) -> str:
        """One line per pod: name, node, phase, container states (for timeout messages)."""
        lines = []
        for pod in self.get("pods")["items"]:
            states = []
            for cs in pod.get("status", {}).get("initContainerStatuses", []) + \
                    pod.get("status", {}).get("containerStatuses", []):
                state = next(iter(cs.get("state") or {"?": {}}))
                detail = (cs.get("state") or {}).get(state) or {}
                states.append(f"{cs['name']}={state}{'/' + detail['reason'] if detail.get('reason') else ''}"
                              f"{'(ready)' if cs.get('ready') else ''} restarts={cs.get('restartCount', 0)}")
            lines.append(f"{pod['metadata']['name']}@{pod['spec'].get('nodeName')} "
                         f"{pod.get('status', {}).get('phase')} [{', '.join(states)}]")
        return "; ".join(lines) or "none"

    def head(self) -> dict:
        (head,) = self.pods(f"ray.io/cluster={RAYCLUSTER},ray.io/node-type=head")
        return head

    def workers(self, group: str) -> list[dict]:
        return self.pods(f"ray.io/cluster={RAYCLUSTER},ray.io/group={group}")

    # -- the pod runner's view -------------------------------------------------------------------
    def runner_pods(self) -> list[dict]:
        """The pod runner's records of this namespace's pods (its state file)."""
        return [p for p in (self.cluster.runner_state().get("pods") or [])
                if p.get("namespace") == self.namespace]

    def container_pid(self, pod_name: str, container: str) -> int:
        for record in self.runner_pods():
            if record["name"] == pod_name:
                for c in record.get("containers", []):
                    if c["name"] == container and c.get("pid"):
                        return int(c["pid"])
        raise AssertionError(f"the pod runner runs no container {container} of {pod_name}: {self.runner_pods()}")

    def in_container(self, pod_name: str, container: str, *argv: str) -> subprocess.CompletedProcess:
        """Run argv in the container's mount, network and pid namespaces (as root: what the
        container's filesystem looks like, not what its user may do)."""
        pid = self.container_pid(pod_name, container)
        return subprocess.run(["nsenter", "-t", str(pid), "-m", "-n", "-p", "--", *argv],
                              capture_output=True, text=True, timeout=30)

    # -- Ray, as the operator reaches it ---------------------------------------------------------
    def ray(self, path: str, timeout: float = 10) -> dict:
        """GET the head's dashboard (the State and Jobs APIs) with the token, from the host."""
        ip = self.head()["status"]["podIP"]
        request = urllib.request.Request(f"http://{ip}:8265{path}", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the test's own cluster
            return json.loads(response.read())

    def ray_nodes(self) -> list[dict]:
        return self.ray("/api/v0/nodes?detail=1&limit=1000")["data"]["result"]["result"]

    def ray_actors(self, prefix: str) -> list[dict]:
        rows = self.ray("/api/v0/actors?detail=1&limit=10000")["data"]["result"]["result"]
        return [a for a in rows if (a.get("name") or "").startswith(prefix)]

    # -- VideoJobs ---------------------------------------------------------------------------------
    def apply_job(self, doc: dict) -> None:
        self.kubectl("apply", "-n", self.namespace, "-f", "-", input=json.dumps(doc))

    def job(self, name: str) -> dict:
        return self.get("videojob", name)


def tiny_job(name: str, **spec) -> dict:
    """examples/tiny-cpu.yaml (the tiny CogVideoX, Ulysses 2 on two CPU ranks) renamed, its
    output on the chart's claim, with ``spec`` merged in."""
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["output"] = {"uri": f"pvc://{CLAIM}/videos/{name}"}
    for key, value in spec.items():
        if isinstance(value, dict) and isinstance(doc["spec"].get(key), dict):
            doc["spec"][key] = {**doc["spec"][key], **value}
        else:
            doc["spec"][key] = value
    return doc


class JobWatch:
    """Polls VideoJobs in a thread and keeps every (phase, message, condition reasons)
    they showed, so a test can assert on what a user saw while a job waited."""

    def __init__(self, release: Release, names: list[str], interval: float = 0.5):
        self.release, self.names, self.interval = release, names, interval
        self.seen: dict[str, list[tuple]] = {n: [] for n in names}
        self.times: dict[str, list[float]] = {n: [] for n in names}  # when each entry of seen was first seen
        # `kubectl get vj`, as a user saw it the first time one job ran while another queued
        self.table: str | None = None
        self.last: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "JobWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name in self.names:
                try:
                    obj = self.release.job(name)
                except Exception:  # noqa: BLE001 - not created yet, or a busy apiserver: look again
                    continue
                status = obj.get("status") or {}
                self.last[name] = obj
                key = (status.get("phase"), status.get("message"),
                       tuple(sorted((c.get("type"), c.get("status"), c.get("reason"), c.get("message"))
                                    for c in status.get("conditions") or [])))
                if not self.seen[name] or self.seen[name][-1] != key:
                    self.seen[name].append(key)
                    self.times[name].append(time.monotonic())
            phases = {(o.get("status") or {}).get("phase") for o in self.last.values()}
            if self.table is None and {"Running", "Queued"} <= phases:
                self.table = self.release.kubectl("get", "vj", "-n", self.release.namespace,
                                                  check=False).stdout
            self._stop.wait(self.interval)

    def texts(self, name: str) -> list[str]:
        """Every message and condition message the job showed, in order."""
        out = []
        for phase, message, conditions in self.seen[name]:
            out.append(f"{phase}: {message}")
            out.extend(f"  {t}={s} {r}: {m}" for t, s, r, m in conditions)
        return out

    def shown_for(self, name: str, text: str) -> float | None:
        """Seconds in all during which the job's status showed ``text`` (its message or a
        condition's), from each status that showed it to the next that did not; None if
        it never did."""
        entries = list(zip(self.seen[name], self.times[name])) + [(None, time.monotonic())]
        total, shown_at = None, None
        for key, at in entries:
            shown = key is not None and (text in (key[1] or "") or any(text in (m or "") for *_, m in key[2]))
            if shown and shown_at is None:
                shown_at = at
            elif not shown and shown_at is not None:
                total, shown_at = (total or 0.0) + at - shown_at, None
        return total

    def wait_finished(self, timeout: float) -> dict[str, dict]:
        def finished():
            done = {n: self.last.get(n) for n in self.names}
            if all(o and (o.get("status") or {}).get("phase") in ("Succeeded", "Failed", "Cancelled")
                   for o in done.values()):
                return done
            return None
        try:
            return wait_for(f"VideoJobs {self.names} to finish", finished, timeout=timeout, interval=1)
        except TimeoutError as exc:
            story = "\n".join(f"{n}:\n  " + "\n  ".join(self.texts(n)) for n in self.names)
            raise TimeoutError(f"{exc}\n{story}\npods now: {self.release.describe_pods()}") from None


# -- an https input server under a test CA -------------------------------------------------------

class HttpsInputs:
    """A threaded HTTPS server on ``host`` (an address the pods reach) with a certificate
    for it signed by a CA of the test's; ``routes`` maps paths to bytes."""

    def __init__(self, workdir: Path, host: str, routes: dict[str, bytes]):
        self.workdir, self.host, self.routes = workdir, host, routes
        self.requests: list[str] = []

    def __enter__(self) -> "HttpsInputs":
        d = self.workdir
        d.mkdir(parents=True, exist_ok=True)

        def openssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True)

        openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "1",
                "-subj", "/CN=videojob-e2e-test-ca", "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign")
        (d / "server.ext").write_text(f"subjectAltName=IP:{self.host}\nextendedKeyUsage=serverAuth\n")
        openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", str(d / "server.key"), "-out", str(d / "server.csr"), "-subj", "/CN=e2e-inputs")
        openssl("x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-days", "1", "-extfile", str(d / "server.ext"), "-out", str(d / "server.pem"))
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                outer.requests.append(self.path)
                body = outer.routes.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer((self.host, 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(d / "server.pem"), str(d / "server.key"))
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://{self.host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    @property
    def ca(self) -> Path:
        return self.workdir / "ca.pem"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of the given processes and all their descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rfind(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo, seen = 0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
        todo.extend(children.get(pid, []))
    return total


def make_data_dir(path: Path) -> Path:
    """The PersistentVolume's directory, owned by the runtime's user, as an admin prepares
    storage for pods that run as a non-root user (hostPath volumes get no fsGroup)."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    os.chown(path, RUNTIME_UID, RUNTIME_UID)
    path.chmod(0o775)
    return path


def wait_gone(what: str, probe, timeout: float) -> None:
    """Wait until ``probe()`` is empty; fail with what is left."""
    deadline = time.monotonic() + timeout
    left = probe()
    while left:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} to go; left: {left}")
        time.sleep(1)
        left = probe()
