"""The chart in kueue admission mode: Kueue's objects from the same gpuClasses, the
RBAC it adds and nothing more, and the shared model roots of the runtime.

What the rendered objects do is tested against real Kueue in
tests/test_kueue_cluster.py and tests/test_kueue_operator.py; this checks what
the chart renders from its values.
"""

from __future__ import annotations

import pytest
import yaml

from chart_support import CHART, NAMESPACE, of_kind, one, operator_container
from chart_support import chart, helm  # noqa: F401 - fixtures
from videojob.inventory import parse_inventory

CLASSES = [
    {"name": "a100-80", "gpuMemory": "80Gi", "gpusPerPod": 8, "maxPods": 2, "hostMemory": "1Ti",
     "nodeSelector": {"gpu": "a100-80"}},
    {"name": "l4", "gpuMemory": "24Gi", "gpusPerPod": 4, "maxPods": 3, "hostMemory": "256Gi"},
]
KUEUE = {"operator": {"settings": {"admission": "kueue"}}, "gpuClasses": CLASSES,
         "ray": {"mode": "address", "address": "http://ray-head:8265"},
         "inventory": {"device": "cuda"}}
BASE_RULES = yaml.safe_load((CHART / "files" / "operator-rbac-rules.yaml").read_text())
KUEUE_RULES = yaml.safe_load((CHART / "files" / "operator-rbac-rules-kueue.yaml").read_text())
KUEUE_CLUSTER_RULES = yaml.safe_load((CHART / "files" / "operator-rbac-rules-kueue-cluster.yaml").read_text())


def _env(docs) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in operator_container(docs)["env"]}


def test_kueue_mode_renders_a_flavor_per_class_a_cluster_queue_and_local_queues(chart):
    values = {**KUEUE, "kueue": {"clusterQueue": {"name": "fleet-gpus", "cohort": "fleet"}, "localQueue": "gpus"},
              "watch": {"namespaces": ["team-a", "team-b"]}}
    docs = chart.render(None, values)
    flavors = {f["metadata"]["name"]: f["spec"] for f in of_kind(docs, "ResourceFlavor")}
    assert flavors == {"a100-80": {"nodeLabels": {"gpu": "a100-80"}}, "l4": {}}
    queue = one(docs, "ClusterQueue")
    assert queue["metadata"]["name"] == "fleet-gpus" and queue["spec"]["cohortName"] == "fleet"
    (group,) = queue["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["nvidia.com/gpu", "cpu", "memory"]
    gpus = {f["name"]: next(r["nominalQuota"] for r in f["resources"] if r["name"] == "nvidia.com/gpu")
            for f in group["flavors"]}
    assert gpus == {"a100-80": 16, "l4": 12}  # gpusPerPod x maxPods
    local = {(q["metadata"]["namespace"], q["metadata"]["name"]): q["spec"] for q in of_kind(docs, "LocalQueue")}
    assert local == {("team-a", "gpus"): {"clusterQueue": "fleet-gpus"},
                     ("team-b", "gpus"): {"clusterQueue": "fleet-gpus"}}
    env = _env(docs)
    assert env["VIDEOJOB_ADMISSION"] == "kueue" and env["VIDEOJOB_KUEUE_DEFAULT_QUEUE"] == "default"
    # The inventory the operator reads carries the selector its Workloads' pod sets use.
    inventory = yaml.safe_load(one(docs, "ConfigMap")["data"]["inventory.yaml"])
    assert parse_inventory(inventory).get("a100-80").node_selector == (("gpu", "a100-80"),)


def test_kueue_rbac_adds_only_what_kueue_mode_calls(chart):
    builtin = chart.render(None, {k: v for k, v in KUEUE.items() if k != "operator"})
    assert not of_kind(builtin, "ResourceFlavor") and not of_kind(builtin, "ClusterQueue")
    assert one(builtin, "Role")["rules"] == BASE_RULES
    docs = chart.render(None, KUEUE)
    assert one(docs, "Role")["rules"] == BASE_RULES + KUEUE_RULES
    role = one(docs, "ClusterRole")
    assert role["rules"] == KUEUE_CLUSTER_RULES
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    verbs = {(r, v) for rule in KUEUE_RULES + KUEUE_CLUSTER_RULES for r in rule["resources"] for v in rule["verbs"]}
    assert verbs == {("workloads", "get"), ("workloads", "list"), ("workloads", "watch"), ("workloads", "create"),
                     ("workloads", "delete"),
                     ("workloads/status", "patch"), ("workloadpriorityclasses", "create"),
                     ("resourceflavors", "list")}


def test_no_local_queue_or_cluster_queue_when_their_names_are_empty(chart):
    docs = chart.render(None, {**KUEUE, "kueue": {"clusterQueue": {"name": ""}, "localQueue": ""}})
    assert len(of_kind(docs, "ResourceFlavor")) == 2
    assert not of_kind(docs, "ClusterQueue") and not of_kind(docs, "LocalQueue")


def test_shared_model_roots_reach_the_runtime(chart):
    docs = chart.render(None, {"runtime": {"sharedModelRoots": ["pvc://models/shared", "local://weights"]}})
    assert _env(docs)["VIDEOJOB_SHARED_MODEL_ROOTS"] == "pvc://models/shared,local://weights"
    bad = chart.template(None, {"runtime": {"sharedModelRoots": ["s3://bucket"]}})
    assert bad.returncode != 0 and "sharedModelRoots" in bad.stderr


@pytest.mark.cluster
def test_the_rendered_kueue_objects_are_accepted_by_real_kueue(chart, kueue, kube_cluster, namespace):  # noqa: F811
    """Not only rendered: Kueue's CRDs and webhooks (the `kueue` fixture) accept the chart's
    ResourceFlavors, ClusterQueue and LocalQueue (server-side dry run: other tests share the cluster)."""
    import json

    values = {**KUEUE, "kueue": {"clusterQueue": {"name": "fleet-gpus", "cohort": "fleet"}, "localQueue": "gpus"},
              "watch": {"namespaces": [namespace]}}
    docs = [d for d in chart.render(None, values) if d["apiVersion"].startswith("kueue.x-k8s.io/")]
    assert sorted(d["kind"] for d in docs) == ["ClusterQueue", "LocalQueue", "ResourceFlavor", "ResourceFlavor"]
    for doc in docs:
        result = kube_cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(doc), check=False)
        assert result.returncode == 0, (doc["kind"], result.stderr)
