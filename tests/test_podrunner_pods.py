"""The pod runner (hack/cluster/podrunner) against a real apiserver, with real
processes: its nodes, and what a container sees. Nodes Ready with a Lease; the
environment ($(VAR) expansion, field, resource, Secret and ConfigMap references,
Service link variables, the image's env); volumes (emptyDir, a PVC shared by pods
on two nodes, ConfigMap, Secret, downward API, subPath) and the ServiceAccount
token, renewed in place; Service and headless names; user, groups and fsGroup.

One runner process for the module (the `runner` fixture, tests/podrunner_fixtures.py)
runs the pods the tests bind to its nodes; at the end it is stopped and nothing it
created may be left. Needs root (network namespaces, mounts): skipped otherwise,
FAILS when CI=true or VIDEOJOB_REQUIRE_CLUSTER=1."""
from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

import yaml

from helpers import REPO, wait_for
from podrunner_fixtures import SHELL_IMAGE
from podrunner_fixtures import runner  # noqa: F401 - fixture
from podrunner_helpers import VENV_BIN, condition, cstatus, phase, python_container, python_pod


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
    # empty but for the way to the image's own files when the checkout lies under /tmp (a CI clone)
    image_dirs = sorted({PurePosixPath(p).relative_to("/tmp").parts[0] for p in (str(REPO), str(VENV_BIN.parent))
                         if PurePosixPath(p).is_relative_to("/tmp")})
    assert vol["tmp_private"] == image_dirs, "each container has its own empty /tmp"
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
    # The names come from the EndpointSlices kube-controller-manager writes once web-1 is
    # Ready (it lagged past the client's 20 s of retries on a loaded CI machine): the
    # runner has them when web-1's own hosts file names the Service.
    web1_hosts = Path("/etc/netns") / runner.pod_record(ns, "web-1")["netns"] / "hosts"
    wait_for("the Service's name in web-1's hosts file (its endpoints known to the runner)",
             lambda: f"web.{ns}.svc.cluster.local" in web1_hosts.read_text(), timeout=60)
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
    wait_for("web-2's address under the name web in web-1's hosts file",
             lambda: f"{web2['status']['podIP']}\tweb.{ns} " in web1_hosts.read_text(), timeout=20)
    assert f"web.{ns}.svc.cluster.local web" in web1_hosts.read_text(), "the short name within the namespace"


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


def test_image_files_under_tmp_stay_visible(runner, namespace, tmp_path):
    """An image's own files (the image map's `paths`: here a script dir under /tmp, as a CI
    checkout under /tmp holds the venv the images map to) are bind-mounted back behind the
    container's private /tmp; without `paths` the private /tmp hides them (found when the
    e2e ran from a clone under /tmp: `ray: command not found`)."""
    install = tmp_path / "install"          # under /tmp (pytest's tmp dirs)
    install.mkdir()
    tool = install / "hello-from-image"
    tool.write_text("#!/bin/sh\necho HELLO-FROM-IMAGE\n")
    tool.chmod(0o755)
    os.chmod(tmp_path, 0o755)                 # pytest makes it 0700: let uid 0 images in regardless
    image_map = Path(runner.argv[runner.argv.index("--image-map") + 1])
    doc = yaml.safe_load(image_map.read_text())
    base = {"cmd": ["hello-from-image"], "env": {"PATH": f"{install}:/usr/bin:/bin"}}
    doc["images"] += [{"image": "test/tmp-install-shown", **base, "paths": [str(install)]},
                      {"image": "test/tmp-install-hidden", **base}]
    image_map.write_text(yaml.safe_dump(doc))
    api, ns = runner.api, namespace
    for name, image in (("shown", "test/tmp-install-shown:1"), ("hidden", "test/tmp-install-hidden:1")):
        api.create(ns, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                        "spec": {"nodeName": runner.node, "restartPolicy": "Never",
                                 "containers": [{"name": "main", "image": image}]}})
    shown = api.wait_pod(ns, "shown", "Succeeded", lambda p: phase(p) in ("Succeeded", "Failed"))
    assert phase(shown) == "Succeeded" and "HELLO-FROM-IMAGE" in runner.log(ns, "shown"), runner.log(ns, "shown")
    hidden = api.wait_pod(ns, "hidden", "an end", lambda p: phase(p) in ("Succeeded", "Failed"))
    assert phase(hidden) == "Failed", "the private /tmp did not hide the install: the test proves nothing"
