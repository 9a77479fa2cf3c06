"""kueue mode's pure parts: the Workload an attempt becomes, and what the operator reads back.

The same functions run against real Kueue in tests/test_kueue_operator.py; here
each field the Workload carries and each state Kueue can report is pinned.
"""

from __future__ import annotations

import re

import pytest

from videojob.inventory import parse_inventory
from videojob.kueue import (class_of_flavor, priority_class_for, priority_class_name, read_workload, workload_for,
                            workload_name)
from videojob.settings import OperatorSettings

UID = "0123abcd-0000-4000-8000-000000000000"
INVENTORY = parse_inventory({"device": "cuda", "classes": [
    {"name": "a100-80", "gpuMemory": "80Gi", "gpusPerPod": 8, "maxPods": 2, "hostMemory": "1024Gi",
     "nodeSelector": {"gpu.example.com/type": "a100-80"}},
    {"name": "l4", "gpuMemory": "24Gi", "gpusPerPod": 4, "maxPods": 4, "hostMemory": "256Gi"}]})
PLAN = {"gpuClass": "a100-80", "gpus": 4}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def test_workload_names_are_dns_labels_unique_and_stable():
    short = workload_name("cat", UID, 1, "a100-80")
    assert short == "cat-0123abcd-a1-a100-80"
    long_a = workload_name("x" * 200 + "a", UID, 12, "a100-80")
    long_b = workload_name("x" * 200 + "b", UID, 12, "a100-80")
    for name in (short, long_a, long_b, workload_name("Ünïcode_name.v2", UID, 3, "l4")):
        assert len(name) <= 63 and DNS_LABEL.match(name), name
    assert long_a != long_b  # cut names keep a hash of the whole name
    assert workload_name("cat", UID, 1, "a100-80") == short  # a restarted operator finds its own
    assert workload_name("cat", UID, 2, "a100-80") != short and workload_name("cat", UID, 1, "l4") != short


def test_the_workload_carries_the_plan_the_class_the_queue_and_the_owner():
    wl = workload_for(namespace="team-a", name="cat", uid=UID, attempt=2, plan=PLAN, queue="gpu-queue",
                      priority=250, inventory=INVENTORY, cpus_per_rank=None)
    meta, spec = wl["metadata"], wl["spec"]
    assert meta["namespace"] == "team-a" and meta["name"] == workload_name("cat", UID, 2, "a100-80")
    assert meta["labels"]["videojob.io/uid"] == UID and meta["labels"]["videojob.io/attempt"] == "2"
    owner = meta["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("VideoJob", "cat", UID, True)
    assert spec["queueName"] == "gpu-queue" and spec["priority"] == 250
    assert spec["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                        "name": "videojob-priority-250"}
    (pod_set,) = spec["podSets"]
    assert pod_set["count"] == 1
    pod = pod_set["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu.example.com/type": "a100-80"}
    requests = pod["containers"][0]["resources"]["requests"]
    assert requests["nvidia.com/gpu"] == "4" and requests["cpu"] == "4000m"
    assert requests["memory"] == f"{512 * 1024}Mi"  # half the pod's GPUs: half its host memory
    assert "active" not in spec  # Kueue's default: active
    paused = workload_for(namespace="team-a", name="cat", uid=UID, attempt=3, plan=PLAN, queue="gpu-queue",
                          priority=250, inventory=INVENTORY, cpus_per_rank=None, active=False)
    assert paused["spec"]["active"] is False


def test_cpu_ranks_ask_for_cpu_not_gpus_and_a_class_without_selector_has_none():
    cpu = parse_inventory({"device": "cpu", "classes": [{"name": "cpu-a", "gpuMemory": "4Gi", "gpusPerPod": 2,
                                                         "hostMemory": "8Gi"}]})
    wl = workload_for(namespace="n", name="j", uid=UID, attempt=1, plan={"gpuClass": "cpu-a", "gpus": 2},
                      queue="default", priority=-5, inventory=cpu, cpus_per_rank=0.5)
    pod = wl["spec"]["podSets"][0]["template"]["spec"]
    assert "nodeSelector" not in pod
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": "1000m", "memory": "8192Mi"}
    assert wl["spec"]["priorityClassRef"]["name"] == priority_class_name(-5) == "videojob-priority-m5"
    assert priority_class_for(-5)["value"] == -5


def _wl(conditions, admission=None):
    status = {"conditions": [{"type": t, "status": s, "reason": r, "message": m} for t, s, r, m in conditions]}
    if admission is not None:
        status["admission"] = admission
    return {"status": status}


ADMISSION = {"clusterQueue": "team-a", "podSetAssignments": [{"name": "ranks",
                                                              "flavors": {"nvidia.com/gpu": "l4", "cpu": "l4"}}]}


def test_reading_what_kueue_says():
    pending = read_workload(_wl([("QuotaReserved", "False", "Pending",
                                  "couldn't assign flavors to pod set ranks: insufficient quota")]))
    assert not pending.admitted and "insufficient quota" in pending.waiting and pending.evicted is None
    fresh = read_workload({"metadata": {}})
    assert not fresh.admitted and "not looked" in fresh.waiting
    admitted = read_workload(_wl([("QuotaReserved", "True", "QuotaReserved", ""),
                                  ("Admitted", "True", "Admitted", "")], ADMISSION))
    assert admitted.admitted and admitted.flavor == "l4" and admitted.waiting == ""
    evicted = read_workload(_wl([("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "Admitted", ""),
                                 ("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x)")],
                                ADMISSION))
    assert evicted.evicted == ("Preempted", "Preempted to accommodate a workload (UID: x)")
    assert read_workload(_wl([("Finished", "True", "VideoJobAttemptEnded", "")])).finished
    assert not admitted.deactivated and read_workload({**_wl([]), "spec": {"active": False}}).deactivated
    assert not read_workload({**_wl([]), "spec": {"active": True}}).deactivated


def test_an_admitted_flavor_is_read_as_a_class_by_name_or_by_node_labels():
    assert class_of_flavor("l4", {}, INVENTORY) == "l4"
    flavors = {"big-gpus": {"gpu.example.com/type": "a100-80", "zone": "x"}, "other": {"gpu.example.com/type": "h100"}}
    assert class_of_flavor("big-gpus", flavors, INVENTORY) == "a100-80"
    assert class_of_flavor("other", flavors, INVENTORY) is None
    assert class_of_flavor(None, flavors, INVENTORY) is None


def test_bad_node_selectors_and_admission_modes_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"classes\[0\]\.nodeSelector"):
        parse_inventory({"classes": [{"name": "a", "nodeSelector": ["gpu"]}]})
    with pytest.raises(ValueError, match="admission"):
        OperatorSettings(admission="slurm")
    assert OperatorSettings().admission == "builtin"
