"""Smoke tests of the loopback control plane (tests/conftest.py, hack/cluster/)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]


def _wait_gone(kube_cluster, what: str, *get_args: str, deadline_s: float = 60) -> float:
    """Poll `kubectl get` until NotFound; returns the seconds it took."""
    t0 = time.monotonic()
    while True:
        res = kube_cluster.kubectl("get", *get_args, "-o", "name", check=False)
        if res.returncode != 0 and "NotFound" in res.stderr:
            return time.monotonic() - t0
        assert res.returncode == 0, res.stderr
        elapsed = time.monotonic() - t0
        assert elapsed < deadline_s, f"{what} still exists after {deadline_s}s: {res.stdout}"
        time.sleep(0.5)


def test_server_version_matches_tools_module(kube_cluster):
    pinned = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes (v1\.\S+)",
                       (REPO / "tools" / "go.mod").read_text(), re.M)
    out = json.loads(kube_cluster.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == (pinned.group(1) if pinned else None)
    assert out["clientVersion"]["gitVersion"] == out["serverVersion"]["gitVersion"]


def test_namespace_fixture_is_active(kube_cluster, namespace):
    phase = kube_cluster.kubectl("get", "namespace", namespace,
                                 "-o", "jsonpath={.status.phase}").stdout
    assert phase == "Active"


def test_service_account_token_is_subject_to_rbac(kube_cluster, namespace, tmp_path):
    sa = "smoke"
    token = kube_cluster.token(namespace, sa)
    assert token.count(".") == 2  # a JWT

    # The bare token against the server, no client certificate anywhere.
    empty = tmp_path / "empty-kubeconfig"
    empty.write_text("")
    as_token = ["--server", kube_cluster.server, "--certificate-authority",
                str(kube_cluster.ca_file), "--token", token]
    who = kube_cluster.kubectl("auth", "whoami", "-o", "json", *as_token, kubeconfig=empty)
    assert (json.loads(who.stdout)["status"]["userInfo"]["username"]
            == f"system:serviceaccount:{namespace}:{sa}")

    # The same identity through a generated kubeconfig.
    cfg = kube_cluster.kubeconfig_for(namespace, sa, tmp_path / "sa.kubeconfig")
    denied = kube_cluster.kubectl("auth", "can-i", "list", "secrets", "-n", namespace,
                                  kubeconfig=cfg, check=False)
    assert denied.stdout.strip() == "no", (denied.stdout, denied.stderr)
    assert denied.returncode == 1
    forbidden = kube_cluster.kubectl("get", "secrets", "-n", namespace, kubeconfig=cfg,
                                     check=False)
    assert forbidden.returncode != 0 and "Forbidden" in forbidden.stderr

    # RBAC grants are honoured: a Role for configmaps turns that "no" into "yes".
    kube_cluster.kubectl("create", "role", "cm-reader", "-n", namespace, "--verb=get,list",
                         "--resource=configmaps")
    kube_cluster.kubectl("create", "rolebinding", "cm-reader", "-n", namespace,
                         "--role=cm-reader", f"--serviceaccount={namespace}:{sa}")
    allowed = kube_cluster.kubectl("auth", "can-i", "list", "configmaps", "-n", namespace,
                                   kubeconfig=cfg, check=False)
    assert allowed.stdout.strip() == "yes", (allowed.stdout, allowed.stderr)
    again = kube_cluster.kubectl("auth", "can-i", "list", "secrets", "-n", namespace,
                                 kubeconfig=cfg, check=False)
    assert again.stdout.strip() == "no"


def test_garbage_collector_deletes_dependents(kube_cluster, namespace):
    owner = json.loads(kube_cluster.kubectl(
        "create", "configmap", "owner", "-n", namespace, "-o", "json").stdout)
    dependent = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "dependent", "namespace": namespace,
                     "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap",
                                          "name": "owner", "uid": owner["metadata"]["uid"]}]},
    }
    kube_cluster.kubectl("create", "-f", "-", input=json.dumps(dependent))
    kube_cluster.kubectl("delete", "configmap", "owner", "-n", namespace)
    _wait_gone(kube_cluster, "configmap dependent (garbage collector)",
               "configmap", "dependent", "-n", namespace)


def test_namespace_deletion_finishes(kube_cluster):
    name = f"vj-smoke-del-{int(time.time() * 1000) % 10**8}"
    kube_cluster.kubectl("create", "namespace", name)
    kube_cluster.kubectl("create", "configmap", "content", "-n", name, "--from-literal=k=v")
    kube_cluster.kubectl("create", "serviceaccount", "content", "-n", name)
    kube_cluster.kubectl("delete", "namespace", name, "--wait=false")
    took = _wait_gone(kube_cluster, f"namespace {name} (namespace controller)",
                      "namespace", name, deadline_s=60)
    assert took < 60


def test_the_kept_alive_reader_opens_a_new_connection_when_the_server_closed_it(kube_cluster):
    """KubeCluster.api (the tests' poller) keeps one connection per thread; one the server
    closed while idle is opened again, for a POST too (a namespace made after it)."""
    import socket

    from conftest import _new_namespace

    api = kube_cluster.api
    assert api.get("/api/v1/namespaces/default")["metadata"]["name"] == "default"
    api._local.conn.sock.shutdown(socket.SHUT_RDWR)  # as an idle timeout on the server would
    name = _new_namespace(kube_cluster)
    try:
        assert api.get(f"/api/v1/namespaces/{name}")["metadata"]["name"] == name
        api._local.conn.sock.shutdown(socket.SHUT_RDWR)
        assert api.get(f"/api/v1/namespaces/{name}-absent") is None
    finally:
        status, _ = api.request("DELETE", f"/api/v1/namespaces/{name}")
        assert status == 200, status
