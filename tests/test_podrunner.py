"""The pod runner (hack/cluster/podrunner) against a real apiserver, with real processes.

First its pure parts (no cluster, no root): $(VAR) expansion, quantities, Service link
variables, hosts files, pod phase, the image map, atomic volume updates. Then one
runner process per module (its own state dir, two nodes, a pod CIDR of its own,
1 s..4 s CrashLoopBackOff) runs the pods the tests bind to its nodes; at the end it is
stopped and nothing it created may be left. Needs root (network namespaces, mounts):
skipped otherwise, FAILS when CI=true or VIDEOJOB_REQUIRE_CLUSTER=1."""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

import pytest
import yaml

from helpers import wait_for
from podrunner_helpers import (PYTHON_IMAGE, VENV_BIN, Api, RunnerProcess, alive, condition, cstatus,
                               free_pod_cidr, leftovers, phase, python_container, python_pod)


# ---------------------------------------------------------------- pure parts


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


# ---------------------------------------------------------------- against the cluster


def _required() -> bool:
    return (os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")
            or os.environ.get("VIDEOJOB_REQUIRE_CLUSTER", "").strip() == "1")


SHELL_IMAGE = "test/shell:1"


def _image_map(path: Path) -> Path:
    path.write_text(yaml.safe_dump({"images": [
        {"image": "test/shell", "entrypoint": ["/bin/sh"], "env": {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}},
        {"image": PYTHON_IMAGE, "cmd": ["python"],
         "env": {"PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "VIRTUAL_ENV": str(VENV_BIN.parent), "PYTHONUNBUFFERED": "1", "IMAGE_ONLY": "from-image",
                 "OVERRIDDEN": "image"}},
    ]}))
    return path


def _all_pids(state: dict) -> list[int]:
    return [c["pid"] for p in state.get("pods", []) for c in p["containers"] if c.get("pid")]


def _assert_clean(r: RunnerProcess, host_paths: list[str], pids: list[int]) -> None:
    from podrunner.hostpaths import users_of

    shared = [p for p in host_paths if users_of(p)]   # another live runner on this machine uses them
    left = leftovers(r.prefix, [p for p in host_paths if p not in shared])
    assert not left, f"the pod runner left behind: {left}\n{r.log_tail()}"
    running = [p for p in pids if alive(p)]
    assert not running, f"container processes still running after the runner stopped: {running}"


@pytest.fixture(scope="module")
def runner(kube_cluster, tmp_path_factory):
    if os.geteuid() != 0:
        msg = "the pod runner needs root (network namespaces, bind mounts, other uids)"
        if _required():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    root = tmp_path_factory.mktemp("podrunner")
    tag = secrets.token_hex(3)
    r = RunnerProcess(kube_cluster, root / "state", [f"pr-{tag}-a", f"pr-{tag}-b"], _image_map(root / "images.yaml"),
                      free_pod_cidr())
    r.api = Api(kube_cluster)
    r.node = r.nodes[0]
    r.flags = root / "flags"       # a hostPath the tests flip to drive probes
    r.flags.mkdir()
    try:
        r.start()
    except BaseException:
        r.stop()
        raise
    yield r
    state = r.state()
    rc = r.stop()
    assert rc == 0, f"the pod runner exited with {rc} on SIGTERM:\n{r.log_tail()}"
    _assert_clean(r, state.get("hostPaths", []), _all_pids(state))
    for node in r.nodes:
        assert r.api.call("GET", f"/api/v1/nodes/{node}", ok404=True) is None, f"node {node} left behind"


def test_nodes_ready_with_lease(runner):
    for name in runner.nodes:
        node = runner.api.call("GET", f"/api/v1/nodes/{name}")
        conds = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert conds["Ready"] == "True", node["status"]
        assert {"type": "InternalIP", "address": runner.state()["gateway"]} in node["status"]["addresses"]
        assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("v1.")
        # admission taints a new node not-ready; the node lifecycle controller lifts it once it sees Ready
        wait_for(f"node {name} without node.kubernetes.io/* taints",
                 lambda: not [t for t in runner.api.call("GET", f"/api/v1/nodes/{name}")["spec"].get("taints") or []
                              if t["key"].startswith("node.kubernetes.io/")], timeout=30)
        lease = runner.api.call("GET", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}")
        assert lease["spec"]["holderIdentity"] == name


ENV_SCRIPT = "import json, os, sys; print('ENV=' + json.dumps(dict(os.environ)) + ' ARGV=' + json.dumps(sys.argv[1:]))"


def test_env(runner, namespace):
    api, ns = runner.api, namespace
    api.create(ns, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"},
                    "data": {"color": "blue", "size": "L"}})
    api.create(ns, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"},
                    "stringData": {"password": "s3cret"}})
    api.create(ns, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "my-svc"},
                    "spec": {"selector": {"app": "none"}, "ports": [{"name": "web", "port": 8080}]}})
    ctr = python_container("main", ENV_SCRIPT, args=["$(GREETING)", "$$(GREETING)", "$(UNSET_VAR)"], env=[
        {"name": "GREETING", "value": "hello"},
        {"name": "COMPOSED", "value": "$(GREETING)-world-$$(GREETING)-$(NOPE)"},
        {"name": "OVERRIDDEN", "value": "pod"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "TIER", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tier']"}}},
        {"name": "NOTE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['note']"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
        {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}},
        {"name": "COLOR", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "color"}}},
        {"name": "MAYBE", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "missing", "optional": True}}},
        {"name": "MEM_MI", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
        {"name": "CPU_M", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu", "divisor": "1m"}}},
        {"name": "CPU_LIMIT", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
    ], envFrom=[{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        resources={"requests": {"cpu": "250m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}})
    pod = python_pod("env", runner.node, restartPolicy="Never", containers=[ctr], labels={"tier": "backend"})
    pod["metadata"]["annotations"] = {"note": "hi there"}
    # a missing non-optional reference holds the container in CreateContainerConfigError until it exists
    late = python_pod("late", runner.node, ENV_SCRIPT, restartPolicy="Never")
    late["spec"]["containers"][0]["env"] = [{"name": "LATE", "valueFrom": {"secretKeyRef": {"name": "later", "key": "k"}}}]
    api.create(ns, pod)
    api.create(ns, late)

    done = api.wait_pod(ns, "env", "Succeeded", lambda p: phase(p) == "Succeeded")
    line = next(l for l in runner.log(ns, "env").splitlines() if l.startswith("ENV="))
    env = json.loads(line[4:line.index(" ARGV=")])
    argv = json.loads(line[line.index(" ARGV=") + 6:])
    assert argv == ["hello", "$(GREETING)", "$(UNSET_VAR)"]
    assert env["COMPOSED"] == "hello-world-$(GREETING)-$(NOPE)"
    assert env["OVERRIDDEN"] == "pod" and env["IMAGE_ONLY"] == "from-image"
    assert env["POD_NAME"] == "env" and env["POD_NS"] == ns and env["POD_UID"] == done["metadata"]["uid"]
    assert env["TIER"] == "backend" and env["NOTE"] == "hi there"
    assert env["POD_IP"] == done["status"]["podIP"] and env["POD_IP"].startswith(runner.pod_cidr.rsplit(".", 2)[0])
    assert env["HOST_IP"] == runner.state()["gateway"]
    assert env["NODE"] == runner.node and env["SA"] == "default"
    assert env["PASSWORD"] == "s3cret" and env["COLOR"] == "blue" and "MAYBE" not in env
    assert env["CM_color"] == "blue" and env["CM_size"] == "L"
    assert env["MEM_MI"] == "128" and env["CPU_M"] == "250"
    assert env["CPU_LIMIT"] == "4", "an unset limit is the node's allocatable"
    assert env["HOSTNAME"] == "env"
    assert env["KUBERNETES_SERVICE_HOST"] == "10.96.0.1" and env["KUBERNETES_SERVICE_PORT_HTTPS"] == "443"
    assert env["KUBERNETES_PORT_443_TCP"] == "tcp://10.96.0.1:443"
    svc = api.call("GET", f"/api/v1/namespaces/{ns}/services/my-svc")
    assert env["MY_SVC_SERVICE_HOST"] == svc["spec"]["clusterIP"]
    assert env["MY_SVC_SERVICE_PORT"] == "8080" and env["MY_SVC_SERVICE_PORT_WEB"] == "8080"
    assert env["MY_SVC_PORT_8080_TCP_ADDR"] == svc["spec"]["clusterIP"]
    assert env["PATH"].startswith(str(VENV_BIN))

    waiting = api.wait_pod(ns, "late", "CreateContainerConfigError",
                           lambda p: cstatus(p, "main").get("state", {}).get("waiting", {}).get("reason")
                           == "CreateContainerConfigError")
    assert "later" in cstatus(waiting, "main")["state"]["waiting"]["message"]
    api.create(ns, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "later"}, "stringData": {"k": "now"}})
    api.wait_pod(ns, "late", "Succeeded once the secret exists", lambda p: phase(p) == "Succeeded")
    assert '"LATE": "now"' in runner.log(ns, "late")


VOLUME_WRITER = """
import json, os, stat, time
def mode(p): return oct(stat.S_IMODE(os.stat(p).st_mode))
open('/shared/from-writer', 'w').write('shared-ok')
open('/data/pvc-file', 'w').write('pvc-ok')
out = {'cm_item': open('/cm/renamed').read(), 'cm_mode': mode('/cm/renamed'), 'cm_default': mode('/cm-all/b'),
       'cm_keys': sorted(k for k in os.listdir('/cm-all') if not k.startswith('..')),
       'secret': open('/sec/pw').read(), 'secret_mode': mode('/sec/pw'),
       'down_labels': open('/podinfo/labels').read(), 'down_name': open('/podinfo/name').read(),
       'tmp_private': os.listdir('/tmp'), 'shm': os.path.isdir('/dev/shm'),
       'sub': open('/subdir/in-sub', 'w').write('s') and os.path.exists('/shared/sub/in-sub')}
print('VOL=' + json.dumps(out), flush=True)
"""

VOLUME_READER = """
import time
deadline = time.time() + 20
while time.time() < deadline:
    try:
        print('READ=' + open('/shared/from-writer').read(), flush=True); break
    except FileNotFoundError:
        time.sleep(0.1)
"""

PVC_READER = """
import time
deadline = time.time() + 20
while time.time() < deadline:
    try:
        print('PVC=' + open('/data/pvc-file').read(), flush=True); break
    except FileNotFoundError:
        time.sleep(0.1)
"""

API_CALLER = """
import json, os, ssl, urllib.request
sa = '/var/run/secrets/kubernetes.io/serviceaccount'
ctx = ssl.create_default_context(cafile=sa + '/ca.crt')
url = 'https://%s:%s/api/v1/namespaces/%s/pods/%s' % (os.environ['KUBERNETES_SERVICE_HOST'],
      os.environ['KUBERNETES_SERVICE_PORT'], open(sa + '/namespace').read(), os.environ['HOSTNAME'])
req = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + open(sa + '/token').read()})
pod = json.load(urllib.request.urlopen(req, context=ctx, timeout=10))
print('SELF=' + pod['metadata']['uid'], flush=True)
"""


def test_volumes(runner, namespace):
    api, ns = runner.api, namespace
    api.create(ns, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"a": "alpha", "b": "beta"}})
    api.create(ns, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "stringData": {"password": "pw1"}})
    api.create(ns, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
                    "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    api.create(ns, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}})
    api.create(ns, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "pods"},
                    "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    api.create(ns, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "pods"},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pods"},
                    "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]})
    pvc = {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}
    vol_a = python_pod("vol-a", runner.node, restartPolicy="Never", labels={"app": "vol", "x": "y"}, volumes=[
        {"name": "shared", "emptyDir": {}}, pvc,
        {"name": "cm", "configMap": {"name": "cfg", "items": [{"key": "a", "path": "renamed", "mode": 0o600}]}},
        {"name": "cm-all", "configMap": {"name": "cfg", "defaultMode": 0o640}},
        {"name": "sec", "secret": {"secretName": "sec", "items": [{"key": "password", "path": "pw"}], "defaultMode": 0o400}},
        {"name": "podinfo", "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                                                      {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
    ], containers=[
        python_container("writer", VOLUME_WRITER, volumeMounts=[
            {"name": "shared", "mountPath": "/shared"}, {"name": "data", "mountPath": "/data"},
            {"name": "cm", "mountPath": "/cm"}, {"name": "cm-all", "mountPath": "/cm-all"},
            {"name": "sec", "mountPath": "/sec"}, {"name": "podinfo", "mountPath": "/podinfo"},
            {"name": "shared", "mountPath": "/subdir", "subPath": "sub"}]),
        python_container("reader", VOLUME_READER, volumeMounts=[{"name": "shared", "mountPath": "/shared"}]),
    ])
    vol_b = python_pod("vol-b", runner.nodes[1], PVC_READER, restartPolicy="Never", volumes=[pvc])
    vol_b["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data", "readOnly": True}]
    caller = python_pod("api-caller", runner.node, API_CALLER, restartPolicy="Never", serviceAccountName="reader")
    for p in (vol_a, vol_b, caller):
        api.create(ns, p)

    for name in ("vol-a", "vol-b", "api-caller"):
        api.wait_pod(ns, name, "Succeeded", lambda p: phase(p) in ("Succeeded", "Failed"))
    logs = {n: runner.log(ns, n, c) for n, c in (("vol-a", "writer"), ("vol-b", "main"), ("api-caller", "main"))}
    for name in ("vol-a", "vol-b", "api-caller"):
        assert phase(api.pod(ns, name)) == "Succeeded", f"{name}: {logs.get(name)}"
    vol = json.loads(next(l for l in logs["vol-a"].splitlines() if l.startswith("VOL="))[4:])
    assert vol["cm_item"] == "alpha" and vol["cm_mode"] == "0o600"
    assert vol["cm_keys"] == ["a", "b"] and vol["cm_default"] == "0o640"
    assert vol["secret"] == "pw1" and vol["secret_mode"] == "0o400"
    assert 'app="vol"' in vol["down_labels"] and 'x="y"' in vol["down_labels"] and vol["down_name"] == "vol-a"
    assert vol["tmp_private"] == [], "each container has its own empty /tmp"
    assert vol["shm"]
    assert vol["sub"] is True, "a subPath mount is that directory of the volume"
    assert "READ=shared-ok" in runner.log(ns, "vol-a", "reader"), "two containers share an emptyDir"
    assert "PVC=pvc-ok" in logs["vol-b"], "two pods (on two nodes) share one PVC directory"
    uid = api.pod(ns, "api-caller")["metadata"]["uid"]
    assert f"SELF={uid}" in logs["api-caller"], logs["api-caller"]
    assert (runner.state_dir / "pvcs" / ns / "data" / "pvc-file").read_text() == "pvc-ok"


TOKEN_WATCHER = """
import hashlib, os, ssl, time, urllib.request
sa = '/var/run/secrets/kubernetes.io/serviceaccount'
ctx = ssl.create_default_context(cafile=sa + '/ca.crt')
url = 'https://%s:%s/api' % (os.environ['KUBERNETES_SERVICE_HOST'], os.environ['KUBERNETES_SERVICE_PORT'])
seen, deadline = [], time.time() + 40
while len(seen) < 2 and time.time() < deadline:
    token = open(sa + '/token').read()
    digest = hashlib.sha256(token.encode()).hexdigest()[:12]
    if not seen or seen[-1] != digest:
        req = urllib.request.Request(url, headers={'Authorization': 'Bearer ' + token})
        print('TOKEN', digest, urllib.request.urlopen(req, context=ctx, timeout=10).status, flush=True)
        seen.append(digest)
    time.sleep(0.5)
"""


def test_token_renewed(runner, namespace):
    """The projected token is renewed in place (the runner here renews at 0.1% of its life)
    and the renewed one authenticates; the pod reads it at the same path."""
    api, ns = runner.api, namespace
    api.create(ns, python_pod("token", runner.node, TOKEN_WATCHER, restartPolicy="Never"))
    done = api.wait_pod(ns, "token", "finished", lambda p: phase(p) in ("Succeeded", "Failed"), timeout=60)
    out = runner.log(ns, "token")
    tokens = [l.split() for l in out.splitlines() if l.startswith("TOKEN ")]
    assert phase(done) == "Succeeded" and len(tokens) == 2, out
    assert tokens[0][1] != tokens[1][1] and [t[2] for t in tokens] == ["200", "200"], out


WEB_SERVER = """
import http.server, os, socketserver
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ['HOSTNAME'].encode()
        self.send_response(200); self.send_header('Content-Length', str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(('', 8080), H).serve_forever()
"""

WEB_CLIENT = """
import os, sys, time, urllib.request
ns = os.environ['NS']
for url in ('http://web:8080/', 'http://web.%s.svc.cluster.local:8080/' % ns, 'http://w1.web-h.%s.svc.cluster.local:8080/' % ns):
    deadline = time.time() + 20
    while True:
        try:
            print('GOT', url, urllib.request.urlopen(url, timeout=2).read().decode(), flush=True); break
        except OSError as exc:
            if time.time() > deadline: print('FAIL', url, exc, flush=True); sys.exit(1)
            time.sleep(0.2)
t = time.time()
try:
    urllib.request.urlopen('http://no-such-service:8080/', timeout=5)
except OSError:
    print('UNKNOWN-FAILS-IN %.2f' % (time.time() - t), flush=True)
"""


def _web(name: str, node: str, **spec) -> dict:
    pod = python_pod(name, node, WEB_SERVER, labels={"app": "web"}, **spec)
    pod["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": 8080}]
    pod["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    return pod


def test_service_names(runner, namespace):
    api, ns = runner.api, namespace
    api.create(ns, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                    "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080}]}})
    api.create(ns, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web-h"},
                    "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]}})
    api.create(ns, _web("web-1", runner.node, hostname="w1", subdomain="web-h"))
    api.wait_pod(ns, "web-1", "Ready", lambda p: condition(p, "Ready") == "True")
    client = python_pod("client", runner.nodes[1], WEB_CLIENT, restartPolicy="Never")
    client["spec"]["containers"][0]["env"] = [{"name": "NS", "value": ns}]
    api.create(ns, client)
    api.wait_pod(ns, "client", "Succeeded", lambda p: phase(p) in ("Succeeded", "Failed"), timeout=45)
    out = runner.log(ns, "client")
    assert phase(api.pod(ns, "client")) == "Succeeded", out
    assert f"GOT http://web:8080/ w1" in out and f"GOT http://web.{ns}.svc.cluster.local:8080/ w1" in out
    assert f"GOT http://w1.web-h.{ns}.svc.cluster.local:8080/ w1" in out, "a headless Service names its endpoints"
    seconds = float(out.split("UNKNOWN-FAILS-IN ")[1].split()[0])
    assert seconds < 3.0, f"an unknown name took {seconds}s to fail (a DNS timeout is 5 s)"

    # the hosts file of a running pod follows a new endpoint
    api.create(ns, _web("web-2", runner.node))
    web2 = api.wait_pod(ns, "web-2", "Ready", lambda p: condition(p, "Ready") == "True")
    hosts = Path("/etc/netns") / runner.pod_record(ns, "web-1")["netns"] / "hosts"
    wait_for("web-2's address under the name web in web-1's hosts file",
             lambda: f"{web2['status']['podIP']}\tweb.{ns} " in hosts.read_text(), timeout=20)
    assert f"web.{ns}.svc.cluster.local web" in hosts.read_text(), "the short name within the namespace"


# sh, not python: the venv's interpreter lives under /root (mode 0700 here), which other uids cannot enter
IDENTITY = "echo UID=$(id -u) GID=$(id -g) GROUPS=$(id -G | tr ' ' ,); touch /scratch/file; " \
           "echo FILE_GID=$(stat -c %g /scratch/file) DIR_MODE=$(stat -c %a /scratch)"


def test_security_context(runner, namespace):
    api, ns = runner.api, namespace
    pod = python_pod("ids", runner.node, restartPolicy="Never",
                     securityContext={"runAsUser": 1234, "runAsGroup": 2345, "fsGroup": 3456, "supplementalGroups": [4567]},
                     volumes=[{"name": "scratch", "emptyDir": {}}],
                     containers=[{"name": "main", "image": SHELL_IMAGE, "args": ["-c", IDENTITY],
                                  "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}])
    nonroot = python_pod("nonroot", runner.node, "print('ran')", restartPolicy="Never",
                         securityContext={"runAsNonRoot": True})
    # the venv's interpreter behind a dir only root may enter: the runner opens the way for the user
    venv_user = python_pod("venv-user", runner.node, "import os; print('PYUID=%d' % os.getuid())",
                           restartPolicy="Never", securityContext={"runAsUser": 65532, "runAsGroup": 65532})
    for p in (pod, nonroot, venv_user):
        api.create(ns, p)
    done = api.wait_pod(ns, "ids", "finished", lambda p: phase(p) in ("Succeeded", "Failed"))
    out = runner.log(ns, "ids")
    assert phase(done) == "Succeeded", f"{out}\n{cstatus(done, 'main')}"
    ids = dict(kv.split("=", 1) for line in out.splitlines() for kv in line.split() if "=" in kv)
    assert ids["UID"] == "1234" and ids["GID"] == "2345", out
    assert {"2345", "3456", "4567"} <= set(ids["GROUPS"].split(",")), out
    assert ids["FILE_GID"] == "3456" and ids["DIR_MODE"] == "2777", "files in an emptyDir belong to the fsGroup"
    ran = api.wait_pod(ns, "venv-user", "finished", lambda p: phase(p) in ("Succeeded", "Failed"))
    assert "PYUID=65532" in runner.log(ns, "venv-user"), cstatus(ran, "main")
    refused = api.wait_pod(ns, "nonroot", "refused for runAsNonRoot",
                           lambda p: cstatus(p, "main").get("state", {}).get("waiting", {}).get("reason")
                           == "CreateContainerConfigError")
    assert "runAsNonRoot" in cstatus(refused, "main")["state"]["waiting"]["message"]
    assert "ran" not in runner.log(ns, "nonroot")


def test_init_containers(runner, namespace):
    api, ns = runner.api, namespace
    vol = [{"name": "w", "emptyDir": {}}]
    mount = [{"name": "w", "mountPath": "/w"}]
    ordered = python_pod("ordered", runner.node, restartPolicy="Never", volumes=vol, initContainers=[
        python_container("one", "open('/w/order', 'a').write('1')", volumeMounts=mount),
        python_container("two", "import time; time.sleep(0.3); open('/w/order', 'a').write('2')", volumeMounts=mount),
    ], containers=[python_container("main", "print('ORDER=' + open('/w/order').read())", volumeMounts=mount)])
    failing = python_pod("init-fails", runner.node, restartPolicy="Never", initContainers=[
        python_container("bad", "import sys; sys.exit(3)")], containers=[python_container("main", "print('main ran')")])
    retried = python_pod("init-retries", runner.node, restartPolicy="Always", initContainers=[
        python_container("bad", "import sys; sys.exit(4)")], containers=[python_container("main", "print('main ran')")])
    for p in (ordered, failing, retried):
        api.create(ns, p)
    done = api.wait_pod(ns, "ordered", "Succeeded", lambda p: phase(p) == "Succeeded")
    assert "ORDER=12" in runner.log(ns, "ordered")
    assert condition(done, "Initialized") == "True"
    assert [cstatus(done, n, init=True)["state"]["terminated"]["reason"] for n in ("one", "two")] == ["Completed"] * 2
    failed = api.wait_pod(ns, "init-fails", "Failed", lambda p: phase(p) == "Failed")
    assert cstatus(failed, "bad", init=True)["state"]["terminated"]["exitCode"] == 3
    assert cstatus(failed, "main")["state"]["waiting"]["reason"] == "PodInitializing"
    assert "main ran" not in runner.log(ns, "init-fails")
    again = api.wait_pod(ns, "init-retries", "init container restarted",
                         lambda p: cstatus(p, "bad", init=True).get("restartCount", 0) >= 2)
    assert phase(again) == "Pending" and condition(again, "Initialized") == "False"
    assert cstatus(again, "bad", init=True)["lastState"]["terminated"]["exitCode"] == 4


PROBED = """
import http.server, socketserver, threading, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.headers.get('X-Probe') == 'yes' else 500); self.end_headers()
    def log_message(self, *a): pass
threading.Thread(target=http.server.ThreadingHTTPServer(('', 8081), H).serve_forever, daemon=True).start()
print('started', flush=True)
time.sleep(3600)
"""


def test_probes(runner, namespace):
    api, ns = runner.api, namespace
    flags = runner.flags / ns
    flags.mkdir()
    vol = [{"name": "flags", "hostPath": {"path": str(flags), "type": "Directory"}}]
    mount = [{"name": "flags", "mountPath": "/flags"}]
    fast = {"periodSeconds": 1, "failureThreshold": 1, "timeoutSeconds": 2}
    readiness = python_pod("ready-flip", runner.node, PROBED, volumes=vol)
    readiness["spec"]["containers"][0].update(volumeMounts=mount, ports=[{"name": "http", "containerPort": 8081}],
        readinessProbe={"exec": {"command": ["test", "-f", "/flags/ready"]}, **fast},
        livenessProbe={"httpGet": {"path": "/", "port": "http", "httpHeaders": [{"name": "X-Probe", "value": "yes"}]},
                       "periodSeconds": 1},
        startupProbe={"tcpSocket": {"port": 8081}, "periodSeconds": 1, "failureThreshold": 30})
    dying = python_pod("liveness-fails", runner.node, PROBED, volumes=vol)
    dying["spec"]["containers"][0].update(volumeMounts=mount, livenessProbe={"exec": {"command": ["test", "-f", "/flags/alive"]},
                                                                            "initialDelaySeconds": 1, **fast})
    gated = python_pod("startup-gated", runner.node, PROBED, volumes=vol)
    gated["spec"]["containers"][0].update(volumeMounts=mount, startupProbe={"exec": {"command": ["test", "-f", "/flags/started"]}, **{**fast, "failureThreshold": 60}})
    for p in (readiness, dying, gated):
        api.create(ns, p)

    running = api.wait_pod(ns, "ready-flip", "Running and started",
                           lambda p: phase(p) == "Running" and cstatus(p, "main").get("started"))
    assert condition(running, "Ready") == "False", "readiness starts False"
    (flags / "ready").touch()
    api.wait_pod(ns, "ready-flip", "Ready after the readiness file appears", lambda p: condition(p, "Ready") == "True")
    (flags / "ready").unlink()
    back = api.wait_pod(ns, "ready-flip", "not Ready after it goes", lambda p: condition(p, "Ready") == "False")
    assert cstatus(back, "main")["restartCount"] == 0, "httpGet (with header) and tcpSocket probes pass"

    restarted = api.wait_pod(ns, "liveness-fails", "restarted by its liveness probe",
                             lambda p: cstatus(p, "main").get("restartCount", 0) >= 1, timeout=40)
    assert cstatus(restarted, "main")["lastState"]["terminated"]["exitCode"] == 137, "pid 1 ignores SIGTERM: killed"

    gated_now = api.pod(ns, "startup-gated")
    assert phase(gated_now) == "Running" and cstatus(gated_now, "main")["started"] is False
    assert condition(gated_now, "Ready") == "False", "not ready before the startup probe passes"
    (flags / "started").touch()
    api.wait_pod(ns, "startup-gated", "started and Ready", lambda p: condition(p, "Ready") == "True"
                 and cstatus(p, "main").get("started"))


def test_restart_policies(runner, namespace):
    api, ns = runner.api, namespace
    crash = python_pod("crashloop", runner.node, "import sys; print('boom'); sys.exit(1)")
    ok = python_pod("never-ok", runner.node, "print('fine')", restartPolicy="Never")
    bad = python_pod("never-bad", runner.node, "import sys; sys.exit(3)", restartPolicy="Never")
    second = python_pod("onfailure", runner.node, restartPolicy="OnFailure", volumes=[{"name": "s", "emptyDir": {}}],
                        containers=[python_container("main", "import os, sys\n"
                                    "if not os.path.exists('/s/once'): open('/s/once', 'w').close(); sys.exit(2)\n"
                                    "print('second run')", volumeMounts=[{"name": "s", "mountPath": "/s"}])])
    for p in (crash, ok, bad, second):
        api.create(ns, p)
    s = api.wait_pod(ns, "never-ok", "Succeeded", lambda p: phase(p) == "Succeeded")
    assert cstatus(s, "main")["state"]["terminated"]["exitCode"] == 0
    assert cstatus(s, "main")["state"]["terminated"]["reason"] == "Completed"
    f = api.wait_pod(ns, "never-bad", "Failed", lambda p: phase(p) == "Failed")
    assert cstatus(f, "main")["state"]["terminated"]["exitCode"] == 3
    assert cstatus(f, "main")["state"]["terminated"]["reason"] == "Error" and cstatus(f, "main")["restartCount"] == 0
    o = api.wait_pod(ns, "onfailure", "Succeeded after one restart", lambda p: phase(p) == "Succeeded")
    assert cstatus(o, "main")["restartCount"] == 1 and cstatus(o, "main")["lastState"]["terminated"]["exitCode"] == 2
    c = api.wait_pod(ns, "crashloop", "CrashLoopBackOff",
                     lambda p: cstatus(p, "main").get("state", {}).get("waiting", {}).get("reason") == "CrashLoopBackOff"
                     and cstatus(p, "main")["restartCount"] >= 2, timeout=40)
    assert phase(c) == "Running" and cstatus(c, "main")["lastState"]["terminated"]["exitCode"] == 1
    assert runner.log(ns, "crashloop").count("boom") >= 3, "the log is appended across restarts"


SIGTERM_HANDLER = """
import signal, sys, time
def bye(*_):
    print('got SIGTERM', flush=True); sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print('waiting', flush=True)
while True: time.sleep(1)
"""


def test_deletion(runner, namespace):
    api, ns = runner.api, namespace
    marks = runner.flags / f"{ns}-prestop"
    marks.mkdir()
    pod = python_pod("doomed", runner.node, terminationGracePeriodSeconds=4,
                     volumes=[{"name": "marks", "hostPath": {"path": str(marks)}}], containers=[
        python_container("handler", SIGTERM_HANDLER, volumeMounts=[{"name": "marks", "mountPath": "/marks"}],
                         lifecycle={"preStop": {"exec": {"command": ["sh", "-c", "echo stopping > /marks/prestop"]}}}),
        python_container("ignorer", "import time; print('waiting', flush=True); time.sleep(3600)"),
    ])
    api.create(ns, pod)
    api.wait_pod(ns, "doomed", "Running", lambda p: phase(p) == "Running" and condition(p, "Ready") == "True")
    record = runner.pod_record(ns, "doomed")
    pids = [c["pid"] for c in record["containers"]]
    assert all(alive(p) for p in pids)
    t0 = time.monotonic()
    api.delete_pod(ns, "doomed")
    wait_for("the Pod object of doomed to be deleted by the runner", lambda: api.pod(ns, "doomed") is None, timeout=30)
    took = time.monotonic() - t0
    assert 3.5 <= took < 15, f"deletion took {took:.1f}s with a 4 s grace period and a SIGTERM-ignoring pid 1"
    assert "got SIGTERM" in runner.log(ns, "doomed", "handler")
    assert (marks / "prestop").read_text().strip() == "stopping", "the preStop hook ran in the container"
    assert not [p for p in pids if alive(p)]
    assert not (Path("/run/netns") / record["netns"]).exists() and not (Path("/etc/netns") / record["netns"]).exists()
    assert runner.pod_record(ns, "doomed") is None


def test_unknown_image(runner, namespace):
    api, ns = runner.api, namespace
    pod = python_pod("noimage", runner.node, "print(1)")
    pod["spec"]["containers"][0]["image"] = "example.com/not/mapped:v9"
    api.create(ns, pod)
    p = api.wait_pod(ns, "noimage", "ErrImagePull", lambda p: cstatus(p, "main").get("state", {}).get("waiting", {})
                     .get("reason") == "ErrImagePull")
    msg = cstatus(p, "main")["state"]["waiting"]["message"]
    assert "example.com/not/mapped:v9" in msg and "images.yaml" in msg, msg
    assert phase(p) == "Pending"


def test_crash_adopt_and_cleanup(kube_cluster, runner, namespace, tmp_path):
    """A runner killed with SIGKILL leaves its pods running; a new one on the same state dir
    adopts them (same pid 1); `cleanup` removes everything a crashed one left; a runner
    started after that runs the pod again as a restart; a stopped runner marks it Failed."""
    api, ns = runner.api, namespace
    node = f"pr-{secrets.token_hex(3)}-c"
    second = RunnerProcess(kube_cluster, tmp_path / "state", [node], runner.argv[runner.argv.index("--image-map") + 1],
                           free_pod_cidr())
    second.start()
    try:
        api.create(ns, python_pod("survivor", node, "import time; print('up', flush=True); time.sleep(3600)",
                                  terminationGracePeriodSeconds=1))
        api.wait_pod(ns, "survivor", "Running", lambda p: phase(p) == "Running")
        pid = second.pod_record(ns, "survivor")["containers"][0]["pid"]
        second.kill()
        assert alive(pid), "a crashed runner leaves its containers running"
        second.start()
        wait_for("the restarted runner to adopt survivor", lambda: (second.pod_record(ns, "survivor") or {})
                 .get("containers", [{}])[0].get("pid") == pid, timeout=20)
        p = api.pod(ns, "survivor")
        assert phase(p) == "Running" and cstatus(p, "main")["restartCount"] == 0
        second.kill()
        state = second.state()
        assert leftovers(second.prefix), "a crash leaves the namespaces behind"
        import subprocess
        import sys
        res = subprocess.run([sys.executable, str(Path(runner.argv[1])), "cleanup", "--state-dir", str(second.state_dir)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert "netns" in res.stdout
        _assert_clean(second, state.get("hostPaths", []), [pid])

        # its processes gone, the pod starts over in a new sandbox, counted as a restart
        second.start()
        again = api.wait_pod(ns, "survivor", "running again after the clean-up",
                             lambda p: cstatus(p, "main").get("restartCount") == 1 and phase(p) == "Running"
                             and "running" in cstatus(p, "main")["state"])
        assert cstatus(again, "main")["lastState"]["terminated"]["reason"] == "ContainerStatusUnknown"
        assert second.pod_record(ns, "survivor")["containers"][0]["pid"] != pid
        state = second.state()
        assert second.stop() == 0
        _assert_clean(second, state.get("hostPaths", []), _all_pids(state))
        stopped = api.pod(ns, "survivor")
        assert phase(stopped) == "Failed" and "shutdown" in stopped["status"].get("message", ""), stopped["status"]
    finally:
        if second.proc and second.proc.poll() is None:
            second.stop()
        api.call("DELETE", f"/api/v1/nodes/{node}", ok404=True)
        api.delete_pod(ns, "survivor", grace=0)
