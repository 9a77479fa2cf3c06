"""`helm install` in kuberay mode on a cluster without KubeRay (issue 18): the chart
says KubeRay is missing and what to do, instead of helm's `error calling lookup:
unable to get apiresource ... RayCluster`. The default loopback cluster (the
kube_cluster fixture: kube-apiserver, no KubeRay CRDs) is such a cluster."""
from __future__ import annotations

import os
import subprocess

from helpers import REPO, helm_binary

CHART = REPO / "charts" / "videojob"


def test_kuberay_mode_without_kuberay_says_so(kube_cluster, namespace, tmp_path):
    served = kube_cluster.kubectl("api-resources", "--api-group=ray.io", "-o", "name").stdout.split()
    assert "rayclusters.ray.io" not in served, "this cluster serves KubeRay's API: the test proves nothing"
    env = {**os.environ, "KUBECONFIG": str(kube_cluster.kubeconfig), "HELM_CONFIG_HOME": str(tmp_path / "c"),
           "HELM_CACHE_HOME": str(tmp_path / "k"), "HELM_DATA_HOME": str(tmp_path / "d")}
    result = subprocess.run([helm_binary(), "install", "videojob", str(CHART), "--namespace", namespace,
                             "-f", str(CHART / "ci" / "kuberay-gpu.yaml"), "--skip-crds"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "needs the KubeRay operator" in result.stderr and "ray.mode address" in result.stderr, result.stderr
    assert "unable to get apiresource" not in result.stderr, result.stderr
    # and nothing was installed
    listed = subprocess.run([helm_binary(), "list", "-a", "-n", namespace, "-q"], capture_output=True, text=True,
                            env=env, timeout=60).stdout.split()
    assert listed == [], listed
