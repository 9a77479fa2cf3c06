"""The Helm chart rendered by helm itself (`helm lint`, `helm template`): no
cluster, only the helm binary from hack/cluster/build-gotool.sh (`make
helm-tool`). Without it the tests skip, or FAIL when VIDEOJOB_REQUIRE_CLUSTER=1.

What rendering must give in every mode (the default values and each ci/ file):
RBAC rules that are files/operator-rbac-rules.yaml; a hardened operator
Deployment whose environment the operator's settings parse; the data claim where
the runtime looks for it, with the access modes the mode needs; no RayCluster
and no drivers' resources outside kuberay mode; inputs staged on the data
volume; a ServiceMonitor only when asked.

Elsewhere: kuberay mode's RayCluster, inventory, drivers and security in
tests/test_chart_kuberay.py; the schema refusing bad values by name in
tests/test_chart_schema.py; the fixtures and helpers they share in
tests/chart_support.py. (tests/test_chart_values.py covers the values file
itself without helm.)"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import PurePosixPath

import pytest
import yaml

from chart_support import (CHART, CI_VALUES, DRIVER_RESOURCE, KUBERAY_CI, MODES, NAMESPACE, RELEASE, TOKEN, VALUES,
                           _inventory, _merged, ci_values, of_kind, one, operator_container, pod_specs,
                           ray_containers)
from chart_support import chart, helm  # noqa: F401 - fixtures
from helpers import env_of
from videojob.settings import OperatorSettings


RBAC_RULES = yaml.safe_load((CHART / "files" / "operator-rbac-rules.yaml").read_text())


def test_ci_values_cover_every_mode():
    assert {ci_values(p.name)["ray"]["mode"] for p in CI_VALUES} == {"embedded", "address", "kuberay"}


@pytest.mark.parametrize("ci", MODES)
def test_lint_strict(chart, ci):
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    result = chart.run(*args, *(["-f", str(CHART / "ci" / ci)] if ci else []))
    assert result.returncode == 0, f"helm lint --strict ({ci or 'default values'}):\n{result.stdout}{result.stderr}"


# --- outside kuberay: no RayCluster, drivers anywhere ----------------------------------------------

@pytest.mark.parametrize("ci", [None, "embedded.yaml", "address.yaml"])
def test_no_raycluster_outside_kuberay(chart, ci, tmp_path):
    docs = chart.render(ci)
    assert not of_kind(docs, "RayCluster")
    assert not of_kind(docs, "NetworkPolicy")
    inventory = _inventory(docs, tmp_path)  # every mode has the inventory
    assert [c.name for c in inventory.classes] == [c["name"] for c in ci_values(ci)["gpuClasses"]]
    assert inventory.device == ("cpu" if ci_values(ci)["ray"]["mode"] == "embedded" else "cuda")


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


# --- inputs staged on the data volume --------------------------------------------------------------

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
    metrics port). Slim-image modes set nothing but operator settings, HOME and
    MALLOC_ARENA_MAX."""
    docs = chart.render(ci)
    values = ci_values(ci)
    mode = values["ray"]["mode"]
    container = operator_container(docs)
    env = env_of(container)
    if mode != "embedded":
        fields = {f"VIDEOJOB_{name.upper()}" for name in OperatorSettings.model_fields}
        others = {"HOME", "MALLOC_ARENA_MAX"}
        assert set(env) - fields == others, f"not operator settings: {sorted(set(env) - fields - others)}"
    # glibc's arenas capped: the operator's freed memory is reused across its threads (docs/performance.md)
    assert env["MALLOC_ARENA_MAX"] == "2"
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
    # The chart sets driverPython in every mode (embedded too): drivers run the runtime image's `python`,
    # never the embedded-mode default of the operator's own interpreter.
    assert settings.driver_interpreter == values["operator"]["settings"]["driverPython"]
    if values["ray"]["auth"].get("existingSecret") and mode != "embedded":
        token = PurePosixPath(settings.ray_token_file)
        mount = next(m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == token.parent)
        volume = next(v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == values["ray"]["auth"]["existingSecret"]
        assert token.name in [i["path"] for i in volume["secret"]["items"]]


@pytest.mark.parametrize("mode", ["embedded", "kuberay"])
@pytest.mark.parametrize("existing", ["", "admins-runtime-key"])
def test_the_operator_and_every_ray_container_read_one_runtime_key(chart, mode, existing):
    """Issue 36, 13/14: the operator seals requests and the ranks sign checkpoints with the
    runtime key: every container that runs either reads VIDEOJOB_RUNTIME_KEY_FILE from a
    read-only mount of the same Secret (the chart's own, kept across upgrades, unless the
    admin names one)."""
    base = TOKEN if mode == "kuberay" else {"ray": {"mode": mode}}
    docs = chart.render(values=_merged(base, {"runtimeKey": {"existingSecret": existing}}))
    made = [d["metadata"]["name"] for d in of_kind(docs, "Secret")]
    secret = existing or f"{RELEASE}-videojob-runtime-key"
    assert made == ([] if existing else [secret])
    if not existing:
        (doc,) = of_kind(docs, "Secret")
        assert len(base64.b64decode(doc["data"]["key"])) == 64
        assert doc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pods = pod_specs(docs)
    assert len(pods) >= (3 if mode == "kuberay" else 1)
    for where, pod in pods:
        for container in pod["containers"]:
            if container["name"] == "autoscaler":
                continue
            path = PurePosixPath(env_of(container)["VIDEOJOB_RUNTIME_KEY_FILE"])
            mount = next(m for m in container["volumeMounts"] if PurePosixPath(m["mountPath"]) == path.parent)
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert mount["readOnly"] and volume["secret"]["secretName"] == secret, where
            assert volume["secret"]["items"] == [{"key": "key", "path": path.name}], where


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


def test_service_monitor_only_when_enabled(chart):
    assert not of_kind(chart.render(), "ServiceMonitor")
    docs = chart.render(values={"metrics": {"serviceMonitor": {"enabled": True}}})
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
