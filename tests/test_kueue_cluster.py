"""Smoke tests of the Kueue test infrastructure: the real kueue-manager on the
loopback API server (the `kueue` fixture), its webhooks served, and the Workload
protocol the operator's Kueue mode relies on (admission, the quota message,
preemption and what the owner does to release quota)."""
from __future__ import annotations

import pytest

from conftest import KubectlError
from kueue_helpers import GROUP, KueueSetup

pytestmark = pytest.mark.cluster
GPU = "nvidia.com/gpu"


@pytest.fixture
def kq(kube_cluster, kueue):
    """Kueue objects made by one test, deleted afterwards."""
    with KueueSetup(kube_cluster) as setup:
        yield setup


def _queue(kq: KueueSetup, namespace: str, gpus: int = 2, borrow: int | None = None) -> tuple[str, str]:
    """A flavor, a ClusterQueue of ``gpus`` GPUs and 8 CPUs on it (in a cohort of its
    own, borrowing at most ``borrow`` GPUs), and LocalQueue `lq`."""
    flavor = kq.resource_flavor("rf-gpu", {"videojob.test/gpu-class": "a100"})
    limits = {flavor: {GPU: borrow}} if borrow is not None else None
    cq = kq.cluster_queue("cq", {flavor: {"cpu": 8, GPU: gpus}}, cohort=kq.unique("cohort"),
                          borrowing_limits=limits)
    kq.local_queue(namespace, "lq", cq)
    return flavor, cq


def test_workload_is_admitted_on_the_flavor(kq, kube_cluster, namespace):
    flavor, cq = _queue(kq, namespace, borrow=1)
    limit = kube_cluster.get_json(f"clusterqueues.{GROUP}", cq)["spec"]["resourceGroups"][0]["flavors"][0]
    assert limit["resources"][1] == {"name": GPU, "nominalQuota": "2", "borrowingLimit": "1"}
    kq.workload(namespace, "wl", "lq", {"cpu": 1, GPU: 2})
    kq.wait_condition(namespace, "wl", "Admitted", reason="Admitted")
    wl = kq.get_workload(namespace, "wl")
    assert kq.conditions(namespace, "wl")["QuotaReserved"]["status"] == "True"
    admission = wl["status"]["admission"]
    assert admission["clusterQueue"] == cq
    [assignment] = admission["podSetAssignments"]
    assert assignment["name"] == "main"
    assert assignment["flavors"] == {"cpu": flavor, GPU: flavor}
    assert assignment["resourceUsage"][GPU] == "2"


def test_workload_larger_than_the_quota_stays_pending(kq, namespace):
    _queue(kq, namespace, gpus=2)
    kq.workload(namespace, "big", "lq", {"cpu": 1, GPU: 3})
    pending = kq.wait_condition(namespace, "big", "QuotaReserved", "False", reason="Pending")
    assert f"insufficient quota for {GPU}" in pending["message"]
    assert "maximum capacity (2)" in pending["message"]
    # the scheduler goes on past it: a fitting one is admitted, the big one still is not
    kq.workload(namespace, "small", "lq", {"cpu": 1, GPU: 1})
    kq.wait_condition(namespace, "small", "Admitted")
    big = kq.get_workload(namespace, "big")
    assert "admission" not in big["status"]
    assert kq.conditions(namespace, "big").get("Admitted", {}).get("status") != "True"


def test_webhook_refuses_an_invalid_workload(kq, namespace):
    """`pods` in a container's requests passes the CRD schema; only Kueue's
    validating webhook refuses it, so this shows the webhook is really served."""
    _queue(kq, namespace)
    container = {"name": "main", "image": "none", "resources": {"requests": {"cpu": "1", "pods": "1"}}}
    with pytest.raises(KubectlError) as err:
        kq._create({"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
                    "metadata": {"name": "bad", "namespace": namespace},
                    "spec": {"queueName": "lq", "podSets": [
                        {"name": "main", "count": 1, "template": {"spec": {"containers": [container]}}}]}})
    assert 'admission webhook "vworkload.kb.io" denied the request' in err.value.stderr
    assert "reserved for internal kueue use" in err.value.stderr


def test_preemption_and_release_by_the_owner(kq, kube_cluster, namespace):
    """A higher WorkloadPriorityClass preempts: Kueue marks the lower Workload
    Evicted/Preempted but keeps its quota until the owner releases it; the lower
    one is admitted again once the higher one is Finished. The owner's two answers
    are the operator's own (videojob.kueue.KueueApi requeue and finish)."""
    from kubernetes import config as k8s_config

    from videojob.kueue import KueueApi

    owner = KueueApi(k8s_config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)), watch=False)
    _queue(kq, namespace, gpus=2)
    low = kq.priority_class("low", 10)
    high = kq.priority_class("high", 1000)
    kq.workload(namespace, "low", "lq", {"cpu": 1, GPU: 2}, priority_class=(low, 10))
    kq.wait_condition(namespace, "low", "Admitted")
    kq.workload(namespace, "high", "lq", {"cpu": 1, GPU: 2}, priority_class=(high, 1000))
    evicted = kq.wait_condition(namespace, "low", "Evicted", reason="Preempted")
    assert kq.conditions(namespace, "low")["Preempted"]["reason"] == "InClusterQueue"
    assert "Preempted to accommodate a workload" in evicted["message"]
    # the quota stays held until the owner gives it back
    assert kq.conditions(namespace, "low")["QuotaReserved"]["status"] == "True"
    assert kq.conditions(namespace, "high")["QuotaReserved"]["status"] == "False"

    owner.requeue(namespace, "low")
    kq.wait_condition(namespace, "high", "Admitted")
    assert kq.conditions(namespace, "low")["QuotaReserved"]["status"] == "False"
    assert "admission" not in kq.get_workload(namespace, "low")["status"]

    owner.finish(namespace, "high", "VideoJobAttemptEnded", "done")
    assert kq.conditions(namespace, "high")["Admitted"]["status"] == "True"  # only Finished was added
    kq.wait_condition(namespace, "low", "Admitted")
    conds = kq.conditions(namespace, "low")
    assert (conds["Evicted"]["status"], conds["Evicted"]["reason"]) == ("False", "QuotaReserved")
    assert conds["Requeued"]["status"] == "True"
    owner.requeue(namespace, "low")  # a stale look at the eviction must not undo the new admission
    assert kq.conditions(namespace, "low")["Admitted"]["status"] == "True"
    assert "admission" in kq.get_workload(namespace, "low")["status"]


def test_the_workload_watch_wakes_a_parked_job_when_its_workload_changes(kq, kube_cluster, namespace):
    """kueue mode's parked jobs hold no thread: the operator's Workload watch
    (``WorkloadCache.listen``) wakes one when its own Workload changes (here, Kueue
    admits it), not for another's, and stops waking it once it stops listening."""
    import threading

    from kubernetes import config as k8s_config

    from helpers import wait_for
    from videojob.kueue import KueueApi

    _queue(kq, namespace)
    api = KueueApi(k8s_config.new_client_from_config(config_file=str(kube_cluster.kubeconfig)), [namespace])
    try:
        wait_for("the Workload watch to list", lambda: api.cache.synced(namespace), timeout=30)
        woken = {"mine": threading.Event(), "other": threading.Event()}
        api.cache.listen(namespace, "mine", woken["mine"].set)
        api.cache.listen(namespace, "other", woken["other"].set)
        kq.workload(namespace, "mine", "lq", {"cpu": 1, GPU: 1})
        # Only the operator's Workloads are watched (its label): this one becomes one.
        kube_cluster.kubectl("label", f"workloads.{GROUP}", "mine", "-n", namespace,
                             "app.kubernetes.io/managed-by=videojob-operator")
        assert woken["mine"].wait(30), "the watch did not wake the listener of the Workload that changed"
        assert not woken["other"].is_set(), "another Workload's listener was woken"
        kq.wait_condition(namespace, "mine", "Admitted")
        wait_for("the cache to hold the admitted Workload", lambda: any(
            c["type"] == "Admitted" and c["status"] == "True"
            for c in ((api.cache.get(namespace, "mine")[1] or {}).get("status") or {}).get("conditions") or []),
            timeout=30)
        api.cache.unlisten(namespace, "mine")
        woken["mine"].clear()
        kube_cluster.kubectl("label", f"workloads.{GROUP}", "mine", "-n", namespace, "touched=1")
        wait_for("the cache to see the new label", lambda: ((api.cache.get(namespace, "mine")[1] or {})
                                                          .get("metadata", {}).get("labels") or {}).get("touched"),
                 timeout=30)
        assert not woken["mine"].is_set(), "a listener that stopped listening was woken"
    finally:
        api.cache.stop()
