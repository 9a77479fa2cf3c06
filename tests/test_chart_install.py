"""The chart installed for real (DESIGN.md "Testing layers", 5): `helm install`,
`upgrade` and `uninstall` against the full loopback cluster (fixture
full_cluster: kube-apiserver, kube-controller-manager, kube-scheduler, KWOK
fake nodes from hack/cluster/fake-nodes.yaml, the KubeRay operator).

The GPU example's tests install exactly the README's GPU example,
charts/videojob/ci/kuberay-gpu.yaml, with only what this cluster needs:
- `--set watch.namespaces={...}`: namespaces the test made (the file's own
  must exist before an install);
- a PersistentVolume pre-bound to the chart's claim (no provisioner here),
  sized and moded as the chart renders the claim, deleted afterwards;
- the ServiceMonitor CRD, which the Prometheus Operator would bring (the file
  turns on a ServiceMonitor): a stand-in with an open schema, created only if
  missing and deleted afterwards;
- the Ray token Secret the file names (kuberay mode requires one), as the
  README's install creates it.
KWOK never pulls images or runs containers: pods are bound by kube-scheduler
and marked Running, so these tests check Kubernetes objects, scheduling and
RBAC: the fake nodes against the example (no cluster), the install scheduling
workers by class, values the schema refuses, and upgrade and uninstall. The
last test runs the real operator (a process of the test, under the
ServiceAccount token and Role the chart made, with the chart's inventory and
environment) and a tiny job to Succeeded, with the chart's embedded mode.

Elsewhere: the pods KubeRay makes from the GPU example (`ray start` through
bash, tokens, probes, NetworkPolicy) in tests/test_chart_install_kuberay.py;
the CRD upgrade path in tests/test_chart_install_crd.py; the fixtures and
helpers the three share in tests/chart_install_support.py.
"""
from __future__ import annotations

import base64
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required
import yaml

from chart_install_support import (CHART, DRIVERS, EMBEDDED_VALUES, GPU_CLASSES, INSTANCE, RELEASE,
                                   gpu_args, gpu_limit, installed, of_kind, pods, ray_token, rendered, scale,
                                   unschedulable, wait_established, wait_pods, worker_selector)
from chart_install_support import helm, service_monitor_crd, volumes  # noqa: F401 - fixtures
from helpers import REPO, env_of, inventory_source, wait_for
from videojob.api.spec import parse_bytes
from videojob.crd import CRD_NAME
from videojob.inventory import load_inventory


FAKE_NODES = [n for n in yaml.safe_load_all((REPO / "hack" / "cluster" / "fake-nodes.yaml").read_text()) if n]
EXPIRE_AFTER_S = 10  # the chart-RBAC job's ttlSecondsAfterFinished
SWEEP_S = 2  # and the operator's sweep interval there
CPU_NODES = {n["metadata"]["name"] for n in FAKE_NODES if "nvidia.com/gpu" not in n["status"]["capacity"]}


def class_nodes(klass: dict) -> set[str]:
    """The fake nodes a class's nodeSelector picks."""
    return {n["metadata"]["name"] for n in FAKE_NODES
            if klass["nodeSelector"].items() <= n["metadata"]["labels"].items()}


def test_fake_nodes_are_the_readme_gpu_example():
    """No cluster: every class of ci/kuberay-gpu.yaml selects two fake nodes of its own
    videojob.io/gpu-class, each one pod's worth (GPUs, GPU memory, host memory) and
    tainted as the class tolerates; the CPU nodes take neither."""
    seen: set[str] = set()
    for name, klass in GPU_CLASSES.items():
        nodes = [n for n in FAKE_NODES if n["metadata"]["name"] in class_nodes(klass)]
        assert len(nodes) == 2, f"{name}: nodes {[n['metadata']['name'] for n in nodes]}"
        for node in nodes:
            labels, capacity = node["metadata"]["labels"], node["status"]["allocatable"]
            where = f"{node['metadata']['name']} ({name})"
            assert labels["videojob.io/gpu-class"] == name, where
            assert int(capacity["nvidia.com/gpu"]) == klass["gpusPerPod"], where
            assert int(labels["nvidia.com/gpu.count"]) == klass["gpusPerPod"], where
            assert int(labels["nvidia.com/gpu.memory"]) * 2**20 == parse_bytes(klass["gpuMemory"]), where
            assert parse_bytes(capacity["memory"]) >= parse_bytes(klass["hostMemory"]), where
            for taint in node["spec"]["taints"]:
                assert any(t["key"] == taint["key"] and t["effect"] == taint["effect"]
                           for t in klass["tolerations"]), f"{where}: taint {taint} not tolerated"
        seen |= class_nodes(klass)
    assert not seen & CPU_NODES


# --- helpers ---------------------------------------------------------------------------------------

def release_objects(cluster, kinds: set[str], namespaces: list[str]) -> set[tuple[str, str, str]]:
    """(kind, namespace, name) of every object of ``kinds`` labelled with the release."""
    found = set()
    for ns in namespaces:
        for item in cluster.get_json(",".join(sorted(kinds)), "-n", ns, "-l", INSTANCE)["items"]:
            found.add((item["kind"], ns, item["metadata"]["name"]))
    return found


def no_release(helm, namespace: str) -> None:
    """helm knows no release in ``namespace``, failed or pending ones included."""
    listed = json.loads(helm("list", "--all", "--namespace", namespace, "--output", "json").stdout)
    assert listed == [], f"helm releases left in {namespace}: {listed}"


# --- a. the README's GPU example on (fake) GPU nodes ---------------------------------------------

def test_install_gpu_example_schedules_by_class(full_cluster, helm, service_monitor_crd, volumes, full_namespaces):
    """`helm install -f ci/kuberay-gpu.yaml`: the CRD is served; the operator pod and the
    Ray head run on CPU nodes (the head asks for no GPU); no worker pods until the
    autoscaler asks; then each class's workers land on their own GPU nodes with
    gpusPerPod GPUs, and a worker no node of its class can hold is not bound."""
    system, jobs = full_namespaces(), full_namespaces()
    args = gpu_args(jobs)
    docs = rendered(helm, system, args)
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    volumes(claim)
    ray_token(full_cluster, system)
    (rc_doc,) = of_kind(docs, "RayCluster")
    rc = rc_doc["metadata"]["name"]
    with installed(helm, system, args):
        wait_established(full_cluster, CRD_NAME)
        crd = full_cluster.get_json("crd", CRD_NAME)
        assert [v["name"] for v in crd["spec"]["versions"] if v["served"]], "no served version"
        wait_for(f"kubectl to list VideoJobs in {jobs}",
                 lambda: full_cluster.kubectl("get", "vj", "-n", jobs, check=False).returncode == 0, timeout=30)

        (operator,), _ = wait_pods(full_cluster, system, f"{INSTANCE},app.kubernetes.io/component=operator", 1)
        assert operator["spec"]["nodeName"] in CPU_NODES
        assert full_cluster.get_json("role", RELEASE, "-n", jobs)["rules"], "the Role in the watched namespace"
        binding = full_cluster.get_json("rolebinding", RELEASE, "-n", jobs)
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": operator["spec"]["serviceAccountName"],
                                        "namespace": system}]

        full_cluster.get_json("raycluster", rc, "-n", system)  # helm made it
        (head,), _ = wait_pods(full_cluster, system, f"ray.io/cluster={rc},ray.io/node-type=head", 1)
        assert head["spec"]["nodeName"] in CPU_NODES
        for container in head["spec"]["containers"]:
            for part in ("requests", "limits"):
                assert "nvidia.com/gpu" not in container.get("resources", {}).get(part, {}), container["name"]
        for group in GPU_CLASSES:
            assert pods(full_cluster, system, worker_selector(rc, group)) == [], f"{group}: minReplicas 0"
        # the drivers' group keeps its minReplicas (1) pod, on a CPU node: drivers never take a GPU node
        (driver_pod,), _ = wait_pods(full_cluster, system, worker_selector(rc, DRIVERS), 1)
        assert driver_pod["spec"]["nodeName"] in CPU_NODES and gpu_limit(driver_pod) == 0

        nodes = {n["metadata"]["name"]: n for n in full_cluster.get_json("nodes")["items"]}

        def check_class(group: str, workers: list[dict]) -> None:
            klass = GPU_CLASSES[group]
            for w in workers:
                node = nodes[w["spec"]["nodeName"]]
                assert node["metadata"]["name"] in class_nodes(klass), f"{group} worker on {node['metadata']['name']}"
                assert node["metadata"]["labels"]["videojob.io/gpu-class"] == group
                assert gpu_limit(w) == klass["gpusPerPod"] == int(node["status"]["allocatable"]["nvidia.com/gpu"])

        h100, l40 = "h100-80", "l40-48"
        scale(full_cluster, system, rc, {h100: 1, l40: 1})
        for group in (h100, l40):
            check_class(group, wait_pods(full_cluster, system, worker_selector(rc, group), 1)[0])

        # Three L40 workers, two L40 nodes: the third is not bound, although an H100 node
        # has all its 8 GPUs free (the class's nodeSelector holds).
        scale(full_cluster, system, rc, {l40: 3})
        up, (stuck,) = wait_pods(full_cluster, system, worker_selector(rc, l40), 2, stuck=1)
        check_class(l40, up)
        assert {w["spec"]["nodeName"] for w in up} == class_nodes(GPU_CLASSES[l40])
        assert "Insufficient nvidia.com/gpu" in unschedulable(stuck) and not stuck["spec"].get("nodeName")

        # Three 8-GPU workers, two H100 nodes of 8 GPUs: the third asks for more than any node has.
        scale(full_cluster, system, rc, {h100: 3})
        up, (stuck,) = wait_pods(full_cluster, system, worker_selector(rc, h100), 2, stuck=1)
        check_class(h100, up)
        assert {w["spec"]["nodeName"] for w in up} == class_nodes(GPU_CLASSES[h100])
        assert "Insufficient nvidia.com/gpu" in unschedulable(stuck) and not stuck["spec"].get("nodeName")


# --- b. values the schema refuses ----------------------------------------------------------------

@pytest.mark.parametrize("override,named", [
    ("gpuClasses[0].gpusPerPod=9", "/gpuClasses/0/gpusPerPod"),
    ("watch.namespace=videojob-jobs", "'namespace' not allowed"),
], ids=["too-many-gpus", "unknown-key"])
def test_install_refuses_bad_values(full_cluster, helm, service_monitor_crd, full_namespaces, override, named):
    """helm install refuses values against the schema, naming the value, and leaves no
    release and no objects; only the CRD, which helm applies from crds/ before it
    checks the values (helm's order, documented in the README)."""
    ns = full_namespaces()
    full_cluster.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", "--timeout=60s", timeout=90)
    kinds = {d["kind"] for d in rendered(helm, ns, gpu_args(ns))}
    result = helm("install", RELEASE, str(CHART), "--namespace", ns, *gpu_args(ns), "--set", override, check=False)
    try:
        assert result.returncode != 0, f"helm install accepted {override}"
        assert named in result.stderr and "schema" in result.stderr, result.stderr
        no_release(helm, ns)
        assert not full_cluster.get_json("secrets", "-n", ns, "-l", "owner=helm")["items"], "a release record"
        namespaced = kinds - {"ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                              "ValidatingAdmissionPolicyBinding"}
        assert release_objects(full_cluster, namespaced | {"Pod"}, [ns]) == set()
        cluster_wide = full_cluster.get_json("clusterroles,clusterrolebindings,validatingadmissionpolicies,"
                                             "validatingadmissionpolicybindings", "-l", INSTANCE)["items"]
        assert cluster_wide == [], [o["metadata"]["name"] for o in cluster_wide]
        wait_established(full_cluster, CRD_NAME)  # what is left: the CRD
    finally:
        helm("uninstall", RELEASE, "--namespace", ns, "--ignore-not-found")


# --- c. upgrade and uninstall --------------------------------------------------------------------

def test_upgrade_keeps_replicas_and_uninstall_keeps_only_the_documented(full_cluster, helm, service_monitor_crd,
                                                                         volumes, full_namespaces, tmp_path):
    """`helm upgrade` with a class's maxPods and an operator setting changed: the
    RayCluster, the inventory and the Deployment's environment change, and the
    replicas the autoscaler set (and its worker pods) stay. `helm uninstall` then
    leaves nothing of the release but the CRD, the data claim and the runtime key Secret
    (helm.sh/resource-policy: keep; docs/chart.md); the RayCluster's pods and KubeRay's objects go too."""
    system, jobs = full_namespaces(), full_namespaces()
    args = gpu_args(jobs)
    docs = rendered(helm, system, args)
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    volumes(claim)
    ray_token(full_cluster, system)
    rc = of_kind(docs, "RayCluster")[0]["metadata"]["name"]
    h100, l40 = "h100-80", "l40-48"
    with installed(helm, system, args):
        wait_pods(full_cluster, system, f"ray.io/cluster={rc},ray.io/node-type=head", 1)
        (operator,), _ = wait_pods(full_cluster, system, f"{INSTANCE},app.kubernetes.io/component=operator", 1)
        scale(full_cluster, system, rc, {l40: 2})
        workers = {p["metadata"]["name"] for p in wait_pods(full_cluster, system, worker_selector(rc, l40), 2)[0]}
        before = full_cluster.get_json("deployment", RELEASE, "-n", system)
        key_secret = next(v["secret"]["secretName"] for v in before["spec"]["template"]["spec"]["volumes"]
                          if v["name"] == "runtime-key")
        key = full_cluster.get_json("secret", key_secret, "-n", system)["data"]

        changed = [dict(c, maxPods=2) if c["name"] == h100 else c for c in GPU_CLASSES.values()]
        assert GPU_CLASSES[h100]["maxPods"] != 2
        upgrade = tmp_path / "upgrade.yaml"
        upgrade.write_text(yaml.safe_dump({"gpuClasses": changed}))
        helm("upgrade", RELEASE, str(CHART), "--namespace", system, *args, "-f", str(upgrade),
             "--set", "operator.settings.maxAttempts=5")

        raycluster = full_cluster.get_json("raycluster", rc, "-n", system)
        groups = {g["groupName"]: g for g in raycluster["spec"]["workerGroupSpecs"]}
        assert groups[h100]["maxReplicas"] == 2
        assert full_cluster.get_json("secret", key_secret, "-n", system)["data"] == key, \
            "the upgrade made a new runtime key: running jobs' checkpoints would no longer be read"
        assert groups[l40]["replicas"] == 2, "the upgrade reset the autoscaler's replicas"
        assert groups[h100]["replicas"] == 0
        wait_for(f"KubeRay to reconcile the upgraded RayCluster {system}/{rc}", lambda: (
            (o := full_cluster.get_json("raycluster", rc, "-n", system))["status"].get("observedGeneration")
            == o["metadata"]["generation"]), timeout=30)
        still = {p["metadata"]["name"] for p in wait_pods(full_cluster, system, worker_selector(rc, l40), 2)[0]}
        assert still == workers, "the upgrade replaced the worker pods"

        deployment = full_cluster.get_json("deployment", RELEASE, "-n", system)
        path, name = inventory_source(deployment)
        data = full_cluster.get_json("configmap", name, "-n", system)["data"][path.name]
        (tmp_path / path.name).write_text(data)
        inventory = load_inventory(str(tmp_path / path.name))
        assert {c.name: c.max_pods for c in inventory.classes} == {h100: 2, l40: GPU_CLASSES[l40]["maxPods"]}
        assert env_of(deployment["spec"]["template"]["spec"]["containers"][0])["VIDEOJOB_MAX_ATTEMPTS"] == "5"
        annotation = "checksum/inventory"
        assert (deployment["spec"]["template"]["metadata"]["annotations"][annotation]
                != before["spec"]["template"]["metadata"]["annotations"][annotation]), "no restart for a new inventory"
        (new_operator,), _ = wait_pods(full_cluster, system, f"{INSTANCE},app.kubernetes.io/component=operator", 1)
        assert new_operator["metadata"]["name"] != operator["metadata"]["name"]

        manifest = helm("get", "manifest", RELEASE, "--namespace", system).stdout
        kinds = {d["kind"] for d in yaml.safe_load_all(manifest) if d}
        result = helm("uninstall", RELEASE, "--namespace", system, "--wait", "--timeout=60s")
        assert claim["metadata"]["name"] in result.stdout  # helm says what it kept

    no_release(helm, system)
    assert not full_cluster.get_json("secrets", "-n", system, "-l", "owner=helm")["items"], "a release record"
    kept = {("PersistentVolumeClaim", system, claim["metadata"]["name"]), ("Secret", system, key_secret)}
    wait_for("only the data claim and the runtime key to be left of the release (Pods and ReplicaSets included)",
             lambda: release_objects(full_cluster, kinds | {"Pod", "ReplicaSet"}, [system, jobs]) == kept,
             timeout=60, interval=0.5)
    kuberay_made = "pods,services,serviceaccounts,roles,rolebindings"
    wait_for(f"the pods and KubeRay's objects of {rc} to be deleted (garbage collector, KWOK)",
             lambda: not full_cluster.get_json(kuberay_made, "-n", system, "-l", f"ray.io/cluster={rc}")["items"],
             timeout=60, interval=0.5)
    assert full_cluster.kubectl("get", "raycluster", rc, "-n", system, check=False).returncode != 0
    assert full_cluster.get_json("pvc", claim["metadata"]["name"], "-n", system)["status"]["phase"] == "Bound"
    full_cluster.get_json("crd", CRD_NAME)  # helm never deletes crds/


# --- d. the real operator under the chart's ServiceAccount ---------------------------------------

def test_operator_runs_a_job_under_the_charts_rbac_and_inventory(full_cluster, helm, full_namespaces):
    """An `embedded` install (device cpu); the operator runs here, as the ServiceAccount the
    chart made (its token; the chart's Role in the watched namespace is all it is granted),
    with the Deployment's environment and the inventory ConfigMap's file where the pod
    would see them (every absolute path under a temp root); a tiny job Succeeds, and past
    its ttlSecondsAfterFinished the operator deletes it (the Role's `delete`)."""
    require_module("ray")
    require_module("xfuser")
    from operator_harness import OperatorProcess, create, tiny_job, wait_phase

    system, jobs = full_namespaces(), full_namespaces()
    root = Path(tempfile.mkdtemp(prefix="vj-chart-", dir="/tmp"))  # the pod's filesystem
    try:
        with installed(helm, system, ["-f", str(EMBEDDED_VALUES), "--set", f"watch.namespaces={{{jobs}}}",
                                      "--set", f"operator.settings.sweepIntervalS={SWEEP_S}"]):
            deployment = full_cluster.get_json("deployment", RELEASE, "-n", system)
            pod = deployment["spec"]["template"]["spec"]
            account = full_cluster.get_json("serviceaccount", pod["serviceAccountName"], "-n", system)
            assert account["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE, "the chart's SA"
            kubeconfig = full_cluster.kubeconfig_for(system, pod["serviceAccountName"], root / "operator.kubeconfig")

            env = {k: (str(root) + v if v.startswith("/") else v)
                   for k, v in env_of(pod["containers"][0]).items() if v is not None}
            for mount in pod["containers"][0]["volumeMounts"]:
                Path(str(root) + mount["mountPath"]).mkdir(parents=True, exist_ok=True)
            path, name = inventory_source(deployment)
            inventory_file = Path(env["VIDEOJOB_INVENTORY_FILE"])
            assert inventory_file == Path(str(root) + str(path))
            inventory_file.write_text(full_cluster.get_json("configmap", name, "-n", system)["data"][path.name])
            (klass,) = load_inventory(str(inventory_file)).classes
            # The runtime key Secret's file where the pod mounts it (the ranks sign checkpoints with it).
            key_volume = next(v for v in pod["volumes"] if v["name"] == "runtime-key")["secret"]
            secret = full_cluster.get_json("secret", key_volume["secretName"], "-n", system)
            Path(env["VIDEOJOB_RUNTIME_KEY_FILE"]).write_bytes(
                base64.b64decode(secret["data"][key_volume["items"][0]["key"]]))
            del env["VIDEOJOB_METRICS_PORT"]  # the harness lets the operator bind a free port, not the pod's 8080
            env["VIDEOJOB_DRIVER_PYTHON"] = sys.executable  # `python` is the runtime image's
            assert env["VIDEOJOB_RAY_MODE"] == "embedded" and env["VIDEOJOB_NAMESPACES"] == jobs

            with OperatorProcess(full_cluster, jobs, root / "work", env, kubeconfig=kubeconfig) as operator:
                try:
                    doc = tiny_job("chart-tiny", steps=2)
                    doc["spec"]["ttlSecondsAfterFinished"] = EXPIRE_AFTER_S
                    create(full_cluster, jobs, doc)
                    obj = wait_phase(full_cluster, jobs, "chart-tiny", {"Succeeded", "Failed"}, timeout=300)
                    assert obj["status"]["phase"] == "Succeeded", (obj["status"].get("message"),
                                                                   operator.log()[-3000:])
                    # Expired: the operator's sweeper deletes it, as the chart's ServiceAccount (its
                    # Role must grant `delete` on videojobs); nothing else here deletes it.
                    wait_for("the operator to delete chart-tiny past its ttlSecondsAfterFinished",
                             lambda: full_cluster.api.get(f"/apis/videojob.io/v1alpha1/namespaces/{jobs}/videojobs/chart-tiny") is None,
                             timeout=EXPIRE_AFTER_S + 3 * SWEEP_S + 30)
                    assert "past its ttlSecondsAfterFinished; deleted" in operator.log(), operator.log()[-3000:]
                finally:
                    # While the operator runs, so that its finalizer lets go (else the namespace hangs).
                    gone = full_cluster.kubectl("delete", "vj", "--all", "-n", jobs, "--wait=true", "--timeout=60s",
                                                check=False, timeout=90)
                    if gone.returncode != 0:
                        full_cluster.kubectl("patch", "vj", "chart-tiny", "-n", jobs, "--type=merge", "-p",
                                             '{"metadata": {"finalizers": null}}', check=False)
            assert obj["status"]["plan"]["gpuClass"] == klass.name
            output = Path(env["VIDEOJOB_OUTPUT_ROOT"]) / jobs / "videos" / "chart-tiny" / "chart-tiny.mp4"
            assert output.stat().st_size > 0, output
            roles = [r["metadata"]["name"] for r in full_cluster.get_json("roles", "-n", jobs)["items"]]
            assert roles == [RELEASE], f"the operator's only grant is the chart's Role: {roles}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
