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


def ci_values(ci: str | None) -> dict:
    """The effective values of a ci file: its keys over values.yaml (one level deep is enough here)."""
    merged = json.loads(json.dumps(VALUES))
    for key, value in (yaml.safe_load((CHART / "ci" / ci).read_text()) if ci else {}).items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def operator_container(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod the chart renders."""
    specs = [(f"Deployment/{d['metadata']['name']}", d["spec"]["template"]["spec"])
             for d in of_kind(docs, "Deployment")]
    for rc in of_kind(docs, "RayCluster"):
        specs.append(("RayCluster head", rc["spec"]["headGroupSpec"]["template"]["spec"]))
        specs += [(f"RayCluster group {g['groupName']}", g["template"]["spec"]) for g in rc["spec"]["workerGroupSpecs"]]
    return specs


MODES = [None, *[p.name for p in CI_VALUES]]


def test_ci_values_cover_every_mode():
    assert {ci_values(p.name)["ray"]["mode"] for p in CI_VALUES} == {"embedded", "address", "kuberay"}


@pytest.mark.parametrize("ci", MODES)
def test_lint_strict(chart, ci):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    result = chart.run(*args, *(["-f", str(CHART / "ci" / ci)] if ci else []))
    assert result.returncode == 0, f"helm lint --strict ({ci or 'default values'}):\n{result.stdout}{result.stderr}"


# --- kuberay: the RayCluster and the inventory ---------------------------------------------

def test_kuberay_worker_group_per_gpu_class(chart):
    docs = chart.render("kuberay-gpu.yaml")
    classes = ci_values("kuberay-gpu.yaml")["gpuClasses"]
    assert len(classes) >= 2, "the kuberay ci values should have several GPU classes"
    spec = one(docs, "RayCluster")["spec"]
    groups = spec["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == [c["name"] for c in classes]
    for klass, group in zip(classes, groups):
        where = f"worker group {group['groupName']}"
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == klass["gpusPerPod"], where
        assert group["minReplicas"] == 0, where
        assert group["maxReplicas"] == klass["maxPods"], where
        # replicas belongs to the autoscaler: only an upgrade writes it, the live value
        # (test_chart_install.py); helm template sees no live RayCluster
        assert "replicas" not in group, f"{where}: replicas belongs to the autoscaler"
        resources = json.loads(group["rayStartParams"]["resources"])
        assert resources == {class_resource(klass["name"]): klass["gpusPerPod"]}, where
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-cpus") == "0"
    assert head["rayStartParams"].get("num-gpus", "0") == "0"
    for container in head["template"]["spec"]["containers"]:
        for part in ("limits", "requests"):
            assert "nvidia.com/gpu" not in container.get("resources", {}).get(part, {}), "the head has no GPU"
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["version"] == "v2"


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


def test_inventory_configmap_is_the_worker_groups(chart, tmp_path):
    docs = chart.render("kuberay-gpu.yaml")
    inventory = _inventory(docs, tmp_path)
    groups = {g["groupName"]: g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}
    assert [c.name for c in inventory.classes] == list(groups)
    assert inventory.device == "cuda" and inventory.uses_class_resources
    for klass, values in zip(inventory.classes, ci_values("kuberay-gpu.yaml")["gpuClasses"]):
        group = groups[klass.name]
        assert klass.gpus_per_pod == group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert klass.max_pods == group["maxReplicas"]
        assert klass.node.gpu_memory == parse_bytes(values["gpuMemory"])
        assert json.loads(group["rayStartParams"]["resources"]) == {klass.resource: klass.gpus_per_pod}


@pytest.mark.parametrize("ci", [None, "embedded.yaml", "address.yaml"])
def test_no_raycluster_outside_kuberay(chart, ci, tmp_path):
    docs = chart.render(ci)
    assert not of_kind(docs, "RayCluster")
    inventory = _inventory(docs, tmp_path)  # every mode has the inventory
    assert [c.name for c in inventory.classes] == [c["name"] for c in ci_values(ci)["gpuClasses"]]
    assert inventory.device == ("cpu" if ci_values(ci)["ray"]["mode"] == "embedded" else "cuda")


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
    for key in VALUES["operator"]["settings"]:
        name = re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()
        assert getattr(settings, name) == OperatorSettings.model_fields[name].default, f"operator.settings.{key}"
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
    docs = chart.render(values={"ray": {"mode": mode}, "persistence": {"existingClaim": claim}})
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


def test_schema_accepts_the_valid_class(chart):
    """The refusals above are the changed field's, not of the base class they start from."""
    chart.render(values={"gpuClasses": [_class()]})
