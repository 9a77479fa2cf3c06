"""The chart installed for real (DESIGN.md "Testing layers", 5): `helm install`,
`upgrade` and `uninstall` against the full loopback cluster (fixture
full_cluster: kube-apiserver, kube-controller-manager, kube-scheduler, KWOK
fake nodes from hack/cluster/fake-nodes.yaml, the KubeRay operator).

The kuberay tests install exactly the README's GPU example,
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
RBAC, and run by hand what must survive a shell: the `ray start` command line
KubeRay wrote into its pods goes through real bash with a stub `ray`. The
loopback cluster has no CNI, so nothing enforces NetworkPolicy here: the chart's
is checked as an object the API server accepted, selecting the pods KubeRay
made. One test walks the documented CRD upgrade path (helm never upgrades
crds/). The last test runs the real operator (a process of the test, under the
ServiceAccount token and Role the chart made, with the chart's inventory and
environment) and a tiny job to Succeeded, with the chart's embedded mode.
"""
from __future__ import annotations

import ast
import copy
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from helpers import REPO, env_of, helm_binary, inventory_source, running_ready, wait_for
from videojob.api.spec import parse_bytes
from videojob.crd import CRD_NAME
from videojob.inventory import load_inventory

CHART = REPO / "charts" / "videojob"
GPU_VALUES = CHART / "ci" / "kuberay-gpu.yaml"
CRD_FILE = next((CHART / "crds").glob("*.yaml"))
TOKEN_SECRET = yaml.safe_load(GPU_VALUES.read_text())["ray"]["auth"]["existingSecret"]
DRIVERS = "drivers"  # the drivers' worker group (raycluster.yaml)
SA_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
EMBEDDED_VALUES = CHART / "ci" / "embedded.yaml"
GPU_CLASSES = {c["name"]: c for c in yaml.safe_load(GPU_VALUES.read_text())["gpuClasses"]}
FAKE_NODES = [n for n in yaml.safe_load_all((REPO / "hack" / "cluster" / "fake-nodes.yaml").read_text()) if n]
CPU_NODES = {n["metadata"]["name"] for n in FAKE_NODES if "nvidia.com/gpu" not in n["status"]["capacity"]}
RELEASE = "videojob"  # the README's release name: objects are `videojob`, `videojob-ray`, ...
INSTANCE = f"app.kubernetes.io/instance={RELEASE}"
HELM_TIMEOUT_S = 120
SERVICE_MONITOR_CRD = "servicemonitors.monitoring.coreos.com"


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


# --- fixtures and helpers ----------------------------------------------------------------------

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
        conditions = cluster.get_json("crd", crd).get("status", {}).get("conditions", [])
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
              timeout: float = 60) -> tuple[list[dict], list[dict]]:
    """Wait until the pods of ``selector`` are exactly ``running`` Running/Ready and ``stuck``
    Unschedulable ones; returns (running pods, unschedulable pods)."""
    def settled():
        ps = pods(cluster, namespace, selector)
        up = [p for p in ps if running_ready(p)]
        down = [p for p in ps if unschedulable(p) is not None]
        return (up, down) if (len(ps), len(up), len(down)) == (running + stuck, running, stuck) else None

    return wait_for(f"{running} Running and {stuck} Unschedulable pod(s) `{selector}` in {namespace}",
                    settled, timeout=timeout, interval=0.5)


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


# --- a2. the pods KubeRay made from the chart: `ray start`, tokens, probes, NetworkPolicy -------

def ray_start_argv(pod: dict, work: Path) -> list[str]:
    """What `ray` gets when the pod's Ray container starts: its command and args, exactly
    as KubeRay wrote them (`/bin/bash -c -- "ulimit ...; ray start --flag=value ..."`),
    run by real bash with `ray` a stub on PATH that prints its argv as JSON."""
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] in ("ray-head", "ray-worker")]
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv and argv[0].endswith("bash"), f"not a bash command line: {argv}"
    work.mkdir(parents=True, exist_ok=True)
    bin_dir, home = work / "bin", work / "home"
    bin_dir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    stub = bin_dir / "ray"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint('RAY-ARGV', json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    # KubeRay runs a login shell when ENABLE_LOGIN_SHELL is set; Debian's /etc/profile then
    # resets PATH, so the profile in HOME puts the stub first again.
    (home / ".bash_profile").write_text(f'PATH="{bin_dir}:$PATH"\n')
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", HOME=str(home))
    result = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=30)
    lines = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("RAY-ARGV ")]
    assert result.returncode == 0 and len(lines) == 1, (argv, result.stdout, result.stderr)
    return json.loads(lines[0])


def start_flags(argv: list[str]) -> dict[str, str | bool]:
    """`ray start --a=b --c` -> {"a": "b", "c": True}."""
    assert argv[0] == "start", argv
    flags: dict[str, str | bool] = {}
    for arg in argv[1:]:
        assert arg.startswith("--"), f"{arg!r} in {argv}: a value bash split off its flag"
        key, sep, value = arg[2:].partition("=")
        flags[key] = value if sep else True
    return flags


def ray_public_paths() -> tuple[set[str], set[str]]:
    """Paths Ray 2.60's token auth leaves open: the dashboard agent's (http_server_agent
    PUBLIC_EXACT_PATHS) and the dashboard head's (the public_exact_paths set literal in
    http_server_head.py)."""
    from ray.dashboard import http_server_agent, http_server_head

    head: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(http_server_head))):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Set)
                and any(getattr(t, "id", None) == "public_exact_paths" for t in node.targets)):
            head = {ast.literal_eval(e) for e in node.value.elts}
    assert head, "http_server_head.py no longer has public_exact_paths"
    return set(http_server_agent.PUBLIC_EXACT_PATHS), head


def token_mounts(pod: dict) -> dict[str, list[str]]:
    """Container name -> the volumes it mounts at the ServiceAccount token path."""
    return {c["name"]: [m["name"] for m in c.get("volumeMounts", []) if m["mountPath"].startswith(SA_TOKEN_DIR)]
            for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])}


def projects_a_token(pod: dict, volume: str) -> bool:
    (spec,) = [v for v in pod["spec"]["volumes"] if v["name"] == volume]
    return any("serviceAccountToken" in s for s in spec.get("projected", {}).get("sources", []))


def test_kuberay_pods_start_ray_with_class_resources_and_no_needless_tokens(
        full_cluster, helm, service_monitor_crd, volumes, full_namespaces, tmp_path):
    """The README's GPU example installed; the pods KubeRay (the real operator, v1.5) made
    from it:
    - `ray start`, run through bash as the pod would: each class's worker advertises
      --resources '{"vj-class-<name>": gpusPerPod}' (valid JSON after bash: KubeRay
      single-quotes the group's `resources` field) and its GPUs, the drivers' pod
      {"vj-driver": slotsPerPod} with no CPUs, the head no CPUs. (Rendered as JSON in
      rayStartParams, as before the fix, bash stripped the quotes and `ray start` got
      {vj-class-h100-80:8}.)
    - ServiceAccount tokens: the head pod runs as KubeRay's ServiceAccount for the
      cluster, which may patch the RayCluster and its pods, and only its autoscaler
      container mounts a token; no Ray container and no worker pod has one; the
      operator pod has its own.
    - KubeRay's probes call only paths Ray's token auth leaves public.
    - The NetworkPolicy the API server accepted selects every Ray pod and not the
      operator, and lets the operator pod in on the head Service's dashboard port
      (not enforced here: no CNI)."""
    system, jobs = full_namespaces(), full_namespaces()
    args = gpu_args(jobs)
    docs = rendered(helm, system, args)
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    volumes(claim)
    ray_token(full_cluster, system)
    rc = of_kind(docs, "RayCluster")[0]["metadata"]["name"]
    slots = [g for g in of_kind(docs, "RayCluster")[0]["spec"]["workerGroupSpecs"]
             if g["groupName"] == DRIVERS][0]["resources"]["vj-driver"]
    with installed(helm, system, args):
        scale(full_cluster, system, rc, {name: 1 for name in GPU_CLASSES})
        (head,), _ = wait_pods(full_cluster, system, f"ray.io/cluster={rc},ray.io/node-type=head", 1)
        (drivers,), _ = wait_pods(full_cluster, system, worker_selector(rc, DRIVERS), 1)
        workers = {name: wait_pods(full_cluster, system, worker_selector(rc, name), 1)[0][0] for name in GPU_CLASSES}
        (operator,), _ = wait_pods(full_cluster, system, f"{INSTANCE},app.kubernetes.io/component=operator", 1)

        # `ray start` as bash hands it over
        for name, pod in workers.items():
            flags = start_flags(ray_start_argv(pod, tmp_path / name))
            klass = GPU_CLASSES[name]
            assert json.loads(flags["resources"]) == {f"vj-class-{name}": klass["gpusPerPod"]}, (name, flags)
            assert flags["num-gpus"] == str(klass["gpusPerPod"]), (name, flags)
            assert int(flags["num-cpus"]) >= klass["gpusPerPod"], f"{name}: one CPU per rank ({flags})"
            assert flags["address"].startswith(f"{rc}-head-svc."), flags
        flags = start_flags(ray_start_argv(drivers, tmp_path / DRIVERS))
        assert json.loads(flags["resources"]) == {"vj-driver": int(slots)} and flags["num-cpus"] == "0", flags
        assert "num-gpus" not in flags
        flags = start_flags(ray_start_argv(head, tmp_path / "head"))
        assert flags["head"] is True and flags["num-cpus"] == "0" and "resources" not in flags, flags

        # ServiceAccount tokens only where used
        account = head["spec"]["serviceAccountName"]
        assert account == rc, "KubeRay's ServiceAccount for the cluster (the autoscaler's Role is bound to it)"
        assert head["spec"]["automountServiceAccountToken"] is False
        mounts = token_mounts(head)
        assert mounts["ray-head"] == [], "the Ray head container has a ServiceAccount token"
        (autoscaler,) = [c for c in head["spec"]["containers"] if c["name"] == "autoscaler"]
        (volume,) = mounts["autoscaler"]
        assert projects_a_token(head, volume)
        assert [n for n, v in mounts.items() if v] == ["autoscaler"]
        for verb, what in (("patch", f"rayclusters.ray.io/{rc}"), ("patch", "pods"), ("list", "pods")):
            can = full_cluster.kubectl("auth", "can-i", verb, what, "-n", system,
                                       f"--as=system:serviceaccount:{system}:{account}", check=False)
            assert can.stdout.strip() == "yes", f"the autoscaler's token may not {verb} {what}: {can.stdout}{can.stderr}"
        for pod in [drivers, *workers.values()]:
            assert pod["spec"]["automountServiceAccountToken"] is False
            assert not any(token_mounts(pod).values()), (pod["metadata"]["name"], token_mounts(pod))
            assert not any(projects_a_token(pod, v["name"]) for v in pod["spec"]["volumes"])
        (operator_token,) = token_mounts(operator)["operator"]
        assert projects_a_token(operator, operator_token), "the operator needs its token"

        # KubeRay's probes with Ray's token auth on: only public paths
        agent_public, head_public = ray_public_paths()
        for pod, public in ((head, head_public | agent_public), (drivers, agent_public), *[(w, agent_public)
                                                                                           for w in workers.values()]):
            ray = pod["spec"]["containers"][0]
            for probe in (ray["livenessProbe"], ray["readinessProbe"]):
                command = " ".join(probe["exec"]["command"])
                paths = set(re.findall(r"http://[^/\s]+(/[^\s'\"]*)", command))
                assert paths and paths <= public, f"{pod['metadata']['name']}: {paths - public} need a token"
        env = {e["name"]: e for e in head["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"

        # the NetworkPolicy, as the API server holds it
        policy = full_cluster.get_json("networkpolicy", rc, "-n", system)
        selector = policy["spec"]["podSelector"]["matchLabels"]
        for pod in [head, drivers, *workers.values()]:
            assert selector.items() <= pod["metadata"]["labels"].items(), pod["metadata"]["name"]
        assert not selector.items() <= operator["metadata"]["labels"].items()
        (from_operator,) = [r for r in policy["spec"]["ingress"] if r.get("ports")]
        (peer,) = from_operator["from"]
        assert peer["podSelector"]["matchLabels"].items() <= operator["metadata"]["labels"].items()
        service = full_cluster.get_json("service", f"{rc}-head-svc", "-n", system)
        dashboard = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "dashboard")
        assert [p["port"] for p in from_operator["ports"]] == [dashboard]
        (among,) = [r for r in policy["spec"]["ingress"] if not r.get("ports")]
        assert among["from"] == [{"podSelector": {"matchLabels": selector}}]


def test_kuberay_cpu_values_start_ray_as_the_end_to_end_test_needs(full_cluster, helm, volumes, full_namespaces,
                                                                    tmp_path):
    """ci/kuberay-cpu.yaml (the end-to-end test's install) on this cluster: KubeRay takes the
    RayCluster, and the `ray start` lines of the pods it makes, through bash: each CPU
    class's worker offers gpusPerPod CPUs and its class resource, the drivers' pod its
    slots and no CPU, and every Ray node a small object store. (Its class pods select
    videojob.io/e2e-pool nodes, which the end-to-end test brings; here they may stay
    unscheduled: the command line is the pod's either way.)"""
    cpu_values = CHART / "ci" / "kuberay-cpu.yaml"
    values = yaml.safe_load(cpu_values.read_text())
    system, jobs = full_namespaces(), full_namespaces()
    args = ["-f", str(cpu_values), "--set", f"watch.namespaces={{{jobs}}}"]
    docs = rendered(helm, system, args)
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes(claim)
    full_cluster.kubectl("create", "secret", "generic", values["ray"]["auth"]["existingSecret"], "-n", system,
                         f"--from-literal=token={os.urandom(16).hex()}")
    rc = of_kind(docs, "RayCluster")[0]["metadata"]["name"]
    classes = {c["name"]: c for c in values["gpuClasses"]}
    drivers = values["ray"]["kuberay"]["drivers"]
    with installed(helm, system, args):
        scale(full_cluster, system, rc, {name: 1 for name in classes})

        def made(selector: str) -> dict | None:
            found = pods(full_cluster, system, selector)
            return found[0] if len(found) == 1 else None

        head = wait_for("the head pod", lambda: made(f"ray.io/cluster={rc},ray.io/node-type=head"), timeout=60)
        flags = start_flags(ray_start_argv(head, tmp_path / "head"))
        assert flags["num-cpus"] == "0" and flags["object-store-memory"] == "100000000", flags
        pod = wait_for("a drivers pod", lambda: made(worker_selector(rc, DRIVERS)), timeout=60)
        flags = start_flags(ray_start_argv(pod, tmp_path / DRIVERS))
        assert json.loads(flags["resources"]) == {"vj-driver": drivers["slotsPerPod"]}, flags
        assert flags["num-cpus"] == "0" and flags["object-store-memory"] == "100000000", flags
        for name, klass in classes.items():
            pod = wait_for(f"a {name} pod", lambda: made(worker_selector(rc, name)), timeout=60)
            assert gpu_limit(pod) == 0
            flags = start_flags(ray_start_argv(pod, tmp_path / name))
            assert json.loads(flags["resources"]) == {f"vj-class-{name}": klass["gpusPerPod"]}, flags
            assert flags["num-cpus"] == str(klass["gpusPerPod"]) and "num-gpus" not in flags, flags
            assert flags["object-store-memory"] == "100000000", flags


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
        namespaced = kinds - {"ClusterRole", "ClusterRoleBinding"}
        assert release_objects(full_cluster, namespaced | {"Pod"}, [ns]) == set()
        cluster_wide = full_cluster.get_json("clusterroles,clusterrolebindings", "-l", INSTANCE)["items"]
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
    leaves nothing of the release but the CRD and the data claim (helm.sh/resource-policy:
    keep; README "Helm chart"); the RayCluster's pods and KubeRay's objects go too."""
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

        changed = [dict(c, maxPods=2) if c["name"] == h100 else c for c in GPU_CLASSES.values()]
        assert GPU_CLASSES[h100]["maxPods"] != 2
        upgrade = tmp_path / "upgrade.yaml"
        upgrade.write_text(yaml.safe_dump({"gpuClasses": changed}))
        helm("upgrade", RELEASE, str(CHART), "--namespace", system, *args, "-f", str(upgrade),
             "--set", "operator.settings.maxAttempts=5")

        raycluster = full_cluster.get_json("raycluster", rc, "-n", system)
        groups = {g["groupName"]: g for g in raycluster["spec"]["workerGroupSpecs"]}
        assert groups[h100]["maxReplicas"] == 2
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
    kept = {("PersistentVolumeClaim", system, claim["metadata"]["name"])}
    wait_for("only the data claim to be left of the release (Pods and ReplicaSets included)",
             lambda: release_objects(full_cluster, kinds | {"Pod", "ReplicaSet"}, [system, jobs]) == kept,
             timeout=60, interval=0.5)
    kuberay_made = "pods,services,serviceaccounts,roles,rolebindings"
    wait_for(f"the pods and KubeRay's objects of {rc} to be deleted (garbage collector, KWOK)",
             lambda: not full_cluster.get_json(kuberay_made, "-n", system, "-l", f"ray.io/cluster={rc}")["items"],
             timeout=60, interval=0.5)
    assert full_cluster.kubectl("get", "raycluster", rc, "-n", system, check=False).returncode != 0
    assert full_cluster.get_json("pvc", claim["metadata"]["name"], "-n", system)["status"]["phase"] == "Bound"
    full_cluster.get_json("crd", CRD_NAME)  # helm never deletes crds/


# --- c2. the CRD upgrade path ------------------------------------------------------------------------

def _job(name: str, **spec) -> str:
    job = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    job["metadata"]["name"] = name
    job["spec"].update(spec)
    return json.dumps(job)


def _spec_fields(cluster) -> set[str]:
    (version,) = [v for v in cluster.get_json("crd", CRD_NAME)["spec"]["versions"] if v["storage"]]
    return set(version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])


def test_crd_upgrade_path(full_cluster, helm, full_namespaces, tmp_path):
    """Helm installs crds/ once and never upgrades them (README "Helm chart", NOTES.txt):
    with a release whose CRD is older (the current one without the optional
    spec.negativePrompt, written here), `helm upgrade` alone leaves the old schema (the
    API server refuses the new field, or prunes it); `kubectl apply --server-side
    --force-conflicts -f charts/videojob/crds/` and then `helm upgrade` serve the new
    field, and the VideoJob made before is intact. The CRD is the cluster's: it ends as
    the current one whatever happens."""
    system, jobs = full_namespaces(), full_namespaces()
    field, text = "negativePrompt", "blurry, low quality"
    current = yaml.safe_load(CRD_FILE.read_text())
    old = copy.deepcopy(current)
    for version in old["spec"]["versions"]:
        del version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][field]
    old_chart = tmp_path / "videojob-old"
    shutil.copytree(CHART, old_chart)
    (old_chart / "crds" / CRD_FILE.name).write_text(yaml.safe_dump(old, sort_keys=False))
    args = ["-f", str(EMBEDDED_VALUES), "--set", f"watch.namespaces={{{jobs}}}"]
    documented = ["apply", "--server-side", "--force-conflicts", "-f", str(CHART / "crds") + "/"]
    try:
        if full_cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0:
            # another release put the CRD here already (helm install would skip it): make it the
            # older one, owned by helm as an older install would have left it
            full_cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=helm",
                                 "-f", str(old_chart / "crds" / CRD_FILE.name))
        with installed(helm, system, args, chart=old_chart):
            wait_established(full_cluster, CRD_NAME)
            assert field not in _spec_fields(full_cluster)
            full_cluster.kubectl("create", "-n", jobs, "-f", "-", input=_job("before"))
            before = full_cluster.get_json("vj", "before", "-n", jobs)

            notes = helm("upgrade", RELEASE, str(CHART), "--namespace", system, *args).stdout
            assert field not in _spec_fields(full_cluster), "helm upgrade changed the CRD"
            # NOTES.txt says what to run: the command this test runs below
            assert "kubectl apply --server-side --force-conflicts -f charts/videojob/crds/" in notes, notes
            refused = full_cluster.kubectl("apply", "-n", jobs, "-f", "-", input=_job("after", **{field: text}),
                                           check=False)
            assert refused.returncode != 0 and "unknown field" in refused.stderr and field in refused.stderr, (
                refused.stdout + refused.stderr)
            full_cluster.kubectl("apply", "--validate=false", "-n", jobs, "-f", "-",
                                 input=_job("pruned", **{field: text}))
            assert field not in full_cluster.get_json("vj", "pruned", "-n", jobs)["spec"], "not pruned"

            # the documented path: the new CRD first, then helm upgrade
            full_cluster.kubectl(*documented)
            wait_established(full_cluster, CRD_NAME)
            assert field in _spec_fields(full_cluster)
            wait_for("the API server to serve the new schema", lambda: full_cluster.kubectl(
                "apply", "--dry-run=server", "-n", jobs, "-f", "-", input=_job("after", **{field: text}),
                check=False).returncode == 0, timeout=30, interval=0.5)
            helm("upgrade", RELEASE, str(CHART), "--namespace", system, *args)
            full_cluster.kubectl("apply", "-n", jobs, "-f", "-", input=_job("after", **{field: text}))
            assert full_cluster.get_json("vj", "after", "-n", jobs)["spec"][field] == text
            still = full_cluster.get_json("vj", "before", "-n", jobs)
            assert still["metadata"]["uid"] == before["metadata"]["uid"]
            assert still["spec"] == before["spec"]
            live = full_cluster.get_json("crd", CRD_NAME)["spec"]["versions"]
            assert [v["schema"] for v in live] == [v["schema"] for v in current["spec"]["versions"]]
    finally:
        full_cluster.kubectl(*documented, check=False)


# --- d. the real operator under the chart's ServiceAccount ---------------------------------------

def test_operator_runs_a_job_under_the_charts_rbac_and_inventory(full_cluster, helm, full_namespaces):
    """An `embedded` install (device cpu); the operator runs here, as the ServiceAccount the
    chart made (its token; the chart's Role in the watched namespace is all it is granted),
    with the Deployment's environment and the inventory ConfigMap's file where the pod
    would see them (every absolute path under a temp root); a tiny job Succeeds."""
    pytest.importorskip("ray")
    pytest.importorskip("xfuser")
    from operator_harness import OperatorProcess, create, tiny_job, wait_phase

    system, jobs = full_namespaces(), full_namespaces()
    root = Path(tempfile.mkdtemp(prefix="vj-chart-", dir="/tmp"))  # the pod's filesystem
    try:
        with installed(helm, system, ["-f", str(EMBEDDED_VALUES), "--set", f"watch.namespaces={{{jobs}}}"]):
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
            del env["VIDEOJOB_METRICS_PORT"]  # the harness's free port instead of the pod's 8080
            env["VIDEOJOB_DRIVER_PYTHON"] = sys.executable  # `python` is the runtime image's
            assert env["VIDEOJOB_RAY_MODE"] == "embedded" and env["VIDEOJOB_NAMESPACES"] == jobs

            with OperatorProcess(full_cluster, jobs, root / "work", env, kubeconfig=kubeconfig) as operator:
                try:
                    create(full_cluster, jobs, tiny_job("chart-tiny", steps=2))
                    obj = wait_phase(full_cluster, jobs, "chart-tiny", {"Succeeded", "Failed"}, timeout=300)
                    assert obj["status"]["phase"] == "Succeeded", (obj["status"].get("message"),
                                                                   operator.log()[-3000:])
                finally:
                    # While the operator runs, so that its finalizer lets go (else the namespace hangs).
                    gone = full_cluster.kubectl("delete", "vj", "--all", "-n", jobs, "--wait=true", "--timeout=60s",
                                                check=False, timeout=90)
                    if gone.returncode != 0:
                        full_cluster.kubectl("patch", "vj", "chart-tiny", "-n", jobs, "--type=merge", "-p",
                                             '{"metadata": {"finalizers": null}}', check=False)
            assert obj["status"]["plan"]["gpuClass"] == klass.name
            output = Path(env["VIDEOJOB_OUTPUT_ROOT"]) / "videos" / "chart-tiny" / "chart-tiny.mp4"
            assert output.stat().st_size > 0, output
            roles = [r["metadata"]["name"] for r in full_cluster.get_json("roles", "-n", jobs)["items"]]
            assert roles == [RELEASE], f"the operator's only grant is the chart's Role: {roles}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
