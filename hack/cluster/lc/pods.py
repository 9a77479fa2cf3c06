"""Pod-runner mode: pods run for real, as local processes.

`up --full --pod-runner` replaces KWOK and its fake nodes with the pod runner
(hack/cluster/podrunner): it registers the Nodes of hack/cluster/runner-nodes.yaml
(`--runner-nodes` overrides), keeps them Ready, and does a kubelet's work for
the pods kube-scheduler binds to them: a network namespace and address per
pod, the commands KubeRay and the chart generate run as processes of this
checkout's venv, env and volumes resolved, probes, restarts, deletes. KWOK is
not started in this mode: a fake node would take pods and run nothing.

Images map to the venv (IMAGES below, written to <cluster dir>/images.yaml):
the runtime and operator images of the Dockerfile, with the environment,
user, entrypoint and command the Dockerfile gives them
(tests/test_dockerfile.py checks the two agree). The runner needs root
(network and mount namespaces) and the venv's Python (with pyyaml).
"""
from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .common import HACK, REPO, ClusterError, Paths, log
from .procs import stop_pid
from .steps import Process, Run

RUNNER = HACK / "podrunner"
RUNNER_NODES = HACK / "runner-nodes.yaml"
# /16s tried in order for the runner's pods; one already routed here is skipped
# (another runner, a VPN, a container network).
POD_CIDR_CANDIDATES = tuple(f"10.{second}.0.0/16" for second in range(200, 240))
# The runner stops its pods (SIGTERM, their grace period, SIGKILL) before it exits.
STOP_GRACE_S = 90.0

# Ubuntu 24.04's /etc/profile (the runtime image's base) sources profile.d and
# bash.bashrc but never sets PATH; the Debian host's resets it, which would hide
# the venv from KubeRay's `bash -lc` commands. This stands in for the image's.
UBUNTU_PROFILE = """\
# /etc/profile of the runtime image (Ubuntu): PATH is left as the image sets it.
if [ -d /etc/profile.d ]; then
  for i in /etc/profile.d/*.sh; do
    if [ -r "$i" ]; then . "$i"; fi
  done
  unset i
fi
"""


def venv() -> Path:
    """The venv whose install stands in for the images (VIDEOJOB_POD_RUNNER_VENV overrides)."""
    return Path(os.environ.get("VIDEOJOB_POD_RUNNER_VENV") or REPO / ".venv").resolve()


def images(venv_dir: Path) -> dict:
    """The image map: each Dockerfile target as this venv, with the ENV, USER, ENTRYPOINT,
    CMD and WORKDIR the Dockerfile gives it (the venv standing in for the image's Python:
    /opt/venv in the runtime image, /usr/local in the operator image)."""
    path = f"{venv_dir}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    stand_in = {"PATH": path, "VIRTUAL_ENV": str(venv_dir)}
    final = {"HOME": "/home/videojob", "PYTHONDONTWRITEBYTECODE": "1"}  # the ENV after the installs
    # The image's own files: the venv and the checkout its editable install points into
    # (shown again in containers whose private /tmp would hide a checkout under /tmp).
    own = list(dict.fromkeys([str(REPO), str(venv_dir)]))
    common = {"user": "65532:65532", "entrypoint": ["videojob"], "cmd": ["--help"],
              "workingDir": "/home/videojob", "paths": own}
    return {"images": [
        {"match": "*videojob/runtime", **common,
         "env": {**stand_in, "PYTHONUNBUFFERED": "1", "DEBIAN_FRONTEND": "noninteractive", **final},
         "etcProfile": UBUNTU_PROFILE},
        {"match": "*videojob/operator", **common,
         "env": {**stand_in, "PYTHONUNBUFFERED": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", **final}},
    ]}


def routed_networks() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    nets = []
    for line in out.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("default", "broadcast", "local", "unreachable"):
            first = line.split()[1] if len(line.split()) > 1 else ""
        try:
            nets.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            continue
    return [n for n in nets if n.prefixlen > 0]


def free_pod_cidr() -> str:
    used = routed_networks()
    for cidr in POD_CIDR_CANDIDATES:
        net = ipaddress.ip_network(cidr)
        if not any(net.overlaps(u) for u in used):
            return cidr
    raise ClusterError(f"no free /16 for the pod runner among {POD_CIDR_CANDIDATES[0]}..."
                       f"{POD_CIDR_CANDIDATES[-1]}: each is already routed here")


class PodRunner(Process):
    """The pod runner: the kubelet of the runner nodes."""
    name = "pod-runner"
    ports = ("pod_runner",)

    def preflight(self, bin_dir: Path, args) -> None:
        if os.geteuid() != 0:
            raise ClusterError("--pod-runner needs root: the pod runner makes network and mount "
                               "namespaces for its pods")
        missing = [t for t in ("ip", "nsenter", "setpriv", "wget") if not shutil.which(t)]
        if missing:
            raise ClusterError(f"--pod-runner needs {', '.join(missing)} on PATH (iproute2, util-linux, "
                               "wget: KubeRay's probes call wget)")
        nodes = Path(args.runner_nodes).resolve()
        if not nodes.is_file():
            raise ClusterError(f"no runner nodes file {nodes}")

    def resolve(self, bin_dir: Path, args, build: bool) -> dict:
        venv_dir = venv()
        python = venv_dir / "bin" / "python"
        if not os.access(python, os.X_OK):
            raise ClusterError(f"--pod-runner runs its pods from the venv {venv_dir}, which has no "
                               "bin/python: run `make venv` first (or set VIDEOJOB_POD_RUNNER_VENV)")
        check = subprocess.run([str(python), "-c", "import yaml"], capture_output=True, text=True)
        if check.returncode != 0:
            raise ClusterError(f"{python} cannot import yaml, which the pod runner needs: "
                               f"{check.stderr.strip()[-500:]}")
        return {"python": str(python), "venv": str(venv_dir), "nodes": str(Path(args.runner_nodes).resolve())}

    def record(self, run: Run) -> None:
        tools = run.tools[self.name]
        state_dir = run.paths.root / "pod-runner"
        image_map = run.paths.root / "images.yaml"
        image_map.write_text(json.dumps(images(Path(tools["venv"])), indent=2) + "\n")  # JSON is YAML
        run.state["exes"][self.name] = tools["python"]
        run.state["pod_runner"] = {"state_dir": str(state_dir), "image_map": str(image_map),
                                   "nodes_file": tools["nodes"], "pod_cidr": free_pod_cidr(),
                                   "python": tools["python"], "venv": tools["venv"]}

    def argv(self, run: Run) -> list[str]:
        pr = run.state["pod_runner"]
        return [pr["python"], str(RUNNER),
                f"--kubeconfig={run.state['kubeconfig']}",
                f"--state-dir={pr['state_dir']}",
                f"--nodes={pr['nodes_file']}",
                f"--pod-cidr={pr['pod_cidr']}",
                f"--image-map={pr['image_map']}",
                f"--health-port={run.state['ports']['pod_runner']}"]

    def health_url(self, state: dict, paths: Paths) -> tuple[str, None]:
        return f"http://127.0.0.1:{state['ports'].get('pod_runner')}/healthz", None

    def timeout(self, run: Run) -> float:
        return 120  # its nodes must be Ready: a lease, a status, the node lifecycle controller

    def summary(self, run: Run) -> str:
        return f"pod runner ({run.state['pod_runner']['pod_cidr']})"

    def stop(self, state: dict) -> None:
        """SIGTERM (it stops its pods and removes its namespaces), then its own
        clean-up command for whatever a crashed runner left."""
        pids, exes = state.get("pids", {}), state.get("exes", {})
        if self.name in pids:
            stop_pid(pids[self.name], exes.get(self.name), self.name, grace=STOP_GRACE_S)
        pr = state.get("pod_runner") or {}
        if pr.get("python") and pr.get("state_dir") and Path(pr["state_dir"]).exists():
            res = subprocess.run([pr["python"], str(RUNNER), "cleanup", f"--state-dir={pr['state_dir']}"],
                                 capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                log(f"pod runner clean-up exited {res.returncode}: {res.stderr.strip()[-1000:]}")


POD_RUNNER = PodRunner()


def self_check() -> int:  # pragma: no cover - a manual aid: `python3 -m lc.pods`
    print(json.dumps(images(venv()), indent=2))
    print(free_pod_cidr())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(self_check())
