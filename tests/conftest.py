"""Shared pytest fixtures: a real kube-apiserver + etcd + kube-controller-manager
on loopback (hack/cluster/localcluster.py), and a fresh namespace per test.

kube_cluster   session scope. Reuses a running cluster (`make cluster-up`) or
               starts one, building the binaries first if needed (cold build
               ~15-25 min; VIDEOJOB_CLUSTER_NO_BUILD=1 disables building). A
               cluster started here is stopped when the last test session using
               it ends; one started with `make cluster-up` is left running.
               When it cannot start, tests that use it are skipped, or FAIL
               when CI=true or VIDEOJOB_REQUIRE_CLUSTER=1.
namespace      function scope. Creates `vj-test-<random>` and deletes it
               afterwards without waiting for the deletion to finish.
full_cluster   session scope. The full cluster (`localcluster.py up --full`:
               kube-scheduler, KWOK fake nodes from hack/cluster/fake-nodes.yaml,
               the KubeRay operator and its CRDs) in its own cluster dir,
               $VIDEOJOB_FULL_CLUSTER_DIR or <repo>/.cluster-full, so it never
               touches the default cluster. A FullCluster (a KubeCluster plus
               tool_bin_dirs, fake_nodes, kuberay_version); stopped at the end
               unless it was started by hand (`make cluster-full-up`). Skips or
               fails like kube_cluster.
e2e_cluster    session scope. The full cluster whose pods really run
               (`localcluster.py up --full --pod-runner`: kube-scheduler, the
               KubeRay operator and the pod runner, hack/cluster/podrunner, with
               the nodes of hack/cluster/runner-nodes.yaml) in its own cluster dir,
               $VIDEOJOB_E2E_CLUSTER_DIR or <repo>/.cluster-e2e. Needs root. An
               E2ECluster; skips or fails like kube_cluster.
kueue          session scope. Kueue's controller manager (tools/kueue, built by
               build-gotool.sh unless VIDEOJOB_CLUSTER_NO_BUILD=1) on kube_cluster
               with its CRDs and webhooks (hack/cluster/lc/kueue.py); an
               lc.kueue.Kueue. Skips or fails like kube_cluster.
full_namespace function scope. A fresh namespace in full_cluster; deleted
               afterwards, waiting (60 s at most) until it is gone, so the next
               test finds the fake nodes' GPUs free.
full_namespaces function scope. A factory: each call makes one more fresh
               namespace in full_cluster; all are deleted afterwards together,
               waiting as full_namespace does.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

# The suite's timings, the shared Ray head, services stopped after their last user (tests/suite_timings.py, shared_ray.py, resource_order.py).
pytest_plugins = ["suite_timings", "shared_ray", "resource_order", "streams"]

REPO = Path(__file__).resolve().parents[1]
LOCALCLUSTER = REPO / "hack" / "cluster" / "localcluster.py"
# Covers a cold build of the binaries (build-tools.sh) plus start-up.
UP_TIMEOUT_S = float(os.environ.get("VIDEOJOB_CLUSTER_UP_TIMEOUT", "3600"))
FULL_CLUSTER_DIR = Path(os.environ.get("VIDEOJOB_FULL_CLUSTER_DIR") or REPO / ".cluster-full")
E2E_CLUSTER_DIR = Path(os.environ.get("VIDEOJOB_E2E_CLUSTER_DIR") or REPO / ".cluster-e2e")


def _cluster_required() -> bool:
    from helpers import cluster_required  # one rule for fixtures and require_module

    return cluster_required()


class KubectlError(subprocess.CalledProcessError):
    """CalledProcessError whose message shows kubectl's output."""

    def __str__(self) -> str:
        return (f"{super().__str__()}\n--- stdout ---\n{self.stdout or ''}"
                f"\n--- stderr ---\n{self.stderr or ''}")


class Kubectl(str):
    """Path of the kubectl binary (a str, usable in argv and os.fspath) that can
    also be called: ``cluster.kubectl("get", "ns")`` runs it with the admin
    kubeconfig."""

    _cluster: KubeCluster

    def __new__(cls, path: str, cluster: KubeCluster):
        obj = super().__new__(cls, path)
        obj._cluster = cluster
        return obj

    def __fspath__(self) -> str:
        return str.__str__(self)

    def __call__(self, *args: str, check: bool = True, input: str | None = None,
                 kubeconfig: str | os.PathLike | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess:
        cfg = os.fspath(kubeconfig or self._cluster.kubeconfig)
        argv = [os.fspath(self), f"--kubeconfig={cfg}", *map(str, args)]
        res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise KubectlError(res.returncode, argv, res.stdout, res.stderr)
        return res


# kubectl's names for the kinds tests read -> (API group path, plural, namespaced)
REST_KINDS = {
    **{k: ("/api/v1", "pods", True) for k in ("pod", "pods", "po")},
    **{k: ("/api/v1", "nodes", False) for k in ("node", "nodes")},
    **{k: ("/api/v1", "configmaps", True) for k in ("configmap", "configmaps", "cm")},
    **{k: ("/api/v1", "secrets", True) for k in ("secret", "secrets")},
    **{k: ("/api/v1", "services", True) for k in ("service", "services", "svc")},
    **{k: ("/api/v1", "serviceaccounts", True) for k in ("serviceaccount", "serviceaccounts", "sa")},
    **{k: ("/api/v1", "persistentvolumeclaims", True) for k in ("pvc", "persistentvolumeclaim")},
    **{k: ("/api/v1", "events", True) for k in ("event", "events")},
    **{k: ("/apis/apps/v1", "deployments", True) for k in ("deployment", "deployments", "deploy")},
    **{k: ("/apis/rbac.authorization.k8s.io/v1", "roles", True) for k in ("role", "roles")},
    **{k: ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True) for k in ("rolebinding", "rolebindings")},
    **{k: ("/apis/networking.k8s.io/v1", "networkpolicies", True) for k in ("networkpolicy", "networkpolicies")},
    **{k: ("/apis/apiextensions.k8s.io/v1", "customresourcedefinitions", False) for k in ("crd", "crds")},
    **{k: ("/apis/ray.io/v1", "rayclusters", True) for k in ("raycluster", "rayclusters")},
    **{k: ("/apis/videojob.io/v1alpha1", "videojobs", True) for k in ("vj", "videojob", "videojobs")},
    **{k: ("/apis/kueue.x-k8s.io/v1beta2", "workloads", True) for k in ("workloads.kueue.x-k8s.io",)},
    **{k: ("/apis/kueue.x-k8s.io/v1beta2", "clusterqueues", False) for k in ("clusterqueues.kueue.x-k8s.io",)},
}


def _without_nulls(value):
    """``value`` with every null-valued key dropped (a new CRD's status says "conditions":
    null until the API server has looked at it; a caller's ``.get("conditions", [])`` then
    got None)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def rest_path(args: tuple[str, ...]) -> str | None:
    """The REST path `kubectl get ARGS` reads, for KIND[/NAME] [NAME] [-n NS] [-l SEL]
    [--field-selector=SEL]; None for anything else (kubectl then runs)."""
    from urllib.parse import quote, urlencode

    words, namespace, query = list(args), None, {}
    kind, name = (words.pop(0).split("/", 1) + [None])[:2] if words else (None, None)
    while words:
        word = words.pop(0)
        if word in ("-n", "--namespace") and words:
            namespace = words.pop(0)
        elif word in ("-l", "--selector") and words:
            query["labelSelector"] = words.pop(0)
        elif word.startswith("--field-selector="):
            query["fieldSelector"] = word.split("=", 1)[1]
        elif not word.startswith("-") and name is None:
            name = word
        else:
            return None
    if kind not in REST_KINDS or (name and query):
        return None
    base, plural, namespaced = REST_KINDS[kind]
    if namespaced != (namespace is not None):
        return None
    path = f"{base}/namespaces/{quote(namespace)}/{plural}" if namespaced else f"{base}/{plural}"
    if name:
        path += f"/{quote(name)}"
    return path + (f"?{urlencode(query)}" if query else "")


class ApiClient:
    """Requests to the API server over one kept-alive TLS connection per thread, as the
    admin: tests poll an object's status (and make namespaces) without forking kubectl (a fork costs
    ~0.1 s of a core, which the job under test needs on a 2-core machine)."""

    def __init__(self, server: str, pki: Path, timeout: float = 30):
        import ssl
        import threading
        from urllib.parse import urlsplit

        where = urlsplit(server)
        self._host, self._port, self._timeout = where.hostname, where.port or 443, timeout
        self._tls = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self._tls.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self._local = threading.local()

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict | None]:
        """(HTTP status, the JSON answer) of ``method`` on ``path`` (``/api/...``, ``/apis/...``)."""
        import http.client

        data = json.dumps(body).encode() if body is not None else None
        headers = {"Accept": "application/json", **({"Content-Type": "application/json"} if data else {})}
        while True:
            conn = getattr(self._local, "conn", None)
            kept = conn is not None
            if conn is None:
                conn = self._local.conn = http.client.HTTPSConnection(
                    self._host, self._port, context=self._tls, timeout=self._timeout)
            try:
                conn.request(method, path, body=data, headers=headers)
                response = conn.getresponse()
                answer = response.read()
                break
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                # A kept-alive connection the server closed while idle: once more on a new
                # one (a POST that did arrive then answers 409, which its caller reads).
                if not kept:
                    raise
        try:
            return response.status, json.loads(answer) if answer else None
        except ValueError:
            return response.status, {"raw": answer[:1000].decode(errors="replace")}

    def get(self, path: str) -> dict | None:
        """The object at ``path``, or None when the API server says 404."""
        status, obj = self.request("GET", path)
        if status == 404:
            return None
        if status != 200:
            raise RuntimeError(f"GET {path}: HTTP {status}: {obj}")
        return obj


class KubeCluster:
    """Handle on the loopback cluster.

    kubeconfig  Path of the admin kubeconfig (system:masters)
    kubectl     path of kubectl (str); call it to run kubectl with that kubeconfig:
                kubectl(*args, check=True, input=None, kubeconfig=None, timeout=120)
    bin_dir     Path with kubectl, kube-apiserver, kube-controller-manager, etcd
    server      https://127.0.0.1:<port>
    api         an ApiClient: ``api.get("/apis/...")``, ``api.request(...)`` without forking kubectl (for polling)
    """

    def __init__(self, state: dict):
        self.state = state
        self.kubeconfig = Path(state["kubeconfig"])
        self.bin_dir = Path(state["bin_dir"])
        self.server: str = state["server"]
        self.cluster_dir = Path(state["cluster_dir"])
        self.ca_file = self.cluster_dir / "pki" / "ca.crt"
        self.kubectl = Kubectl(str(self.bin_dir / "kubectl"), self)
        self._api: ApiClient | None = None

    @property
    def api(self) -> ApiClient:
        if self._api is None:
            self._api = ApiClient(self.server, self.cluster_dir / "pki")
        return self._api

    def get_json(self, *args: str, **kwargs) -> dict:
        """`kubectl get ARGS -o json`, parsed. The plain forms (one kind, a name or a label or
        field selector, one namespace) are read over the kept-alive client instead: tests poll
        with them, and a kubectl fork costs a core ~0.1 s that the job under test needs."""
        path = None if kwargs else rest_path(args)
        if path is None:
            return json.loads(self.kubectl("get", *args, "-o", "json", **kwargs).stdout)
        obj = self.api.get(path)
        if obj is None:
            raise LookupError(f"kubectl get {' '.join(args)}: not found ({path})")
        obj = _without_nulls(obj)   # as callers read kubectl's output: `.get(key, default)` on a null
        if "items" in obj:   # as kubectl shows a list: each item says its kind
            kind = obj.get("kind", "")[:-len("List")]
            for item in obj["items"]:
                item.setdefault("apiVersion", obj.get("apiVersion"))
                item.setdefault("kind", kind)
        return obj

    def env(self, kubeconfig: str | os.PathLike | None = None) -> dict[str, str]:
        """os.environ with KUBECONFIG set (admin unless given) and kubectl on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = os.fspath(kubeconfig or self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def install_crd(self, timeout: float = 60) -> None:
        """Server-side apply crds/ and wait until the VideoJob CRD is Established and
        kubectl resolves `vj`. A CRD read before the API server has set its status has
        no conditions, and `kubectl wait` then errors at once instead of waiting
        (seen in CI), so this reads the conditions itself until the deadline."""
        import time

        from videojob.crd import CRD_FILE, CRD_NAME

        self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / CRD_FILE))
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            res = self.kubectl("get", f"crd/{CRD_NAME}", "-o", "json", check=False)
            if res.returncode == 0:
                conditions = json.loads(res.stdout).get("status", {}).get("conditions") or []
                last = f"conditions {conditions!r}"
                if any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions) \
                        and self.kubectl("get", "vj", "-A", check=False).returncode == 0:
                    return
            else:
                last = res.stderr.strip()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the CRD {CRD_NAME} was not Established and served as `vj` "
                                   f"within {timeout:.0f} s; last: {last}")
            time.sleep(0.2)

    def _localcluster(self, *args: str) -> str:
        res = subprocess.run([sys.executable, str(LOCALCLUSTER), "--cluster-dir",
                              str(self.cluster_dir), *args],
                             capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"localcluster.py {' '.join(args)} failed ({res.returncode}):\n"
                               f"{res.stderr}")
        return res.stdout.strip()

    def token(self, namespace: str, service_account: str, duration: str = "1h") -> str:
        """A bearer token for the ServiceAccount (created, with its namespace, if missing)."""
        return self._localcluster("token", "--namespace", namespace, "--service-account",
                                  service_account, "--duration", duration)

    def kubeconfig_for(self, namespace: str, service_account: str,
                       out: str | os.PathLike, duration: str = "1h") -> Path:
        """Write a kubeconfig that authenticates as the ServiceAccount; returns its path."""
        self._localcluster("kubeconfig-for", "--namespace", namespace, "--service-account",
                           service_account, "--duration", duration, "--out", os.fspath(out))
        return Path(out)


class FullCluster(KubeCluster):
    """The full cluster (`localcluster.py up --full`): a KubeCluster (bin_dir also
    holds kube-scheduler) plus

    tool_bin_dirs    {"kwok": Path, "kuberay": Path}: the kwok and kuberay-operator binaries
    fake_nodes       names of the fake nodes (hack/cluster/fake-nodes.yaml)
    kuberay_version  the KubeRay operator version running (its CRDs are applied)
    state            the whole state.json dict (ports, pids, exes, kubeconfigs, ...)
    """

    def __init__(self, state: dict):
        super().__init__(state)
        self.tool_bin_dirs = {k: Path(v) for k, v in state["tool_bin_dirs"].items()}
        self.fake_nodes: list[str] = list(state["fake_nodes"])
        self.kuberay_version: str = state["kuberay"]["version"]


class E2ECluster(KubeCluster):
    """The full cluster with the pod runner (`localcluster.py up --full --pod-runner`):

    kuberay_version  the KubeRay operator version running
    runner           the pod runner's facts: state_dir, pod_cidr, image_map, nodes_file, venv
    runner_state()   its state file (<state_dir>/runner.json): the pods it runs, their
                     addresses, processes and logs
    """

    def __init__(self, state: dict):
        super().__init__(state)
        self.kuberay_version: str = state["kuberay"]["version"]
        self.runner: dict = dict(state["pod_runner"])

    def runner_state(self) -> dict:
        path = Path(self.runner["state_dir"]) / "runner.json"
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {}


def pytest_runtest_makereport(item, call):
    """`incremental` modules: remember the first failed step."""
    if "incremental" in item.keywords and call.excinfo is not None and call.when == "call":
        item.parent._failed_step = getattr(item.parent, "_failed_step", None) or item.name


def pytest_runtest_setup(item):
    """`incremental` modules: a step after a failed one fails at once, naming it (rather
    than waiting out its own timeouts on a cluster the failed step left half-made)."""
    failed = getattr(item.parent, "_failed_step", None) if "incremental" in item.keywords else None
    if failed:
        pytest.fail(f"an earlier step of this module failed: {failed}", pytrace=False)


def pytest_collection_modifyitems(config, items):
    """Tests that use the cluster (directly or through `namespace`) get the
    `cluster` marker, so `-m "not cluster"` deselects them even when unmarked."""
    registered = any(line.split(":")[0].strip() == "cluster"
                     for line in config.getini("markers"))
    if not registered:
        return
    for item in items:
        if {"kube_cluster", "full_cluster", "e2e_cluster"} & set(getattr(item, "fixturenames", ())):
            item.add_marker("cluster")


def _cluster_up(extra: list[str], what: str = "the loopback Kubernetes cluster") -> dict:
    """`localcluster.py [extra...] up --ephemeral --holder <this pid> --json`; the
    state dict, or skip (fail when the cluster is required) with the reason."""
    args = [sys.executable, str(LOCALCLUSTER), *extra, "--ephemeral", "--holder",
            str(os.getpid()), "--json"]
    if os.environ.get("VIDEOJOB_CLUSTER_NO_BUILD", "").strip() == "1":
        args.append("--no-build")
    problem = None
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=UP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = f"{' '.join(args)}: {exc}"
    else:
        if res.returncode != 0:
            err = "\n".join(res.stderr.splitlines()[-60:])
            problem = f"`{' '.join(args[1:])}` exited with {res.returncode}:\n{err}"
    if problem:
        msg = f"{what} could not start: {problem}"
        if _cluster_required():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    return json.loads(res.stdout)


def _cluster_release(state: dict) -> None:
    """Stops the cluster only if it was started by a test session (--ephemeral)
    and no other live session holds it."""
    subprocess.run([sys.executable, str(LOCALCLUSTER), "--cluster-dir", state["cluster_dir"],
                    "release", "--holder", str(os.getpid())], timeout=120, check=False)


@pytest.fixture(scope="session")
def kube_cluster():
    state = _cluster_up(["up"])
    try:
        yield KubeCluster(state)
    finally:
        _cluster_release(state)


@pytest.fixture(scope="session")
def full_cluster():
    """The full cluster in its own dir (see the module docstring)."""
    state = _cluster_up(["--cluster-dir", str(FULL_CLUSTER_DIR), "up", "--full"],
                        "the full loopback cluster (scheduler, KWOK, KubeRay)")
    try:
        yield FullCluster(state)
    finally:
        _cluster_release(state)


@pytest.fixture(scope="session")
def e2e_cluster():
    """The full cluster with the pod runner, in its own dir (see the module docstring)."""
    state = _cluster_up(["--cluster-dir", str(E2E_CLUSTER_DIR), "up", "--full", "--pod-runner"],
                        "the loopback cluster with the pod runner (scheduler, KubeRay, pods as processes)")
    try:
        yield E2ECluster(state)
    finally:
        _cluster_release(state)


@pytest.fixture(scope="session")
def kueue(kube_cluster: KubeCluster, tmp_path_factory):
    """Kueue's real controller manager on kube_cluster, its CRDs applied and webhooks
    served (hack/cluster/lc/kueue.py); stopped, webhook configurations deleted, at the
    session's end. Skips or fails like kube_cluster; tests/kueue_helpers.py makes objects."""
    from kueue_helpers import start_kueue

    running = start_kueue(kube_cluster, tmp_path_factory.mktemp("kueue"))
    try:
        yield running
    finally:
        running.stop()


def _new_namespace(cluster: KubeCluster) -> str:
    name = f"vj-test-{secrets.token_hex(4)}"
    manifest = {"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name,
                             "labels": {"app.kubernetes.io/part-of": "videojob-tests"}}}
    status, answer = cluster.api.request("POST", "/api/v1/namespaces", manifest)
    if status == 409 and cluster.api.get(f"/api/v1/namespaces/{name}"):  # sent twice (ApiClient.request)
        status = 201
    if status != 201:
        raise RuntimeError(f"creating namespace {name}: HTTP {status}: {answer}")
    return name


@pytest.fixture
def full_namespaces(full_cluster: FullCluster):
    """A factory of fresh namespaces in the full cluster; all are deleted afterwards,
    waiting until they are gone."""
    names: list[str] = []

    def make() -> str:
        names.append(_new_namespace(full_cluster))
        return names[-1]

    yield make
    if names:
        # kubectl's own deadline; a namespace still terminating after it fails the
        # teardown with kubectl's message (what it waited for).
        full_cluster.kubectl("delete", "namespace", *names, "--ignore-not-found", "--wait=true",
                             "--timeout=60s", timeout=90)


@pytest.fixture
def full_namespace(full_namespaces) -> str:
    """A fresh namespace in the full cluster; deleted afterwards, waiting until it is gone."""
    return full_namespaces()


@pytest.fixture
def namespace(kube_cluster: KubeCluster):
    """A fresh namespace `vj-test-<random>`; deleted (without waiting) after the test."""
    name = _new_namespace(kube_cluster)
    yield name
    kube_cluster.api.request("DELETE", f"/api/v1/namespaces/{name}")  # not waited for; a 404 is fine


@pytest.fixture(scope="session")
def ray_session():
    """One embedded local Ray for every runtime test (its own temp dir and token:
    nothing on the machine is attached to, and nothing is left behind)."""
    from helpers import require_module

    require_module("ray")
    from videojob_runtime.local import embedded_ray

    with embedded_ray(num_cpus=2) as info:
        yield info


@pytest.fixture(scope="session")
def face_inputs(tmp_path_factory):
    """A 64x64 image with precomputed ConsisID face embeddings beside it
    (``<image>.npz``: no face models needed); also serves as an i2v image."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    image = root / "face.png"
    Image.fromarray((rng.random((64, 64, 3)) * 255).astype("uint8")).save(image)
    np.savez(str(image) + ".npz", id_cond=rng.standard_normal((1, 16)).astype("float32"),
             id_vit_hidden_0=rng.standard_normal((1, 5, 32)).astype("float32"),
             id_vit_hidden_1=rng.standard_normal((1, 5, 32)).astype("float32"))
    return image
