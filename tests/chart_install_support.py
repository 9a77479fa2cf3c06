"""Shared by tests/test_chart_install*.py, the chart installed on the full loopback
cluster (DESIGN.md "Testing layers", 5): the chart's paths and the README's GPU example,
the fixtures helm and service_monitor_crd (module scope) and volumes, and helpers to
render, install, wait for pods and scale worker groups as Ray's autoscaler does.

A test module imports the fixtures it uses (and so gets its own module-scoped ones)."""
from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from helpers import REPO, helm_binary, running_ready, wait_for


CHART = REPO / "charts" / "videojob"
GPU_VALUES = CHART / "ci" / "kuberay-gpu.yaml"
TOKEN_SECRET = yaml.safe_load(GPU_VALUES.read_text())["ray"]["auth"]["existingSecret"]
DRIVERS = "drivers"  # the drivers' worker group (raycluster.yaml)
EMBEDDED_VALUES = CHART / "ci" / "embedded.yaml"
GPU_CLASSES = {c["name"]: c for c in yaml.safe_load(GPU_VALUES.read_text())["gpuClasses"]}
RELEASE = "videojob"  # the README's release name: objects are `videojob`, `videojob-ray`, ...
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"
HELM_TIMEOUT_S = 120
SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"


@pytest.fixture(scope="module")
def helm(full_cluster, tmp_path_factory):
    """helm against the full cluster: helm(*args, check=True) -> CompletedProcess."""
    binary = helm_binary()
    home = tmp_path_factory.mktemp("helm-home")  # helm's config, cache and data stay here
    env = {**os.environ, "KUBECONFIG": str(full_cluster.kubeconfig), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_DATA_HOME": str(home / "data")}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([binary, *args], capture_output=True, text=True, env=env, cwd=REPO,
                                timeout=HELM_TIMEOUT_S)
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}")
        return result

    return run


@pytest.fixture(scope="module")
def service_monitor_crd(full_cluster):
    """The ServiceMonitor kind (monitoring.coreos.com/v1), as the Prometheus Operator would
    serve it: an open-schema stand-in, only while this module runs and only if missing."""
    if full_cluster.kubectl("get", "crd", SERVICE_MONITOR_CRD, check=False).returncode == 0:
        yield
        return
    names = {"kind": "ServiceMonitor", "listKind": "ServiceMonitorList", "plural": "servicemonitors",
             "singular": "servicemonitor"}
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": SERVICE_MONITOR_CRD, "labels": {"app.kubernetes.io/part-of": "videojob-tests"}},
           "spec": {"group": "monitoring.coreos.com", "names": names, "scope": "Namespaced",
                    "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
    full_cluster.kubectl("create", "-f", "-", input=json.dumps(crd))
    try:
        wait_established(full_cluster, SERVICE_MONITOR_CRD)
        yield
    finally:
        full_cluster.kubectl("delete", "crd", SERVICE_MONITOR_CRD, "--wait=true", "--timeout=60s", timeout=90)


@pytest.fixture
def volumes(full_cluster):
    """volumes(claim_doc): a PersistentVolume pre-bound to the rendered claim, with its size
    and access modes (never mounted: no kubelet). All are deleted afterwards, waiting; ask
    for this fixture before full_namespaces, so the claims' namespaces go first."""
    made: list[str] = []

    def make(claim: dict) -> str:
        meta = claim["metadata"]
        name = f"{meta['namespace']}-{meta['name']}"
        full_cluster.kubectl("create", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "videojob-tests"}},
            "spec": {"capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
                     "accessModes": claim["spec"]["accessModes"], "persistentVolumeReclaimPolicy": "Retain",
                     "hostPath": {"path": f"/nonexistent/{name}"},
                     "claimRef": {"namespace": meta["namespace"], "name": meta["name"]}}}))
        made.append(name)
        return name

    yield make
    if made:
        full_cluster.kubectl("delete", "pv", *made, "--ignore-not-found", "--wait=true", "--timeout=60s", timeout=90)


def wait_established(cluster, crd: str) -> None:
    def established():
        conditions = (cluster.get_json("crd", crd).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    wait_for(f"the CRD {crd} to be Established", established, timeout=60, interval=0.5)


def gpu_args(*namespaces: str) -> list[str]:
    """The README's install of the GPU example, watching the test's namespaces."""
    return ["-f", str(GPU_VALUES), "--set", f"watch.namespaces={{{','.join(namespaces)}}}"]


def rendered(helm, namespace: str, args: list[str]) -> list[dict]:
    out = helm("template", RELEASE, str(CHART), "--namespace", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def ray_token(cluster, namespace: str) -> None:
    """The Secret with Ray's token that ci/kuberay-gpu.yaml names, as the README makes it."""
    cluster.kubectl("create", "secret", "generic", TOKEN_SECRET, "-n", namespace,
                    f"--from-literal=token={os.urandom(16).hex()}")


@contextmanager
def installed(helm, namespace: str, args: list[str], chart: Path = CHART):
    """`helm install` for real; `helm uninstall` afterwards however the test went (a
    no-op when the test uninstalled it)."""
    helm("install", RELEASE, str(chart), "--namespace", namespace, *args)
    try:
        yield
    finally:
        helm("uninstall", RELEASE, "--namespace", namespace, "--ignore-not-found", "--wait", "--timeout=60s")


def pods(cluster, namespace: str, selector: str) -> list[dict]:
    return cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]


def unschedulable(pod: dict) -> str | None:
    """kube-scheduler's message when it found no node for the pod, else None."""
    for c in pod.get("status", {}).get("conditions", []):
        if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable":
            return c.get("message", "")
    return None


def wait_pods(cluster, namespace: str, selector: str, running: int, stuck: int = 0,
              timeout: float = 120) -> tuple[list[dict], list[dict]]:
    """Wait until the pods of ``selector`` are exactly ``running`` Running/Ready and ``stuck``
    Unschedulable ones; returns (running pods, unschedulable pods). On timeout the error
    names what the cluster held: each pod's phase, node and scheduler message, the
    RayClusters' states and the namespace's Warning events (CI once saw no head pod
    within 60 s with nothing else to go on)."""
    def settled():
        ps = pods(cluster, namespace, selector)
        up = [p for p in ps if running_ready(p)]
        down = [p for p in ps if unschedulable(p) is not None]
        return (up, down) if (len(ps), len(up), len(down)) == (running + stuck, running, stuck) else None

    what = f"{running} Running and {stuck} Unschedulable pod(s) `{selector}` in {namespace}"
    try:
        return wait_for(what, settled, timeout=timeout, interval=0.5)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; the cluster held: {cluster_picture(cluster, namespace, selector)}") from None


def cluster_picture(cluster, namespace: str, selector: str) -> str:
    """The pods of ``selector``, the RayClusters and the Warning events of ``namespace``, in a line each."""
    lines = []
    for p in pods(cluster, namespace, selector):
        st = p.get("status", {})
        lines.append(f"pod {p['metadata']['name']}: {st.get('phase')} on {p['spec'].get('nodeName')} "
                     f"ready={running_ready(p)} unschedulable={unschedulable(p)!r}")
    for rc in cluster.get_json("rayclusters", "-n", namespace).get("items", []):
        st = rc.get("status", {})
        lines.append(f"raycluster {rc['metadata']['name']}: state={st.get('state')} "
                     f"conditions={[(c['type'], c['status'], c.get('reason')) for c in st.get('conditions', [])]}")
    events = cluster.get_json("events", "-n", namespace, "--field-selector=type=Warning").get("items", [])
    lines += [f"event {e['involvedObject'].get('kind')}/{e['involvedObject'].get('name')}: {e.get('reason')}: "
              f"{e.get('message')}" for e in events[-10:]]
    return "; ".join(lines) or "nothing"


def gpu_limit(pod: dict) -> int:
    return sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
               for c in pod["spec"]["containers"])


def scale(cluster, namespace: str, raycluster: str, replicas: dict[str, int]) -> None:
    """Set worker groups' replicas, as Ray's autoscaler does (KubeRay's in-tree autoscaler
    patches the RayCluster)."""
    spec = cluster.get_json("raycluster", raycluster, "-n", namespace)["spec"]
    groups = [g["groupName"] for g in spec["workerGroupSpecs"]]
    ops = [{"op": "add", "path": f"/spec/workerGroupSpecs/{groups.index(g)}/replicas", "value": n}
           for g, n in replicas.items()]
    cluster.kubectl("patch", "raycluster", raycluster, "-n", namespace, "--type=json", "-p", json.dumps(ops))


def worker_selector(raycluster: str, group: str) -> str:
    return f"ray.io/cluster={raycluster},ray.io/group={group}"
