"""The full loopback cluster (`localcluster.py up --full`, fixture `full_cluster`):
kube-scheduler places pods on KWOK's fake nodes by their nvidia.com/gpu capacity,
KWOK makes them Running, and the KubeRay operator turns a RayCluster into head
and worker pods. Ray itself never runs here: this layer tests the Kubernetes
objects (DESIGN.md, "Testing layers", 5)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import running_ready

REPO = Path(__file__).resolve().parents[1]
LOCALCLUSTER = REPO / "hack" / "cluster" / "localcluster.py"
CPU_NODES = {"vj-cpu-0", "vj-cpu-1"}
L40_NODES = {"vj-l40-48-0", "vj-l40-48-1"}
H100_NODES = {"vj-h100-80-0", "vj-h100-80-1"}
IMAGE = "registry.invalid/never-pulled:1"  # no kubelet: nothing is ever pulled
RAY_IMAGE = "rayproject/ray:2.60.0"


def wait_for(what: str, check, deadline_s: float = 60, interval: float = 0.5):
    """Poll check() until it returns something truthy; fail saying what we waited
    for and what check() last returned (or raised)."""
    t0 = time.monotonic()
    last = None
    while True:
        try:
            last = check()
        except Exception as exc:  # noqa: BLE001 - reported when the deadline passes
            last = exc
        else:
            if last:
                return last
        if time.monotonic() - t0 > deadline_s:
            pytest.fail(f"timed out after {deadline_s:.0f}s waiting for {what}; last: {last!r}",
                        pytrace=False)
        time.sleep(interval)


def pod(name: str, namespace: str, limits: dict | None = None,
        node_selector: dict | None = None) -> dict:
    container = {"name": "main", "image": IMAGE,
                 "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}
    if limits:
        container["resources"]["limits"] = limits
    spec: dict = {"containers": [container], "terminationGracePeriodSeconds": 1}
    if node_selector:
        spec["nodeSelector"] = node_selector
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def wait_pod_running(cluster, namespace: str, name: str, deadline_s: float = 60) -> dict:
    return wait_for(f"pod {namespace}/{name} to be scheduled and Running/Ready",
                    lambda: (lambda p: p if running_ready(p) else None)(
                        cluster.get_json("pod", name, "-n", namespace)), deadline_s)


def pods(cluster, namespace: str, selector: str) -> list[dict]:
    return cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]


# --------------------------------------------------------------------------


def test_stage_files_are_the_pinned_kwok_modules():
    """hack/cluster/kwok/stages.yaml is a verbatim copy of the pinned kwok's stages."""
    go = shutil.which("go")
    if not go:
        pytest.skip("no go command to locate the kwok module")
    res = subprocess.run([go, "mod", "download", "-json", "sigs.k8s.io/kwok"],
                         cwd=REPO / "tools" / "kwok", capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        pytest.skip(f"cannot locate sigs.k8s.io/kwok: {res.stdout[-500:]} {res.stderr[-500:]}")
    stage = Path(json.loads(res.stdout)["Dir"]) / "kustomize" / "stage"
    files = ["node/fast/node-initialize", "node/heartbeat-with-lease/node-heartbeat-with-lease",
             "pod/fast/pod-ready", "pod/fast/pod-complete", "pod/fast/pod-delete"]
    expected = "".join("---\n" + (stage / f"{f}.yaml").read_text() for f in files)
    ours = (REPO / "hack" / "cluster" / "kwok" / "stages.yaml").read_text()
    body = ours[ours.index("\n---\n") + 1:]
    assert body == expected


@pytest.mark.cluster
def test_full_state_is_recorded(full_cluster):
    state = full_cluster.state
    assert state["full"] is True
    assert set(full_cluster.fake_nodes) == CPU_NODES | L40_NODES | H100_NODES
    assert (full_cluster.bin_dir / "kube-scheduler").exists()
    assert (full_cluster.tool_bin_dirs["kwok"] / "kwok").exists()
    assert (full_cluster.tool_bin_dirs["kuberay"] / "kuberay-operator").exists()
    pinned = re.search(r"github\.com/ray-project/kuberay/ray-operator (v\S+)",
                       (REPO / "tools" / "kuberay" / "go.mod").read_text()).group(1)
    assert full_cluster.kuberay_version == pinned
    crd = full_cluster.get_json("crd", "rayclusters.ray.io")
    assert "v1" in [v["name"] for v in crd["spec"]["versions"] if v.get("served")]
    status = subprocess.run([sys.executable, str(LOCALCLUSTER), "--cluster-dir",
                             str(full_cluster.cluster_dir), "status"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout + status.stderr
    for name in ("kube-scheduler", "kwok", "kuberay-operator"):
        assert re.search(rf"^\s+{name}\s+pid \d+\s+ok", status.stdout, re.M), status.stdout


@pytest.mark.cluster
def test_fake_nodes_report_gpu_capacity(full_cluster):
    nodes = {n["metadata"]["name"]: n for n in full_cluster.get_json("nodes")["items"]}
    for name in H100_NODES | L40_NODES | CPU_NODES:
        alloc = nodes[name]["status"]["allocatable"]
        gpus = 8 if name in H100_NODES else 1 if name in L40_NODES else 0
        assert int(alloc.get("nvidia.com/gpu", "0")) == gpus, (name, alloc)
        labels = nodes[name]["metadata"]["labels"]
        if gpus:
            assert labels["videojob.io/gpu-class"] == ("h100-80" if gpus == 8 else "l40-48")


@pytest.mark.cluster
def test_cpu_pod_runs_on_a_cpu_node(full_cluster, full_namespace):
    full_cluster.kubectl("create", "-f", "-", input=json.dumps(pod("cpu", full_namespace)))
    p = wait_pod_running(full_cluster, full_namespace, "cpu")
    assert p["spec"]["nodeName"] in CPU_NODES
    assert p["status"].get("podIP")  # kwok hands out pod IPs


@pytest.mark.cluster
def test_gpu_pods_land_by_capacity_and_class(full_cluster, full_namespace):
    ns = full_namespace
    full_cluster.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        pod("gpu8", ns, limits={"nvidia.com/gpu": "8"}),
        pod("gpu1", ns, limits={"nvidia.com/gpu": "1"},
            node_selector={"videojob.io/gpu-class": "l40-48"}),
        pod("gpu16", ns, limits={"nvidia.com/gpu": "16"}),
    ]}))
    gpu8 = wait_pod_running(full_cluster, ns, "gpu8")
    assert gpu8["spec"]["nodeName"] in H100_NODES
    # the apiserver's ExtendedResourceToleration plugin let it onto the tainted GPU node
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} \
        in gpu8["spec"]["tolerations"]
    gpu1 = wait_pod_running(full_cluster, ns, "gpu1")
    assert gpu1["spec"]["nodeName"] in L40_NODES

    def unschedulable():
        p = full_cluster.get_json("pod", "gpu16", "-n", ns)
        cond = [c for c in p["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        return p if cond and cond[0]["status"] == "False" and cond[0]["reason"] == "Unschedulable" else None

    gpu16 = wait_for(f"pod {ns}/gpu16 (16 GPUs) to be marked Unschedulable", unschedulable)
    events = wait_for(
        f"a FailedScheduling event for pod {ns}/gpu16",
        lambda: [e for e in full_cluster.get_json(
            "events", "-n", ns, "--field-selector", "involvedObject.name=gpu16")["items"]
            if e["reason"] == "FailedScheduling"])
    assert "nvidia.com/gpu" in events[0]["message"], events[0]["message"]
    assert gpu16["status"]["phase"] == "Pending" and not gpu16["spec"].get("nodeName")


def raycluster(name: str, namespace: str) -> dict:
    return {
        "apiVersion": "ray.io/v1", "kind": "RayCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {
                "rayStartParams": {"num-cpus": "0"},
                "template": {"spec": {"containers": [{
                    "name": "ray-head", "image": RAY_IMAGE,
                    "resources": {"requests": {"cpu": "1", "memory": "2Gi"},
                                  "limits": {"cpu": "1", "memory": "2Gi"}}}]}},
            },
            "workerGroupSpecs": [{
                "groupName": "h100-80", "replicas": 1, "minReplicas": 0, "maxReplicas": 2,
                "rayStartParams": {},
                "template": {"spec": {
                    "nodeSelector": {"videojob.io/gpu-class": "h100-80"},
                    "containers": [{
                        "name": "ray-worker", "image": RAY_IMAGE,
                        "resources": {"requests": {"cpu": "8", "memory": "64Gi"},
                                      "limits": {"cpu": "8", "memory": "64Gi",
                                                 "nvidia.com/gpu": "8"}}}]}},
            }],
        },
    }


@pytest.mark.cluster
def test_kuberay_turns_a_raycluster_into_pods_on_gpu_nodes(full_cluster, full_namespace):
    ns = full_namespace
    full_cluster.kubectl("create", "-f", "-", input=json.dumps(raycluster("rc", ns)))

    def running(selector: str, count: int):
        ps = pods(full_cluster, ns, selector)
        return ps if len(ps) == count and all(running_ready(p) for p in ps) else None

    head = wait_for(f"KubeRay to make the head pod of {ns}/rc Running",
                    lambda: running("ray.io/cluster=rc,ray.io/node-type=head", 1), 90)
    assert head[0]["spec"]["nodeName"] in CPU_NODES
    workers = wait_for(f"KubeRay to make 1 worker pod of {ns}/rc Running",
                       lambda: running("ray.io/cluster=rc,ray.io/group=h100-80", 1), 90)
    assert workers[0]["spec"]["nodeName"] in H100_NODES

    full_cluster.kubectl("patch", "raycluster", "rc", "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "replace", "path": "/spec/workerGroupSpecs/0/replicas", "value": 2}]))
    workers = wait_for(f"KubeRay to scale {ns}/rc to 2 Running workers",
                       lambda: running("ray.io/cluster=rc,ray.io/group=h100-80", 2), 90)
    assert {w["spec"]["nodeName"] for w in workers} == H100_NODES  # one 8-GPU node each

    full_cluster.kubectl("delete", "raycluster", "rc", "-n", ns, "--wait=false")
    wait_for(f"the pods of {ns}/rc to be deleted (garbage collector, kwok)",
             lambda: not pods(full_cluster, ns, "ray.io/cluster=rc"), 90)
