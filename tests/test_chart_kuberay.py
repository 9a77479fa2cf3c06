"""The Helm chart in kuberay mode, rendered by `helm template` (no cluster; the helm
binary as in tests/test_chart.py): one RayCluster worker group per GPU class,
agreeing with the inventory ConfigMap as the operator's own loader reads it and
as Ray's own autoscaler code reads the groups; the images and Ray's version; the
end-to-end test's values; the drivers' group, off the head, and the time a
driver may wait for its slot; extra `ray start` flags; and security: the
NetworkPolicy and the ServiceAccount token only in the autoscaler. Fixtures and
helpers: tests/chart_support.py."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import PurePosixPath
from urllib.parse import urlparse

import pytest
import yaml
from packaging.requirements import Requirement

from chart_support import (CHART_META, DRIVER_RESOURCE, DRIVERS, KUBERAY_CI, TOKEN, VALUES, _class, _inventory,
                           _merged, ci_values, class_groups, drivers_group, of_kind, one, operator_container,
                           pod_specs, ray_containers)
from chart_support import chart, helm  # noqa: F401 - fixtures
from helpers import REPO, env_of
from videojob.api.spec import parse_bytes
from videojob.inventory import class_resource
from videojob.settings import OperatorSettings


# --- kuberay: the RayCluster and the inventory ---------------------------------------------

def test_kuberay_worker_group_per_gpu_class(chart):
    """One group per class; its Ray resources in KubeRay's worker-group `resources` field
    (KubeRay 1.5 writes them into `ray start` single-quoted), never as JSON in
    rayStartParams, which KubeRay pastes unquoted into bash (tests/test_chart_install_kuberay.py
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
        # and a stopped driver has 10 s to tear its group down before Ray SIGKILLs it
        assert env_of(container)["RAY_JOB_STOP_WAIT_TIME_S"] == "10", where
    docs = chart.render(ci, {"operator": {"settings": {"placementMaxWaitS": 7200}}})
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert env_of(head)["RAY_JOB_START_TIMEOUT_SECONDS"] == "7200"


# --- kuberay: drivers off the head, extra `ray start` flags ----------------------------------------

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


# --- kuberay: security ------------------------------------------------------------------------------

@pytest.mark.parametrize("ci", KUBERAY_CI)
def test_network_policy_lets_in_only_the_operator_and_ray(chart, ci):
    """Ray pods (every pod KubeRay makes carries ray.io/cluster) take traffic only from the
    RayCluster's own pods and, on the dashboard port, from the operator pod. The loopback
    test cluster has no CNI that enforces it: test_chart_install_kuberay.py checks the object the
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
