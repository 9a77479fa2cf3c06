"""The pod runner's (hack/cluster/podrunner) pure parts, no cluster and no root:
$(VAR) expansion, quantities, Service link variables, hosts files, pod phase, the
image map, atomic volume updates.

Against a real apiserver, with real processes: tests/test_podrunner_pods.py (what a
container sees: env, volumes, tokens, Service names, identity) and
tests/test_podrunner_lifecycle.py (init containers, probes, restarts, deletion, a
crashed runner)."""
from __future__ import annotations

import os

import pytest
import yaml

import podrunner_helpers  # noqa: F401 - puts hack/cluster on sys.path (the podrunner package)


def test_expand_like_kubernetes():
    from podrunner.env import expand

    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$$(A) $$ $(MISSING) $(A", env) == "$(A) $ $(MISSING) $(A"
    assert expand("$x $", env) == "$x $", "a `$` not followed by `(` or `$` stays"
    assert expand("$(A)", {}, env) == "1", "later maps are searched too"


def test_quantities_and_resource_values():
    from fractions import Fraction

    from podrunner.quantity import parse_quantity, resource_value

    assert parse_quantity("500m") == Fraction(1, 2) and parse_quantity("1Gi") == 2**30
    assert parse_quantity("1e3") == 1000 and parse_quantity("1E") == 10**18
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity("12 apples")
    assert resource_value("limits.cpu", "250m", "1m") == "250"
    assert resource_value("limits.cpu", "250m", "0") == "1", "cpu rounds up; divisor 0 means 1"
    assert resource_value("requests.memory", "129Mi", "1Gi") == "1"
    assert resource_value("limits.memory", "1Gi", "1Mi") == "1024"


def test_service_link_variables():
    from podrunner.env import service_link_env, services_for_pod

    def svc(ns, name, ip, ports):
        return {"metadata": {"namespace": ns, "name": name}, "spec": {"clusterIP": ip, "ports": ports}}

    services = [svc("default", "kubernetes", "10.96.0.1", [{"name": "https", "port": 443}]),
                svc("app", "my-db", "10.96.0.9", [{"port": 5432}, {"name": "metrics", "port": 9100, "protocol": "TCP"}]),
                svc("app", "headless", "None", [{"port": 80}]), svc("other", "x", "10.96.0.7", [{"port": 1}])]
    pod = {"metadata": {"namespace": "app"}, "spec": {}}
    env = service_link_env(services_for_pod(pod, services))
    assert env["KUBERNETES_SERVICE_PORT_HTTPS"] == "443" and env["KUBERNETES_PORT"] == "tcp://10.96.0.1:443"
    assert env["MY_DB_SERVICE_HOST"] == "10.96.0.9" and env["MY_DB_SERVICE_PORT"] == "5432"
    assert env["MY_DB_SERVICE_PORT_METRICS"] == "9100" and env["MY_DB_PORT_9100_TCP_ADDR"] == "10.96.0.9"
    assert not [k for k in env if k.startswith(("HEADLESS_", "X_"))]
    pod["spec"]["enableServiceLinks"] = False
    assert {k.split("_")[0] for k in service_link_env(services_for_pod(pod, services))} == {"KUBERNETES"}


def test_hosts_file_from_endpoint_slices():
    from podrunner.hosts import render_hosts, service_records

    services = [{"metadata": {"namespace": "ns", "name": "web"}, "spec": {"clusterIP": "10.96.3.3"}},
                {"metadata": {"namespace": "ns", "name": "db"}, "spec": {"clusterIP": "None"}},
                {"metadata": {"namespace": "default", "name": "kubernetes"}, "spec": {"clusterIP": "10.96.0.1"}}]
    slices = [{"metadata": {"namespace": "ns", "labels": {"kubernetes.io/service-name": "web"}},
               "endpoints": [{"addresses": ["10.0.0.5"], "conditions": {"ready": True}},
                             {"addresses": ["10.0.0.6"], "conditions": {"ready": False}}]},
              {"metadata": {"namespace": "ns", "labels": {"kubernetes.io/service-name": "db"}},
               "endpoints": [{"addresses": ["10.0.0.7"], "hostname": "db-0"}]}]
    records = service_records(services, slices, {("default", "kubernetes"): "10.96.0.1"})
    same = render_hosts({"metadata": {"namespace": "ns", "name": "p"}, "spec": {"hostname": "h", "subdomain": "db"}},
                        "10.0.0.9", records)
    other = render_hosts({"metadata": {"namespace": "elsewhere", "name": "q"}, "spec": {}}, "10.0.0.8", records)
    assert "10.0.0.9\th.db.ns.svc.cluster.local h\n" in same
    assert "10.0.0.5\tweb.ns web.ns.svc web.ns.svc.cluster.local web\n" in same
    assert "10.0.0.5\tweb.ns web.ns.svc web.ns.svc.cluster.local\n" in other, "no short name across namespaces"
    assert "10.0.0.6" not in same, "not-ready endpoints are left out"
    assert "10.0.0.7\tdb-0.db.ns.svc.cluster.local\n" in same
    assert "10.96.0.1\tkubernetes.default kubernetes.default.svc kubernetes.default.svc.cluster.local\n" in other


def test_pod_phase_rules():
    from podrunner.status import CState, phase

    def c(state, code=None, last=None):
        return CState(name="c", image="i", state=state, exit_code=code, last_terminated=last)

    assert phase("Always", [c("terminated", 0)], [c("running")]) == "Running"
    assert phase("Never", [c("terminated", 1)], [c("waiting")]) == "Failed"
    assert phase("OnFailure", [c("terminated", 1)], [c("waiting")]) == "Pending"
    assert phase("Never", [], [c("terminated", 0), c("terminated", 2)]) == "Failed"
    assert phase("Never", [], [c("terminated", 0)]) == "Succeeded"
    assert phase("OnFailure", [], [c("waiting", last={"exitCode": 1})]) == "Running"
    assert phase("Always", [], [c("terminated", 0)]) == "Running"
    assert phase("Always", [], [c("waiting"), c("running")]) == "Pending"


def test_image_map(tmp_path):
    from podrunner.images import ImageMap, ImageMapError

    path = tmp_path / "images.yaml"
    path.write_text(yaml.safe_dump({"images": [
        {"match": "videojob/runtime", "user": "65532:65532", "cmd": ["--help"], "etcProfile": "x"},
        {"image": "*/ray", "entrypoint": ["ray"]}]}))
    images = ImageMap(path)
    rt = images.lookup("docker.io/videojob/runtime:1.2@sha256:abc")
    assert rt and (rt.uid, rt.gid, rt.cmd, rt.profile) == (65532, 65532, ["--help"], "x")
    assert images.lookup("rayproject/ray:2.60").entrypoint == ["ray"]
    assert images.lookup("localhost:5000/videojob/runtime") is None
    path.write_text(yaml.safe_dump({"images": [{"image": "a", "entrypoint": "not-a-list"}]}))
    with pytest.raises(ImageMapError, match="entrypoint"):
        ImageMap(path)


def test_volume_update_is_atomic(tmp_path):
    """A refreshed token (or ConfigMap) replaces every file at once: readers that open
    `token` see the old or the new content, never a mix, and old data goes."""
    from podrunner.volumes import write_atomic

    vol = tmp_path / "vol"
    assert write_atomic(vol, {"token": (b"old", 0o600), "ca.crt": (b"ca", 0o644)}, None)
    first = os.readlink(vol / "..data")
    held = open(vol / "token", "rb")     # a reader of the old generation
    assert not write_atomic(vol, {"token": (b"old", 0o600), "ca.crt": (b"ca", 0o644)}, None), "unchanged: no write"
    assert write_atomic(vol, {"token": (b"new", 0o600)}, None)
    assert (vol / "token").read_bytes() == b"new" and held.read() == b"old"
    assert not (vol / "ca.crt").exists() and not (vol / first).exists()
    assert os.readlink(vol / "token") == "..data/token"
    held.close()
