"""Running the real operator in tests: its CRD, its RBAC, a process of its own.

``OperatorProcess`` starts ``videojob operator --standalone --namespace NS``
as a subprocess authenticated as a ServiceAccount bound to a Role made from
``charts/videojob/files/operator-rbac-rules.yaml`` (the file the chart uses),
so RBAC is enforced; it can be stopped gently or killed (SIGKILL) to test a
restart. Ray is a ``RayHead`` the test starts as its own process. Given a
``kubeconfig``, it runs as whoever that is instead, with no grant of its own
(tests/test_chart_install.py: the ServiceAccount and Role a helm install made).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from helpers import REPO, wait_for

RBAC_RULES = REPO / "charts" / "videojob" / "files" / "operator-rbac-rules.yaml"
SERVICE_ACCOUNT = "videojob-operator"
# The operator's line once it serves /healthz (controller/operator.py), with the port it bound.
READY = re.compile(r"operator ready: .*metrics on :(\d+)")


def rbac_rules(drop: tuple[str, str] | None = None) -> list[dict]:
    """The chart's rules; ``drop`` = (resource, verb) removes one permission (to prove it is needed)."""
    rules = yaml.safe_load(RBAC_RULES.read_text())
    if drop is not None:
        resource, verb = drop
        for rule in rules:
            if resource in rule["resources"]:
                rule["verbs"] = [v for v in rule["verbs"] if v != verb]
    return [r for r in rules if r["verbs"]]


def grant(cluster, namespace: str, rules: list[dict]) -> None:
    """A Role with ``rules`` in ``namespace``, bound to the operator's ServiceAccount there."""
    objects = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": SERVICE_ACCOUNT, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "videojob-operator", "namespace": namespace}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "videojob-operator", "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "videojob-operator"},
         "subjects": [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": namespace}]},
    ]
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects))


def python_without_runtime(where: Path) -> Path:
    """A plain venv's Python (no packages: it cannot import videojob_runtime), as the
    first `python` on a PATH where the venv is not activated may be; its bin/ holds
    `python`. Checked before it is returned: a test built on it proves nothing if it can."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=60)
    python = where / "bin" / "python"
    # The environment Ray heads started by tests hand their drivers (PYTHONPATH included).
    probe = subprocess.run([str(python), "-c", "import videojob_runtime"], capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0 and "No module named 'videojob_runtime'" in probe.stderr, (
        f"{python} imports videojob_runtime (PYTHONPATH, or a global install?): {probe.stderr[-500:]}")
    return python


def write_inventory(path: Path, ranks: int = 2, gpu_memory: str = "8Gi", host_memory: str = "16Gi") -> Path:
    path.write_text(yaml.safe_dump({"device": "cpu", "gpusPerNode": ranks, "gpuMemory": gpu_memory,
                                    "hostMemory": host_memory, "gpuType": "generic", "maxPods": 1}))
    return path


class OperatorProcess:
    def __init__(self, cluster, namespace: str, workdir: Path, env: dict[str, str | None],
                 rules: list[dict] | None = None, kubeconfig: Path | None = None):
        """``env``: over this process's environment (None: unset there). ``kubeconfig``: run
        as its user, granting nothing (``rules`` unused); default: a Role of ``rules`` (the
        chart's) bound to a ServiceAccount of the harness."""
        self.cluster, self.namespace, self.workdir = cluster, namespace, workdir
        self.env = env
        self.rules = rules if rules is not None else rbac_rules()
        self.given_kubeconfig = kubeconfig
        # Known once this start's operator has bound it: it binds a free port itself (0), so no
        # other process can take the port between the harness choosing it and the bind.
        self.metrics_port: int | None = None
        self._log_from = 0
        self.process: subprocess.Popen | None = None
        self.log_path = workdir / f"operator-{namespace}.log"
        self.starts = 0

    def start(self) -> "OperatorProcess":
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.starts == 0 and self.given_kubeconfig is not None:
            self.kubeconfig = self.given_kubeconfig
        elif self.starts == 0:
            grant(self.cluster, self.namespace, self.rules)
            self.kubeconfig = self.cluster.kubeconfig_for(self.namespace, SERVICE_ACCOUNT,
                                                          self.workdir / f"{self.namespace}.kubeconfig")
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "VIDEOJOB_METRICS_PORT": "0",
               "VIDEOJOB_PROGRESS_INTERVAL_S": "0.5", "VIDEOJOB_POLL_INTERVAL_S": "0.3",
               "VIDEOJOB_RAY_RETRY_S": "1", "OMP_NUM_THREADS": "1", **self.env}
        env = {key: value for key, value in env.items() if value is not None}
        env.pop("RAY_ADDRESS", None)
        log = open(self.log_path, "a")
        log.write(f"\n===== start {self.starts + 1} =====\n")
        log.flush()
        self.metrics_port, self._log_from = None, self.log_path.stat().st_size
        self.process = subprocess.Popen(
            [sys.executable, "-m", "videojob.cli", "operator", "--standalone", "--namespace", self.namespace],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1
        wait_for("the operator's /healthz", self.healthy, timeout=120, interval=0.3)
        return self

    def healthy(self) -> bool:
        import urllib.request

        if self.process.poll() is not None:
            raise RuntimeError(f"the operator exited {self.process.returncode}:\n{self.log()[-4000:]}")
        if self.metrics_port is None:
            ready = READY.search(self.log()[self._log_from:])
            if ready is None:
                return False
            self.metrics_port = int(ready.group(1))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/healthz", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as response:
            return response.read().decode()

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no cleanup at all (a crashed pod)."""
        os.killpg(os.getpgid(self.process.pid), signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(os.getpgid(self.process.pid), signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> "OperatorProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def videojob(cluster, namespace: str, name: str) -> dict:
    """The VideoJob as the API server holds it (read without forking kubectl: tests poll this)."""
    obj = cluster.api.get(f"/apis/videojob.io/v1alpha1/namespaces/{namespace}/videojobs/{name}")
    if obj is None:
        raise LookupError(f"VideoJob {namespace}/{name} not found")
    return obj


def wait_phase(cluster, namespace: str, name: str, phases: set[str], timeout: float = 240) -> dict:
    return wait_for(f"{namespace}/{name} to reach {sorted(phases)}",
                    lambda: (obj := videojob(cluster, namespace, name)).get("status", {}).get("phase") in phases
                    and obj, timeout=timeout, interval=0.3)


def tiny_job(name: str, steps: int = 4, **spec_changes) -> dict:
    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    doc["metadata"] = {"name": name}
    doc["spec"]["sampling"]["steps"] = steps
    doc["spec"]["output"] = {"uri": f"local://videos/{name}"}
    for key, value in spec_changes.items():
        doc["spec"][key] = value
    return doc


def create(cluster, namespace: str, doc: dict) -> dict:
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))
    return videojob(cluster, namespace, doc["metadata"]["name"])


def elapsed_since(start: float) -> float:
    return time.monotonic() - start
