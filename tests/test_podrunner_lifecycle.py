"""The pod runner (hack/cluster/podrunner) against a real apiserver, with real
processes: a pod's life. Init containers in order, failing and retried;
readiness, liveness and startup probes; restart policies and CrashLoopBackOff;
deletion with its grace period, SIGTERM and preStop hook; an image the image map
lacks; a runner killed with SIGKILL, whose pods the next one adopts and whose
leftovers `cleanup` removes.

One runner process for the module (the `runner` fixture, tests/podrunner_fixtures.py:
1 s..4 s CrashLoopBackOff) runs the pods the tests bind to its nodes; at the end it
is stopped and nothing it created may be left. Needs root (network namespaces,
mounts): skipped otherwise, FAILS when CI=true or VIDEOJOB_REQUIRE_CLUSTER=1."""
from __future__ import annotations

import secrets
import time
from pathlib import Path

from helpers import wait_for
from podrunner_fixtures import _all_pids, _assert_clean
from podrunner_fixtures import runner  # noqa: F401 - fixture
from podrunner_helpers import (RunnerProcess, alive, condition, cstatus, free_pod_cidr, leftovers, phase,
                               python_container, python_pod)


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
    # What the node lifecycle controller does to the pods of a node it thinks is gone; the
    # runner, like a kubelet, puts its own view back (CI once saw a head pod stay unready).
    marked = api.call("PATCH", f"/api/v1/namespaces/{ns}/pods/ready-flip/status",
             {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "NodeNotReady"}]}},
             ctype="application/strategic-merge-patch+json")
    assert condition(marked, "Ready") == "False"
    api.wait_pod(ns, "ready-flip", "Ready put back by the runner after another writer set it False",
                 lambda p: condition(p, "Ready") == "True")
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
    # The runner forgets the pod after the API object is gone (as a kubelet cleans up
    # after its final delete): wait for its state file, not the same instant.
    wait_for("the runner to drop doomed from runner.json", lambda: runner.pod_record(ns, "doomed") is None,
             timeout=15)


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
