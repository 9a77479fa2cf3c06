"""The Helm chart rendered by helm itself (`helm lint`, `helm template`): no
cluster, only the helm binary from hack/cluster/build-gotool.sh (`make
helm-tool`). Without it the tests skip, or FAIL when VIDEOJOB_REQUIRE_CLUSTER=1.

What rendering must give: in kuberay mode one RayCluster worker group per GPU
class, agreeing with the inventory ConfigMap as the operator's own loader reads
it; RBAC rules that are files/operator-rbac-rules.yaml; a hardened operator
Deployment whose environment the operator's settings parse; the data claim
where the runtime looks for it; and the schema refusing bad values by name.
(tests/test_chart_values.py covers the values file itself without helm.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import pytest
import yaml
from packaging.requirements import Requirement

from helpers import REPO, env_of, helm_binary, inventory_source
from videojob.api.spec import parse_bytes
from videojob.inventory import class_resource, load_inventory
from videojob.settings import OperatorSettings

CHART = REPO / "charts" / "videojob"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RBAC_RULES = yaml.safe_load((CHART / "files" / "operator-rbac-rules.yaml").read_text())
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
RELEASE, NAMESPACE = "vj", "vj-system"
HELM_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


class Helm:
    """helm template with a cache: each distinct set of values renders once per module."""

    def __init__(self, binary: str, tmp: Path):
        self.binary, self.tmp = binary, tmp
        self.cache: dict[str, subprocess.CompletedProcess] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, *args], capture_output=True, text=True, cwd=REPO, timeout=HELM_TIMEOUT_S)

    def template(self, ci: str | None = None, values: dict | None = None) -> subprocess.CompletedProcess:
        key = json.dumps([ci, values], sort_keys=True)
        if key not in self.cache:
            args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
            if ci:
                args += ["-f", str(CHART / "ci" / ci)]
            if values is not None:
                path = self.tmp / f"values-{len(self.cache)}.yaml"
                path.write_text(yaml.safe_dump(values))
                args += ["-f", str(path)]
            self.cache[key] = self.run(*args)
        return self.cache[key]

    def render(self, ci: str | None = None, values: dict | None = None) -> list[dict]:
        result = self.template(ci, values)
        assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
        return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def chart(helm, tmp_path_factory) -> Helm:
    return Helm(helm, tmp_path_factory.mktemp("values"))


def _merged(base: dict, over: dict) -> dict:
    """``over`` over ``base``, maps merged at every depth (as helm merges values files)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def ci_values(ci: str | None, extra: dict | None = None) -> dict:
    """The effective values of a ci file (and ``extra`` values over it)."""
    merged = json.loads(json.dumps(VALUES))
    merged = _merged(merged, yaml.safe_load((CHART / "ci" / ci).read_text()) if ci else {})
    return _merged(merged, extra or {})


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def operator_container(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def class_groups(rc: dict) -> dict[str, dict]:
    """The RayCluster's worker groups of GPU classes (all but the drivers group), by name."""
    return {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] != DRIVERS}


def drivers_group(rc: dict) -> dict:
    (group,) = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == DRIVERS]
    return group


def ray_containers(rc: dict) -> list[tuple[str, dict]]:
    """(where, container) of every Ray container of the RayCluster (head, drivers, classes)."""
    return [(where, pod["containers"][0]) for where, pod in pod_specs([rc])]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod the chart renders."""
    specs = [(f"Deployment/{d['metadata']['name']}", d["spec"]["template"]["spec"])
             for d in of_kind(docs, "Deployment")]
    for rc in of_kind(docs, "RayCluster"):
        specs.append(("RayCluster head", rc["spec"]["headGroupSpec"]["template"]["spec"]))
        specs += [(f"RayCluster group {g['groupName']}", g["template"]["spec"]) for g in rc["spec"]["workerGroupSpecs"]]
    return specs


MODES = [None, *[p.name for p in CI_VALUES]]
KUBERAY_CI = [p.name for p in CI_VALUES if ci_values(p.name)["ray"]["mode"] == "kuberay"]
DRIVERS = "drivers"  # the drivers' worker group, and its Ray resource vj-driver
DRIVER_RESOURCE = "vj-driver"
# kuberay without a token Secret is refused; tests that set other values give one
TOKEN = {"ray": {"mode": "kuberay", "auth": {"existingSecret": "ray-token"}}}


def test_ci_values_cover_every_mode():
    assert {ci_values(p.name)["ray"]["mode"] for p in CI_VALUES} == {"embedded", "address", "kuberay"}


@pytest.mark.parametrize("ci", MODES)
def test_lint_strict(chart, ci):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    result = chart.run(*args, *(["-f", str(CHART / "ci" / ci)] if ci else []))
    assert result.returncode == 0, f"helm lint --strict ({ci or 'default values'}):\n{result.stdout}{result.stderr}"


# --- kuberay: the RayCluster and the inventory ---------------------------------------------

def test_kuberay_worker_group_per_gpu_class(chart):
    """One group per class; its Ray resources in KubeRay's worker-group `resources` field
    (KubeRay 1.5 writes them into `ray start` single-quoted), never as JSON in
    rayStartParams, which KubeRay pastes unquoted into bash (tests/test_chart_install.py
    runs the command KubeRay made through bash)."""
    docs = chart.render("kuberay-gpu.yaml")
    classes = ci_values("kuberay-gpu.yaml")["gpuClasses"]
    assert len(classes) >= 2, "the kuberay ci values should have several GPU classes"
    rc = one(docs, "RayCluster")
    spec = rc["spec"]
    groups = class_groups(rc)
    assert [g["groupName"] for g in spec["workerGroupSpecs"]] == [DRIVERS, *[c["name"] for c in classes]]
    for klass, group in zip(classes, groups.values()):
        where = f"worker group {group['groupName']}"
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == klass["gpusPerPod"], where
        assert group["minReplicas"] == 0, where
        assert group["maxReplicas"] == klass["maxPods"], where
        # replicas belongs to the autoscaler: only an upgrade writes it, the live value
        # (test_chart_install.py); helm template sees no live RayCluster
        assert "replicas" not in group, f"{where}: replicas belongs to the autoscaler"
        assert group["resources"] == {class_resource(klass["name"]): str(klass["gpusPerPod"])}, where
        for flag in ("resources", "num-cpus", "num-gpus", "memory"):
            assert flag not in group["rayStartParams"], f"{where}: {flag} beside the resources field (KubeRay refuses it)"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-cpus") == "0"
    assert head["rayStartParams"].get("num-gpus", "0") == "0"
    for container in head["template"]["spec"]["containers"]:
        for part in ("limits", "requests"):
            assert "nvidia.com/gpu" not in container.get("resources", {}).get(part, {}), "the head has no GPU"
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["version"] == "v2"


@pytest.mark.parametrize("ci", KUBERAY_CI)
def test_kuberay_groups_as_rays_autoscaler_reads_them(chart, ci, tmp_path):
    """Ray's own autoscaler code (ray 2.60, kuberay/autoscaling_config.py, what KubeRay's
    sidecar runs) reads the rendered RayCluster: every class's node type offers its class
    resource and a CPU per rank (a GPU rank's bundle is {GPU: 1, CPU: 1}; a CPU class
    offers gpusPerPod CPUs), the drivers' type only vj-driver slots and no CPU, the head
    no CPU. Before the fix it raised: it drops the first and last character of
    rayStartParams.resources (bare JSON), and a GPU class without a CPU request has no
    CPU count."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    docs = chart.render(ci)
    values = ci_values(ci)
    inventory = _inventory(docs, tmp_path)
    rc = one(docs, "RayCluster")
    types = _derive_autoscaling_config_from_ray_cr(rc)["available_node_types"]
    assert set(types) == {"headgroup", DRIVERS, *[c.name for c in inventory.classes]}
    assert types["headgroup"]["resources"]["CPU"] == 0
    drivers = types[DRIVERS]
    slots = values["ray"]["kuberay"]["drivers"]["slotsPerPod"]
    assert drivers["resources"]["CPU"] == 0 and drivers["resources"][DRIVER_RESOURCE] == slots
    assert "GPU" not in drivers["resources"]
    assert (drivers["min_workers"], drivers["max_workers"]) == (values["ray"]["kuberay"]["drivers"]["minReplicas"],
                                                                  values["ray"]["kuberay"]["drivers"]["maxReplicas"])
    for klass in inventory.classes:
        offered = types[klass.name]["resources"]
        if inventory.uses_class_resources:
            assert offered[klass.resource] == klass.gpus_per_pod, klass.name
        assert offered["CPU"] >= klass.gpus_per_pod, f"{klass.name}: one CPU per rank"
        assert offered.get("GPU", 0) == (klass.gpus_per_pod if inventory.device == "cuda" else 0), klass.name
        assert DRIVER_RESOURCE not in offered, klass.name
        assert types[klass.name]["max_workers"] == klass.max_pods


def test_kuberay_images_and_ray_version(chart):
    """Ray pods run the runtime image (Dockerfile target runtime), the operator the slim
    one, both tagged with appVersion; rayVersion is the Ray that pyproject.toml pins."""
    docs = chart.render("kuberay-gpu.yaml")
    app = CHART_META["appVersion"]
    rc = one(docs, "RayCluster")
    for where, pod in pod_specs([rc]):
        for container in pod["containers"]:
            assert container["image"] == f"{VALUES['image']['runtime']['repository']}:{app}", where
    assert operator_container(docs)["image"] == f"{VALUES['image']['operator']['repository']}:{app}"
    runtime = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["runtime"]
    ray_pin = next(Requirement(r) for r in runtime if Requirement(r).name == "ray")
    assert str(ray_pin.specifier) == f"=={rc['spec']['rayVersion']}"


def _inventory(docs: list[dict], tmp_path: Path):
    """The inventory the operator reads: the file VIDEOJOB_INVENTORY_FILE names, found in
    the ConfigMap the Deployment mounts there, loaded by the operator's own loader."""
    path, configmap_name = inventory_source(one(docs, "Deployment"))
    configmap = next(c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"] == configmap_name)
    local = tmp_path / path.name
    local.write_text(configmap["data"][path.name])
    return load_inventory(str(local))


@pytest.mark.parametrize("ci", KUBERAY_CI)
def test_inventory_configmap_is_the_worker_groups(chart, ci, tmp_path):
    docs = chart.render(ci)
    inventory = _inventory(docs, tmp_path)
    groups = class_groups(one(docs, "RayCluster"))
    assert [c.name for c in inventory.classes] == list(groups)
    cuda = inventory.device == "cuda"
    assert inventory.device == (ci_values(ci)["inventory"]["device"] or "cuda")
    assert inventory.uses_class_resources, "the kuberay examples carry vj-class-<name> in every bundle"
    for klass, values in zip(inventory.classes, ci_values(ci)["gpuClasses"]):
        group = groups[klass.name]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits.get("nvidia.com/gpu") == (klass.gpus_per_pod if cuda else None)
        assert klass.max_pods == group["maxReplicas"]
        assert klass.node.gpu_memory == parse_bytes(values["gpuMemory"])
        offered = {klass.resource: str(klass.gpus_per_pod)} | ({} if cuda else {"CPU": str(klass.gpus_per_pod)})
        assert group["resources"] == offered


def test_kuberay_cpu_values_for_the_end_to_end_test(chart, tmp_path):
    """ci/kuberay-cpu.yaml (the end-to-end test's install): two CPU classes on their own node
    pools, class resources on, no nvidia.com/gpu anywhere, a small object store on every
    Ray node, the token, the shared claim, and operator settings for a fast test."""
    docs = chart.render("kuberay-cpu.yaml")
    inventory = _inventory(docs, tmp_path)
    assert inventory.device == "cpu" and inventory.uses_class_resources
    assert [c.name for c in inventory.classes] == ["cpu-a", "cpu-b"]
    rc = one(docs, "RayCluster")
    for klass, pool in zip(inventory.classes, "ab"):
        assert klass.gpus_per_pod == 2 and klass.max_pods == 1
        group = class_groups(rc)[klass.name]
        assert group["template"]["spec"]["nodeSelector"] == {"videojob.io/e2e-pool": pool}
    # the rest on the system pool (hack/cluster/runner-nodes.yaml), off the classes' nodes
    system = {"videojob.io/e2e-pool": "system"}
    assert rc["spec"]["headGroupSpec"]["template"]["spec"]["nodeSelector"] == system
    assert drivers_group(rc)["template"]["spec"]["nodeSelector"] == system
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["nodeSelector"] == system
    runner_nodes = [n for n in yaml.safe_load_all((REPO / "hack" / "cluster" / "runner-nodes.yaml").read_text()) if n]
    pools = {n["metadata"]["labels"].get("videojob.io/e2e-pool") for n in runner_nodes}
    assert {"system", "a", "b"} <= pools, f"the pod runner's nodes lack a pool the file selects: {pools}"
    for where, container in ray_containers(rc):
        for part in ("limits", "requests"):
            assert "nvidia.com/gpu" not in container["resources"].get(part, {}), where
        assert parse_bytes(container["resources"]["requests"]["memory"]) <= 2**30, f"{where}: a small request"
    starts = [rc["spec"]["headGroupSpec"]["rayStartParams"], *[g["rayStartParams"] for g in rc["spec"]["workerGroupSpecs"]]]
    assert all(50e6 <= int(p["object-store-memory"]) <= 200e6 for p in starts), starts
    assert rc["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] == 15
    values = ci_values("kuberay-cpu.yaml")
    assert values["ray"]["auth"]["existingSecret"] == "videojob-ray-token"
    assert one(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    env = env_of(operator_container(docs))
    assert (env["VIDEOJOB_CPUS_PER_RANK"], env["VIDEOJOB_WARM_GROUP_TTL_S"], env["VIDEOJOB_PLACEMENT_TIMEOUT_S"],
            env["VIDEOJOB_POLL_INTERVAL_S"]) == ("1", "5", "5", "0.5")
    assert values["image"] == VALUES["image"], "the pod runner maps the chart's default images"


@pytest.mark.parametrize("ci", KUBERAY_CI)
def test_a_driver_may_wait_for_its_slot_as_long_as_a_placement(chart, ci):
    """Ray's job manager fails a job whose JobSupervisor waits more than
    RAY_JOB_START_TIMEOUT_SECONDS (15 min by default) for its entrypoint resources; a
    driver waiting for a vj-driver slot must not be failed before a placement would be."""
    docs = chart.render(ci)
    wait = int(ci_values(ci)["operator"]["settings"]["placementMaxWaitS"])
    for where, container in ray_containers(one(docs, "RayCluster")):
        assert env_of(container)["RAY_JOB_START_TIMEOUT_SECONDS"] == str(wait), where
    docs = chart.render(ci, {"operator": {"settings": {"placementMaxWaitS": 7200}}})
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert env_of(head)["RAY_JOB_START_TIMEOUT_SECONDS"] == "7200"


@pytest.mark.parametrize("ci", [None, "embedded.yaml", "address.yaml"])
def test_no_raycluster_outside_kuberay(chart, ci, tmp_path):
    docs = chart.render(ci)
    assert not of_kind(docs, "RayCluster")
    assert not of_kind(docs, "NetworkPolicy")
    inventory = _inventory(docs, tmp_path)  # every mode has the inventory
    assert [c.name for c in inventory.classes] == [c["name"] for c in ci_values(ci)["gpuClasses"]]
    assert inventory.device == ("cpu" if ci_values(ci)["ray"]["mode"] == "embedded" else "cuda")


# --- kuberay: drivers off the head, inputs staged on the data volume --------------------------------

@pytest.mark.parametrize("ci", KUBERAY_CI)
def test_drivers_run_on_their_own_group(chart, ci, monkeypatch):
    """A CPU-only `drivers` group advertising vj-driver = slotsPerPod and no CPU (no rank
    lands there), scaled by the autoscaler like the class groups; the operator makes every
    driver ask for one vj-driver (VIDEOJOB_DRIVER_RESOURCES, read by its own settings), so
    no driver or JobSupervisor runs on the head."""
    docs = chart.render(ci)
    values = ci_values(ci)["ray"]["kuberay"]["drivers"]
    rc = one(docs, "RayCluster")
    group = drivers_group(rc)
    assert group["resources"] == {"CPU": "0", DRIVER_RESOURCE: str(values["slotsPerPod"])}
    assert (group["minReplicas"], group["maxReplicas"]) == (values["minReplicas"], values["maxReplicas"])
    assert "replicas" not in group
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"] == values["resources"]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert group["rayStartParams"] == values["rayStartParams"]
    # the same runtime environment, volumes and token as the other Ray containers
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    (_, klass), *_ = class_groups(rc).items()
    worker = klass["template"]["spec"]
    assert env_of(container) == env_of(worker["containers"][0]) == env_of(head["containers"][0])
    assert container["volumeMounts"] == worker["containers"][0]["volumeMounts"]
    assert group["template"]["spec"]["volumes"] == worker["volumes"]

    env = env_of(operator_container(docs))
    assert json.loads(env["VIDEOJOB_DRIVER_RESOURCES"]) == {DRIVER_RESOURCE: 1}
    for name in [n for n in os.environ if n.startswith("VIDEOJOB_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("VIDEOJOB_DRIVER_RESOURCES", env["VIDEOJOB_DRIVER_RESOURCES"])
    assert OperatorSettings().entrypoint_resources == {DRIVER_RESOURCE: 1.0}
    # more resources of the user's own are kept beside it
    docs = chart.render(ci, {"operator": {"settings": {"driverResources": {"pool-x": 0.5}}}})
    env = env_of(operator_container(docs))
    assert json.loads(env["VIDEOJOB_DRIVER_RESOURCES"]) == {DRIVER_RESOURCE: 1, "pool-x": 0.5}


@pytest.mark.parametrize("ci", [None, "embedded.yaml", "address.yaml"])
def test_drivers_ask_for_nothing_outside_kuberay(chart, ci, monkeypatch):
    """No drivers' group there: a driver runs wherever Ray puts it (the embedded head, or
    the address cluster's choice), unless operator.settings.driverResources says otherwise."""
    for name in [n for n in os.environ if n.startswith("VIDEOJOB_")]:
        monkeypatch.delenv(name)
    env = env_of(operator_container(chart.render(ci)))
    if "VIDEOJOB_DRIVER_RESOURCES" in env:
        monkeypatch.setenv("VIDEOJOB_DRIVER_RESOURCES", env["VIDEOJOB_DRIVER_RESOURCES"])
    assert OperatorSettings().entrypoint_resources == {}
    mine = {"vj-driver-pool": 2}
    env = env_of(operator_container(chart.render(ci, {"operator": {"settings": {"driverResources": mine}}})))
    assert json.loads(env["VIDEOJOB_DRIVER_RESOURCES"]) == mine


@pytest.mark.parametrize("ci", [*KUBERAY_CI, "embedded.yaml"])
def test_inputs_are_staged_on_the_data_volume(chart, ci, monkeypatch):
    """https inputs: the driver fetches them into VIDEOJOB_INPUT_STAGING_ROOT, which the
    runtime's settings read; in every container that runs the runtime it is the same
    directory of the data volume, so ranks on other pods read what the driver fetched."""
    from videojob.settings import RunSettings

    docs = chart.render(ci)
    if of_kind(docs, "RayCluster"):
        containers = ray_containers(one(docs, "RayCluster"))
    else:
        containers = [("operator", operator_container(docs))]
    pods = dict(pod_specs(docs))
    roots = set()
    for where, container in containers:
        monkeypatch.setenv("VIDEOJOB_INPUT_STAGING_ROOT", env_of(container)["VIDEOJOB_INPUT_STAGING_ROOT"])
        root = PurePosixPath(RunSettings().input_staging_root)
        roots.add(root)
        data = {v["name"] for v in pods[where if where != "operator" else next(iter(pods))]["volumes"]
                if "persistentVolumeClaim" in v}
        mounts = [PurePosixPath(m["mountPath"]) for m in container["volumeMounts"] if m["name"] in data]
        assert any(root.is_relative_to(m) and root != m for m in mounts), f"{where}: {root} not on {mounts}"
    assert len(roots) == 1, roots


# --- kuberay: security ------------------------------------------------------------------------------

def test_kuberay_requires_a_token(chart):
    """The schema refuses kuberay mode without ray.auth.existingSecret, naming it; with
    schema validation skipped the template says what to do."""
    result = chart.template(values={"ray": {"mode": "kuberay"}})
    assert result.returncode != 0, "kuberay without a token was accepted"
    assert "/ray/auth/existingSecret" in result.stderr, result.stderr
    skipped = chart.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--skip-schema-validation",
                        "--set", "ray.mode=kuberay")
    assert skipped.returncode != 0
    assert "ray.auth.existingSecret" in skipped.stderr and "kubectl create secret" in skipped.stderr, skipped.stderr
    docs = chart.render(values=TOKEN)
    for where, container in ray_containers(one(docs, "RayCluster")):
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", where
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "ray-token", where


@pytest.mark.parametrize("ci", KUBERAY_CI)
def test_network_policy_lets_in_only_the_operator_and_ray(chart, ci):
    """Ray pods (every pod KubeRay makes carries ray.io/cluster) take traffic only from the
    RayCluster's own pods and, on the dashboard port, from the operator pod. The loopback
    test cluster has no CNI that enforces it: test_chart_install.py checks the object the
    API server accepted, not traffic."""
    docs = chart.render(ci)
    rc = one(docs, "RayCluster")
    policy = one(docs, "NetworkPolicy")
    own = {"ray.io/cluster": rc["metadata"]["name"]}
    assert policy["spec"]["podSelector"] == {"matchLabels": own}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    among, operator = policy["spec"]["ingress"]
    assert among == {"from": [{"podSelector": {"matchLabels": own}}]}
    operator_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    (peer,) = operator["from"]
    assert peer.keys() == {"podSelector"} and peer["podSelector"]["matchLabels"].items() <= operator_labels.items()
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    dashboard = next(p["containerPort"] for p in head["ports"] if p["name"] == "dashboard")
    assert operator["ports"] == [{"protocol": "TCP", "port": dashboard}]
    assert urlparse(env_of(operator_container(docs))["VIDEOJOB_RAY_DASHBOARD_URL"]).port == dashboard
    # the operator pod itself is not a Ray pod
    assert not own.items() <= operator_labels.items()

    extra = {"from": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}], "ports": [{"port": 8080}]}
    docs = chart.render(ci, {"ray": {"kuberay": {"networkPolicy": {"extraIngress": [extra]}}}})
    assert one(docs, "NetworkPolicy")["spec"]["ingress"][2:] == [extra]
    docs = chart.render(ci, {"ray": {"kuberay": {"networkPolicy": {"enabled": False}}}})
    assert not of_kind(docs, "NetworkPolicy")


@pytest.mark.parametrize("ci", KUBERAY_CI)
def test_service_account_token_only_in_the_autoscaler(chart, ci):
    """The operator mounts its token; Ray pods mount none (automountServiceAccountToken:
    false), but the head pod has a projected token volume (token, the cluster CA, the
    namespace: what kube-api-access holds) that only KubeRay's autoscaler sidecar mounts,
    at the path Ray's autoscaler reads (autoscalerOptions.volumeMounts)."""
    from ray.autoscaler._private.kuberay import node_provider

    docs = chart.render(ci)
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    rc = one(docs, "RayCluster")
    for where, pod in pod_specs([rc]):
        assert pod["automountServiceAccountToken"] is False, where
        assert "serviceAccountName" not in pod, f"{where}: KubeRay names the head's (the autoscaler's role)"
        for container in pod["containers"]:
            assert not any(m["mountPath"].startswith("/var/run/secrets/kubernetes.io") for m in container["volumeMounts"])
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    (mount,) = [m for m in rc["spec"]["autoscalerOptions"]["volumeMounts"] if m["mountPath"] != "/tmp"]
    token_dir = PurePosixPath(node_provider.IN_CLUSTER_TOKEN_PATH).parent
    assert PurePosixPath(mount["mountPath"]) == token_dir == PurePosixPath(node_provider.IN_CLUSTER_CA_CERT_PATH).parent
    assert mount["readOnly"] is True
    (volume,) = [v for v in head["volumes"] if v["name"] == mount["name"]]
    sources = volume["projected"]["sources"]
    assert {"serviceAccountToken": {"path": PurePosixPath(node_provider.IN_CLUSTER_TOKEN_PATH).name,
                                    "expirationSeconds": 3607}} in sources
    paths = {i["path"] for s in sources for i in (s.get("configMap") or s.get("downwardAPI") or {}).get("items", [])}
    assert paths == {"ca.crt", "namespace"}
    assert not any(v["name"] == mount["name"] for _, p in pod_specs([rc])[1:] for v in p["volumes"])


# --- RBAC -----------------------------------------------------------------------------------

@pytest.mark.parametrize("ci", MODES)
def test_rbac_rules_are_the_rules_file(chart, ci):
    docs = chart.render(ci)
    values = ci_values(ci)
    sa = one(docs, "ServiceAccount")["metadata"]["name"]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == sa
    if values["watch"].get("clusterWide"):
        role, binding = one(docs, "ClusterRole"), one(docs, "ClusterRoleBinding")
        assert not of_kind(docs, "Role")
        pairs = [(role, binding)]
    else:
        assert not of_kind(docs, "ClusterRole")
        roles, bindings = of_kind(docs, "Role"), of_kind(docs, "RoleBinding")
        expected = values["watch"].get("namespaces") or [NAMESPACE]
        assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(expected)
        by_ns = {b["metadata"]["namespace"]: b for b in bindings}
        pairs = [(r, by_ns[r["metadata"]["namespace"]]) for r in roles]
    for role, binding in pairs:
        assert role["rules"] == RBAC_RULES
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"],
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]


# --- the operator Deployment ----------------------------------------------------------------

@pytest.mark.parametrize("ci", MODES)
def test_operator_deployment_is_single_and_hardened(chart, ci):
    docs = chart.render(ci)
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    resources = operator_container(docs)["resources"]
    assert resources.get("requests") and resources.get("limits"), f"operator resources: {resources}"
    for where, pod in pod_specs(docs):
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        containers = pod["containers"] + pod.get("initContainers", [])
        for container in containers:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, f"{where} {container['name']}"
            assert context["capabilities"]["drop"] == ["ALL"], f"{where} {container['name']}"
            assert context["allowPrivilegeEscalation"] is False, f"{where} {container['name']}"


@pytest.mark.parametrize("ci", MODES)
def test_operator_env_is_what_the_operator_reads(chart, ci, monkeypatch):
    """The rendered environment, read by the operator's own settings model: values
    survive the rendering (whole-number floats, lists), and they point where the
    chart put things (the RayCluster's head Service, the watched namespaces, the
    metrics port). Slim-image modes set nothing but operator settings and HOME."""
    docs = chart.render(ci)
    values = ci_values(ci)
    mode = values["ray"]["mode"]
    container = operator_container(docs)
    env = env_of(container)
    if mode != "embedded":
        fields = {f"VIDEOJOB_{name.upper()}" for name in OperatorSettings.model_fields}
        assert set(env) - fields == {"HOME"}, f"not operator settings: {sorted(set(env) - fields - {'HOME'})}"
    for name in [n for n in os.environ if n.startswith("VIDEOJOB_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("VIDEOJOB_"):
            monkeypatch.setenv(name, value)
    settings = OperatorSettings()
    assert settings.ray_mode == ("embedded" if mode == "embedded" else "address")
    if mode == "kuberay":
        head_service = f"{one(docs, 'RayCluster')['metadata']['name']}-head-svc"  # KubeRay's name for it
        assert settings.ray_dashboard_url == f"http://{head_service}.{NAMESPACE}.svc:8265"
    elif mode == "address":
        assert settings.ray_dashboard_url == values["ray"]["address"]
    if values["watch"].get("clusterWide"):
        assert settings.namespaces == [] and "--all-namespaces" in container["args"]
    else:
        assert settings.namespaces == (values["watch"].get("namespaces") or [NAMESPACE])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert settings.metrics_port == ports["metrics"]
    for key, value in values["operator"]["settings"].items():
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()
        if key == "driverResources" and mode == "kuberay":  # one slot of the drivers' group, always
            value = {**(value or {}), DRIVER_RESOURCE: 1}
        assert getattr(settings, name) == value, f"operator.settings.{key}"
    if values["ray"]["auth"].get("existingSecret") and mode != "embedded":
        token = PurePosixPath(settings.ray_token_file)
        mount = next(m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == token.parent)
        volume = next(v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == values["ray"]["auth"]["existingSecret"]
        assert token.name in [i["path"] for i in volume["secret"]["items"]]


def test_address_mode_requires_an_address(chart):
    result = chart.template(values={"ray": {"mode": "address"}})
    assert result.returncode != 0
    assert re.search(r"ray[./]address", result.stderr), result.stderr


# --- persistence and metrics ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["embedded", "kuberay"])
def test_existing_claim_is_mounted_not_created(chart, mode, monkeypatch):
    """No PVC; every pod that runs the runtime mounts the claim where pvc://<claim>/...
    resolves (runtime/videojob_runtime/locations.py), and local:// outputs land on it."""
    from videojob_runtime import locations

    claim = "shared-videos"
    docs = chart.render(values=_merged(TOKEN if mode == "kuberay" else {"ray": {"mode": mode}},
                                       {"persistence": {"existingClaim": claim}}))
    assert not of_kind(docs, "PersistentVolumeClaim")
    runtime_pods = [(w, p) for w, p in pod_specs(docs) if mode == "embedded" or w.startswith("RayCluster")]
    assert runtime_pods
    for where, pod in runtime_pods:
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        assert set(claims.values()) == {claim}, where
        container = pod["containers"][0]
        mounts = [PurePosixPath(m["mountPath"]) for m in container["volumeMounts"] if m["name"] in claims]
        env = env_of(container)
        monkeypatch.setenv("VIDEOJOB_VOLUMES_ROOT", env["VIDEOJOB_VOLUMES_ROOT"])
        monkeypatch.setenv("VIDEOJOB_OUTPUT_ROOT", env["VIDEOJOB_OUTPUT_ROOT"])
        for uri in (f"pvc://{claim}/videos/a", "local://videos/a"):
            path = PurePosixPath(locations.resolve(uri, "output", "spec.output.uri"))
            assert any(path.is_relative_to(m) for m in mounts), f"{where}: {uri} -> {path}, mounts {mounts}"


def test_default_creates_the_claim_it_mounts(chart):
    docs = chart.render()
    pvc = one(docs, "PersistentVolumeClaim")
    volumes = one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
    assert pvc["metadata"]["name"] in [v.get("persistentVolumeClaim", {}).get("claimName") for v in volumes]


@pytest.mark.parametrize("ci,modes", [
    (None, ["ReadWriteOnce"]), ("embedded.yaml", ["ReadWriteOnce"]), *[(ci, ["ReadWriteMany"]) for ci in KUBERAY_CI],
])
def test_claim_access_modes_follow_the_mode(chart, ci, modes):
    """Empty persistence.accessModes (the default): ReadWriteMany where the head, driver and
    worker pods on several nodes mount the claim (kuberay), ReadWriteOnce where one pod does."""
    assert VALUES["persistence"]["accessModes"] == []
    docs = chart.render(ci, {"persistence": {"accessModes": []}})
    assert one(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == modes


def test_kuberay_claim_without_read_write_many_is_refused(chart):
    """The schema refuses a kuberay claim that only one node can mount, naming the value; with
    schema validation skipped the template says the value and the fix. Explicit lists with
    ReadWriteMany pass, and other modes may use ReadWriteOnce."""
    bad = _merged(TOKEN, {"persistence": {"accessModes": ["ReadWriteOnce"]}})
    result = chart.template(values=bad)
    assert result.returncode != 0, "kuberay with a ReadWriteOnce claim was accepted"
    assert "/persistence/accessModes" in result.stderr, result.stderr
    skipped = chart.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--skip-schema-validation",
                        "--set", "ray.mode=kuberay", "--set", "ray.auth.existingSecret=t",
                        "--set", "persistence.accessModes={ReadWriteOnce}")
    assert skipped.returncode != 0
    assert "persistence.accessModes" in skipped.stderr and "ReadWriteMany" in skipped.stderr, skipped.stderr
    good = _merged(TOKEN, {"persistence": {"accessModes": ["ReadWriteMany", "ReadOnlyMany"]}})
    assert one(chart.render(values=good), "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany",
                                                                                              "ReadOnlyMany"]
    rwo = {"ray": {"mode": "embedded"}, "persistence": {"accessModes": ["ReadWriteOnce"]}}
    assert one(chart.render(values=rwo), "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    # an existing claim is the user's (README: it must be ReadWriteMany); the chart makes none
    existing = _merged(TOKEN, {"persistence": {"existingClaim": "shared"}})
    assert not of_kind(chart.render(values=existing), "PersistentVolumeClaim")


def test_service_monitor_only_when_enabled(chart):
    assert not of_kind(chart.render(), "ServiceMonitor")
    docs = chart.render(values={"metrics": {"serviceMonitor": {"enabled": True}}})
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


# --- the schema ---------------------------------------------------------------------------------

def _class(**overrides) -> dict:
    klass = {"name": "a100-80", "gpuMemory": "80Gi", "gpusPerPod": 8, "maxPods": 1, "hostMemory": "1Ti"}
    klass.update(overrides)
    return {k: v for k, v in klass.items() if v is not None}


@pytest.mark.parametrize("values,problem", [
    ({"bogusKey": 1}, r"bogusKey"),
    ({"ray": {"mode": "bogus"}}, r"/ray/mode.*(embedded|one of)"),
    ({"gpuClasses": [_class(gpusPerPod=-1)]}, r"/gpuClasses/0/gpusPerPod"),
    ({"gpuClasses": [_class(gpuMemory=None)]}, r"/gpuClasses/0.*gpuMemory"),
], ids=["unknown-key", "bad-mode", "negative-gpus", "no-gpu-memory"])
def test_schema_refuses(chart, values, problem):
    result = chart.template(values=values)
    assert result.returncode != 0, f"helm template accepted {values}"
    assert re.search(problem, result.stderr), f"the error does not name the problem ({problem}):\n{result.stderr}"


def test_extra_ray_start_params(chart):
    """Extra `ray start` flags for the head, the drivers and each class land in their
    rayStartParams (strings, as KubeRay takes them); the chart's own head flags stay."""
    store = {"object-store-memory": "100000000"}
    values = _merged(TOKEN, {"ray": {"kuberay": {"head": {"rayStartParams": store},
                                                 "drivers": {"rayStartParams": {"temp-dir": "/tmp/ray"}}}},
                             "gpuClasses": [_class(rayStartParams={**store, "system-config": "'{\"a\": 1}'"})]})
    rc = one(chart.render(values=values), "RayCluster")
    assert rc["spec"]["headGroupSpec"]["rayStartParams"] == {"num-cpus": "0", "dashboard-host": "0.0.0.0", **store}
    assert drivers_group(rc)["rayStartParams"] == {"temp-dir": "/tmp/ray"}
    assert class_groups(rc)["a100-80"]["rayStartParams"] == {**store, "system-config": "'{\"a\": 1}'"}


@pytest.mark.parametrize("values,problem", [
    ({"gpuClasses": [_class(rayStartParams={"num-cpus": "4"})]}, r"/gpuClasses/0/rayStartParams"),
    ({"gpuClasses": [_class(rayStartParams={"resources": "'{\"x\": 1}'"})]}, r"/gpuClasses/0/rayStartParams"),
    ({"ray": {"kuberay": {"drivers": {"rayStartParams": {"memory": "1000"}}}}}, r"/ray/kuberay/drivers/rayStartParams"),
    ({"ray": {"kuberay": {"head": {"rayStartParams": {"system-config": '{"a": 1}'}}}}},
     r"/ray/kuberay/head/rayStartParams/system-config"),
    ({"ray": {"kuberay": {"head": {"rayStartParams": {"object-store-memory": 100000000}}}}},
     r"/ray/kuberay/head/rayStartParams/object-store-memory"),
    ({"gpuClasses": [_class(name="drivers")]}, r"/gpuClasses/0/name"),
], ids=["class-num-cpus", "class-resources", "drivers-memory", "unquoted-json", "not-a-string", "class-drivers"])
def test_schema_refuses_ray_start_params_kuberay_sets_or_bash_breaks(chart, values, problem):
    """Flags the group's `resources` field sets (KubeRay refuses both), flags KubeRay writes,
    values bash would mangle (double-quoted JSON outside single quotes), non-strings, and a
    class named like the drivers' group."""
    result = chart.template(values=_merged(TOKEN, values))
    assert result.returncode != 0, f"helm template accepted {values}"
    assert re.search(problem, result.stderr), f"the error does not name the problem ({problem}):\n{result.stderr}"


def test_schema_accepts_the_valid_class(chart):
    """The refusals above are the changed field's, not of the base class they start from."""
    chart.render(values={"gpuClasses": [_class()]})
