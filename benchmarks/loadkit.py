"""Shared parts of the operator benchmarks (operator_load.py, operator_restart.py,
kueue_load.py, crd_write_cost.py): the loopback cluster, the operator run as a
subprocess with Ray replaced by ``fake_ray.InstantRay``, the jobs and a watch that
records each job's milestones, and the clean-up that leaves nothing behind."""

from __future__ import annotations

import concurrent.futures
import copy
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import REPO  # noqa: E402

LOCALCLUSTER = REPO / "hack" / "cluster" / "localcluster.py"
CRD_FILE = REPO / "crds" / "videojob.io_videojobs.yaml"
RBAC_RULES = REPO / "charts" / "videojob" / "files" / "operator-rbac-rules.yaml"
FAKE_OPERATOR = Path(__file__).resolve().parent / "fake_ray.py"
GROUP, VERSION, PLURAL = "videojob.io", "v1alpha1", "videojobs"
SERVICE_ACCOUNT = "videojob-operator"


# Real catalog models at their examples' sizes (the planner's real cost), mixed 70/30;
# per job: a priority, CogVideoX's maxGPUs (1, 2 or 4), and for half of them a pinned class.
EXAMPLES = (("cogvideox-5b-t2v.yaml", 0.7), ("wan2.1-t2v.yaml", 0.3))
# 48 GPUs in three classes: a few dozen jobs run at once, the rest queue.
INVENTORY = {
    "device": "cuda",
    "classResources": True,
    "classes": [
        {"name": "h100-80", "gpuMemory": "80Gi", "gpusPerPod": 8, "maxPods": 2, "hostMemory": "1Ti",
         "gpuType": "h100", "cost": 2.0},
        {"name": "a100-80", "gpuMemory": "80Gi", "gpusPerPod": 8, "maxPods": 2, "hostMemory": "1Ti",
         "gpuType": "a100", "cost": 1.0},
        {"name": "l40-48", "gpuMemory": "48Gi", "gpusPerPod": 4, "maxPods": 4, "hostMemory": "512Gi",
         "gpuType": "l40", "cost": 0.6},
    ],
}
QUEUED_OR_LATER = {"Queued", "Running", "Succeeded"}



def log(message: str) -> None:
    print(f"{Path(sys.argv[0]).stem}: {message}", file=sys.stderr, flush=True)


# -- the cluster ---------------------------------------------------------------


def localcluster(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LOCALCLUSTER), *args], capture_output=True, text=True,
                          timeout=timeout)


class Cluster:
    """The loopback cluster, held (``up --ephemeral --holder``) until ``release``."""

    def __init__(self):
        args = ["up", "--ephemeral", "--holder", str(os.getpid()), "--json"]
        if os.environ.get("VIDEOJOB_CLUSTER_NO_BUILD", "").strip() == "1":
            args.append("--no-build")
        res = localcluster(*args, timeout=float(os.environ.get("VIDEOJOB_CLUSTER_UP_TIMEOUT", "3600")))
        if res.returncode != 0:
            raise SystemExit(f"operator_load: the loopback cluster could not start:\n{res.stderr[-4000:]}")
        self.state = json.loads(res.stdout)
        self.kubeconfig = self.state["kubeconfig"]
        self.kubectl_bin = self.state["kubectl"]
        self.dir = self.state["cluster_dir"]
        log(f"cluster at {self.state['server']} ({'started' if self.state.get('started') else 'reused'})")

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args]
        res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[2:])} failed: {res.stderr.strip()[-2000:]}")
        return res

    def kubeconfig_for(self, namespace: str, out: Path) -> Path:
        res = localcluster("--cluster-dir", self.dir, "kubeconfig-for", "--namespace", namespace,
                           "--service-account", SERVICE_ACCOUNT, "--duration", "2h", "--out", str(out))
        if res.returncode != 0:
            raise RuntimeError(f"kubeconfig-for failed: {res.stderr[-2000:]}")
        return out

    def pid(self, component: str) -> int | None:
        return (self.state.get("pids") or {}).get(component)

    def release(self) -> None:
        localcluster("--cluster-dir", self.dir, "release", "--holder", str(os.getpid()))


def apiserver_requests(cluster: "Cluster") -> dict[str, float]:
    """apiserver_request_total for VideoJobs and Events, by verb/resource/subresource/code
    (the whole server's counters: other clients of the cluster count too)."""
    res = cluster.kubectl("get", "--raw", "/metrics", check=False, timeout=60)
    out: dict[str, float] = {}
    for line in res.stdout.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels_text, _, value = line.rpartition(" ")
        labels = dict(part.split("=", 1) for part in labels_text[len("apiserver_request_total{"):-1].split(",")
                      if "=" in part)
        labels = {k: v.strip('"') for k, v in labels.items()}
        if labels.get("resource") not in ("videojobs", "events"):
            continue
        key = " ".join(x for x in (labels.get("verb"), labels.get("resource") + (
            "/" + labels["subresource"] if labels.get("subresource") else ""), labels.get("code")) if x)
        out[key] = out.get(key, 0.0) + float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0}


def api_for(kubeconfig: str, pool: int):
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = pool
    return client.CustomObjectsApi(client.ApiClient(configuration))


def prepare_namespace(cluster: Cluster, namespace: str, workdir: Path) -> Path:
    """The CRD (applied, Established), a new namespace, and the operator's
    ServiceAccount bound to the chart's RBAC rules there; returns a kubeconfig
    that authenticates as that ServiceAccount (the operator's identity)."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/videojobs.videojob.io")
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": namespace, "labels": {"app.kubernetes.io/part-of": "videojob-benchmarks"}}}))
    rules = yaml.safe_load(RBAC_RULES.read_text())
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in (
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": SERVICE_ACCOUNT, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "videojob-operator", "namespace": namespace}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "videojob-operator", "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "videojob-operator"},
         "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}]})))
    return cluster.kubeconfig_for(namespace, workdir / "operator.kubeconfig")


# -- processes -----------------------------------------------------------------


def cpu_seconds(pid: int | None) -> float | None:
    """user + system CPU seconds of a process (/proc/<pid>/stat)."""
    if not pid:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the chart's operator container sets beyond the VIDEOJOB_ settings (deployment.yaml).
CHART_OPERATOR_ENV = {"MALLOC_ARENA_MAX": "2"}


class Operator:
    """``benchmarks/fake_ray.py`` as a subprocess in its own process group, with the
    chart's environment (``CHART_OPERATOR_ENV``)."""

    def __init__(self, namespace: str | list[str], kubeconfig: Path, workdir: Path, delay_s: float,
                 api_pool: int | None, extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None):
        namespaces = [namespace] if isinstance(namespace, str) else list(namespace)
        self.stats_path = workdir / "operator-stats.json"
        self.log_path = workdir / "operator.log"
        self.port = free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "VIDEOJOB_METRICS_PORT": str(self.port),
               "VIDEOJOB_INVENTORY_FILE": str(workdir / "inventory.yaml"), "VIDEOJOB_RAY_MODE": "address",
               "VIDEOJOB_RAY_DASHBOARD_URL": "http://instant-ray.invalid", "PYTHONUNBUFFERED": "1",
               **CHART_OPERATOR_ENV, **(extra_env or {})}
        env.pop("RAY_ADDRESS", None)
        (workdir / "inventory.yaml").write_text(yaml.safe_dump(INVENTORY, sort_keys=False))
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, str(FAKE_OPERATOR), *[a for ns in namespaces for a in ("--namespace", ns)],
             "--stats", str(self.stats_path),
             "--delay-s", str(delay_s), *(["--api-pool", str(api_pool)] if api_pool else []), *(extra_args or [])],
            env=env, cwd=str(REPO), stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.process.pid

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the operator exited {self.process.returncode}:\n{self.log()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the operator was not healthy after {timeout:.0f} s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stats(self) -> dict[str, Any]:
        try:
            return json.loads(self.stats_path.read_text())
        except (OSError, ValueError):
            return {}

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log("the operator did not stop within 30 s of SIGTERM; killing it")
                os.killpg(self.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self.log_file.close()


# -- the jobs ------------------------------------------------------------------


def manifests(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    bases = [(yaml.safe_load((REPO / "examples" / name).read_text()), weight) for name, weight in EXAMPLES]
    docs = []
    for i in range(count):
        base = rng.choices([b for b, _ in bases], weights=[w for _, w in bases])[0]
        doc = copy.deepcopy(base)
        name = f"load-{i:05d}"
        doc["metadata"] = {"name": name, "labels": {"videojob.io/benchmark": "operator-load"}}
        spec = doc["spec"]
        spec["seed"] = i
        resources = spec.setdefault("resources", {})
        resources["priority"] = rng.randint(-100, 100)
        if "parallel" not in spec:  # the planner picks the layout: vary how many GPUs it may use
            resources["maxGPUs"] = rng.choice([1, 2, 4])
        if rng.random() < 0.5:  # half the users pin a class; the planner picks for the others
            resources["gpuClass"] = rng.choice([c["name"] for c in INVENTORY["classes"]])
        spec["output"] = {"uri": f"pvc://videos/{name}"}
        docs.append(doc)
    return docs


def expected_classes(docs: list[dict[str, Any]]) -> dict[str, int]:
    """How many jobs the planner puts on each class (the operator's own planner, run here once)."""
    from collections import Counter

    from videojob.api import parse_videojob
    from videojob.inventory import parse_inventory
    from videojob.planner.classes import plan_classes

    inventory = parse_inventory(INVENTORY)
    counts: Counter[str] = Counter()
    for doc in docs:
        body = {**doc, "metadata": {**doc["metadata"], "namespace": "bench", "uid": "bench"}}
        choice = plan_classes(parse_videojob(body).spec, inventory)
        counts[f"{choice.klass.name} x{choice.chosen.layout.gpus}" if choice.chosen else "does not fit"] += 1
    return dict(sorted(counts.items()))


class Tracker:
    """Each job's milestones, from one list+watch of the namespace (times: time.monotonic())."""

    def __init__(self, api, namespace: str):
        self.api, self.namespace = api, namespace
        self.lock = threading.Lock()
        self.seen: dict[str, float] = {}
        self.finalized: dict[str, float] = {}
        self.first_status: dict[str, float] = {}
        self.planned: dict[str, float] = {}
        self.queued: dict[str, float] = {}
        self.running: dict[str, float] = {}
        self.succeeded: dict[str, float] = {}
        self.failed: dict[str, dict[str, Any]] = {}
        self.deleted: dict[str, float] = {}  # gone from the API server (its finalizers done)
        self.phases: dict[str, str] = {}
        self.modified = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self.listed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tracker", daemon=True)

    def start(self) -> "Tracker":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _observe(self, obj: dict[str, Any], kind: str) -> None:
        now = time.monotonic()
        name = obj["metadata"]["name"]
        status = obj.get("status") or {}
        phase = status.get("phase")
        with self.lock:
            if kind == "MODIFIED":
                self.modified += 1
            self.seen.setdefault(name, now)
            if "videojob.io/finalizer" in (obj["metadata"].get("finalizers") or []):
                self.finalized.setdefault(name, now)
            if phase:
                self.first_status.setdefault(name, now)
                self.phases[name] = phase
            if status.get("plan"):
                self.planned.setdefault(name, now)
                if phase in QUEUED_OR_LATER:
                    self.queued.setdefault(name, now)
            if phase == "Running":
                self.running.setdefault(name, now)
            elif phase == "Succeeded":
                self.succeeded.setdefault(name, now)
            elif phase in ("Failed", "Cancelled") and name not in self.failed:
                self.failed[name] = {"name": name, "phase": phase, "message": status.get("message", ""),
                                     "reason": next((c.get("reason") for c in status.get("conditions") or []
                                                     if c.get("status") == "False"), None)}

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.rest import ApiException

        rv = None
        while not self._stop.is_set():
            try:
                if rv is None:
                    listed = self.api.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
                    for obj in listed.get("items", []):
                        self._observe(obj, "LISTED")
                    rv = listed["metadata"]["resourceVersion"]
                    self.listed.set()
                w = watch.Watch()
                for event in w.stream(self.api.list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                                      PLURAL, resource_version=rv, timeout_seconds=20, allow_watch_bookmarks=True):
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        rv = None
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._observe(obj, event["type"])
                    elif event["type"] == "DELETED":
                        with self.lock:
                            self.deleted.setdefault(obj["metadata"]["name"], time.monotonic())
                    if self._stop.is_set():
                        w.stop()
                        break
            except ApiException as exc:
                if exc.status == 410:
                    rv = None
                    continue
                self.errors.append(f"watch: {exc.status} {exc.reason}")
                time.sleep(0.5)
            except Exception as exc:  # noqa: BLE001 - a dropped stream: re-watch from the last version
                self.errors.append(f"watch: {type(exc).__name__}: {exc}"[:300])
                time.sleep(0.5)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"seen": len(self.seen), "finalizer": len(self.finalized), "status": len(self.first_status),
                    "planned": len(self.planned), "queued": len(self.queued), "succeeded": len(self.succeeded),
                    "failed": len(self.failed), "deleted": len(self.deleted)}


def send_all(api, namespace: str, method: str, requests: list[tuple[str, str, dict[str, Any]]], threads: int,
             content_type: str = "application/json", accept: tuple[int, ...] = (200, 201)) -> dict[str, float]:
    """Send each (name, path under the namespace's VideoJobs, JSON body), ``threads`` at
    once, retrying dropped connections, 429 and 5xx; returns name -> when its answer came.

    Through the client's own connection pool (its TLS and credentials), without the
    generated API wrappers: their argument validation and response decoding cost the
    sending process more CPU than the API server spends on the request, CPU the
    operator under test shares on this machine."""
    client = api.api_client
    cfg = client.configuration
    base = f"{cfg.host}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    headers = {"Content-Type": content_type, "Accept": "application/json"}
    token = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    if token:
        headers["Authorization"] = token if token.lower().startswith("bearer ") else f"Bearer {token}"
    pool = client.rest_client.pool_manager
    done: dict[str, float] = {}

    def send(request: tuple[str, str, dict[str, Any]]) -> None:
        name, path, doc = request
        body = json.dumps(doc).encode()
        for attempt in range(5):
            try:
                reply = pool.request(method, base + path, body=body, headers=headers, timeout=60, retries=False)
                status, text = reply.status, reply.data[:500]
            except Exception as exc:  # noqa: BLE001 - a dropped connection: retried like a 503
                status, text = 503, repr(exc).encode()
            if status in accept:
                done[name] = time.monotonic()
                return
            if attempt == 4 or (400 <= status < 500 and status != 429):
                raise RuntimeError(f"{method} {name}{path}: HTTP {status}: {text!r}")
            time.sleep(0.2 * (attempt + 1))

    with concurrent.futures.ThreadPoolExecutor(threads) as executor:
        for future in [executor.submit(send, request) for request in requests]:
            future.result()
    return done


def create_all(api, namespace: str, docs: list[dict[str, Any]], threads: int) -> dict[str, float]:
    """Create every job (``threads`` at once); returns name -> when its create returned
    (409: an earlier try's create landed)."""
    return send_all(api, namespace, "POST", [(d["metadata"]["name"], "", d) for d in docs], threads,
                    accept=(200, 201, 409))


def percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def q(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * (len(ordered) - 1) + 0.5))], 3)

    return {"p50": q(0.5), "p90": q(0.9), "max": round(ordered[-1], 3), "mean": round(statistics.mean(values), 3)}


def latency(created: dict[str, float], milestone: dict[str, float]) -> dict[str, float] | None:
    return percentiles([milestone[n] - created[n] for n in milestone if n in created])


# -- the run -------------------------------------------------------------------


def wait_until(what: str, check, deadline: float, on_tick=None, interval: float = 0.25) -> bool:
    """Poll ``check`` until it is true (True) or ``deadline`` (monotonic) passes (False, with a message)."""
    while True:
        if on_tick is not None:
            on_tick()
        if check():
            return True
        if time.monotonic() > deadline:
            log(f"gave up waiting for {what}")
            return False
        time.sleep(interval)


def remaining_jobs(admin, namespace: str) -> list[dict[str, Any]] | None:
    """The jobs left in the namespace; None when the API server did not answer."""
    try:
        return admin.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL).get("items", [])
    except Exception as exc:  # noqa: BLE001 - a busy server: the caller tries again
        if getattr(exc, "status", None) == 404:
            return []
        log(f"listing the jobs left failed: {exc}"[:300])
        return None


def delete_jobs(admin, namespace: str, names: list[str], threads: int = 8) -> None:
    """DELETE each job (``threads`` at once; one DELETE of the collection can outlast the
    API server's 60 s request timeout when it is busy). The operator's finalizer then lets them go."""
    def delete(name: str) -> None:
        for attempt in range(5):
            try:
                admin.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
                return
            except Exception as exc:  # noqa: BLE001 - 404: gone already; 429/5xx: a busy server, retried
                status = getattr(exc, "status", None)
                if status == 404:
                    return
                if attempt == 4 or (status is not None and 400 <= status < 500 and status != 429):
                    log(f"could not delete {name}: {exc}"[:300])
                    return
                time.sleep(0.5 * (attempt + 1))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(delete, names))


FINALIZE_AT_END = 2000  # jobs left at the end that the operator finalizes; more, in a cluster of the run's own, go with it


def cleanup(cluster: Cluster, admin, namespace: str, operator: Operator | None) -> None:
    """No job, namespace or process left behind, whatever happened before (each step
    runs even when an earlier one failed)."""
    goes_with_cluster = False
    try:
        remaining = remaining_jobs(admin, namespace) or []
        if len(remaining) > FINALIZE_AT_END and cluster.state.get("started"):
            # The cluster is this run's (its last holder stops it, its etcd data deleted):
            # finalizing 30,000 jobs at ~14 a second would take longer than the run.
            log(f"{len(remaining)} job(s) left in this run's own cluster: they go with it")
            goes_with_cluster, remaining = True, []
        if remaining and operator is not None and operator.alive():
            log(f"deleting the {len(remaining)} job(s) left while the operator runs")
            delete_jobs(admin, namespace, [o["metadata"]["name"] for o in remaining])
            wait_until("the operator to finalize the jobs left", lambda: remaining_jobs(admin, namespace) == [],
                       time.monotonic() + 120, interval=2.0)
    except Exception as exc:  # noqa: BLE001
        log(f"deleting the jobs failed: {exc}"[:500])
    finally:
        try:
            if operator is not None:
                operator.stop()
        except Exception as exc:  # noqa: BLE001
            log(f"stopping the operator failed: {exc}")
            if operator.process.poll() is None:
                os.killpg(operator.pid, signal.SIGKILL)
        if not goes_with_cluster:
            try:  # whatever is left has no operator to finalize it: drop the finalizers
                remaining = [o for o in remaining_jobs(admin, namespace) or [] if o["metadata"].get("finalizers")]
                if remaining:
                    log(f"removing the finalizers of {len(remaining)} job(s) left")
                    with concurrent.futures.ThreadPoolExecutor(8) as pool:
                        list(pool.map(lambda o: _drop_finalizers(admin, namespace, o["metadata"]["name"]), remaining))
            except Exception as exc:  # noqa: BLE001
                log(f"removing finalizers failed: {exc}"[:500])
            try:
                cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=true", "--timeout=180s",
                                check=False, timeout=200)
                if cluster.kubectl("get", "namespace", namespace, check=False).returncode == 0:
                    log(f"namespace {namespace} is still terminating")
            except Exception as exc:  # noqa: BLE001
                log(f"deleting namespace {namespace} failed: {exc}")


def _drop_finalizers(admin, namespace: str, name: str) -> None:
    try:
        admin.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                             {"metadata": {"finalizers": None}})
    except Exception as exc:  # noqa: BLE001 - gone meanwhile
        if getattr(exc, "status", None) != 404:
            log(f"could not remove the finalizers of {name}: {exc}")


def finish(cluster: Cluster, admin, namespace: str, operator: Operator | None, tracker: Tracker | None) -> None:
    """The end of every run, whatever happened: the watch stopped, nothing left behind
    (``cleanup``), the cluster released."""
    if tracker is not None:
        tracker.stop()
    try:
        cleanup(cluster, admin, namespace, operator)
    finally:
        cluster.release()
