"""Full mode's KubeRay: the CRDs and the operator, from the same module version.

tools/kuberay pins github.com/ray-project/kuberay/ray-operator; build-gotool.sh
builds the operator from it, and the CRDs applied are that module's
config/crd/bases/ (found with `go mod download -json`; VIDEOJOB_KUBERAY_CRD_DIR
overrides), applied server-side because client-side apply hits the annotation
size limit. The operator watches all namespaces, runs as the admin, without
webhooks or leader election, with loopback metrics and probe addresses.
"""
from __future__ import annotations

import os
from pathlib import Path

from .binaries import go_module_dir, resolve_tool_bin_dir
from .client import api, kubectl
from .common import ClusterError, Paths
from .procs import wait_until
from .steps import Process, Run, Step

KUBERAY_MODULE = "github.com/ray-project/kuberay/ray-operator"


def kuberay_crds() -> tuple[Path, str]:
    """KubeRay's CRD folder and version, from the module tools/kuberay pins.

    `go mod download -json` prints the module's folder in the module cache
    (downloading it when missing): the CRDs applied are always the ones of the
    operator version that was built. VIDEOJOB_KUBERAY_CRD_DIR overrides.
    """
    override = os.environ.get("VIDEOJOB_KUBERAY_CRD_DIR")
    if override:
        return Path(override).resolve(), "unknown"
    module_dir, version = go_module_dir(KUBERAY_MODULE, "kuberay")
    crd_dir = module_dir / "config" / "crd" / "bases"
    if not sorted(crd_dir.glob("*.yaml")):
        raise ClusterError(f"no CRDs in {crd_dir}")
    return crd_dir, version


def crd_established(state: dict, paths: Paths, name: str) -> bool:
    status, crd = api(state, paths, "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    return status == 200 and any(c.get("type") == "Established" and c.get("status") == "True"
                                 for c in crd.get("status", {}).get("conditions", []))


class KubeRayCRDs(Step):
    """Applies the CRDs and waits until they are Established."""
    name = "kuberay-crds"
    process = False

    def resolve(self, bin_dir: Path, args, build: bool) -> tuple[Path, str]:
        return kuberay_crds()

    def record(self, run: Run) -> None:
        crd_dir, version = run.tools[self.name]
        run.state["kuberay"] = {"version": version, "crd_dir": str(crd_dir)}

    def start(self, run: Run) -> None:
        state, paths = run.state, run.paths
        crd_dir = Path(state["kuberay"]["crd_dir"])
        # server-side: client-side apply hits the annotation size limit
        kubectl(state, "apply", "--server-side", "--force-conflicts",
                "--field-manager=videojob-localcluster", "-f", str(crd_dir))
        crds = [f"{f.stem.split('_', 1)[1]}.{f.stem.split('_', 1)[0]}"
                for f in sorted(crd_dir.glob("*.yaml"))]
        wait_until(f"KubeRay CRDs {', '.join(crds)} to be Established",
                   lambda: all(crd_established(state, paths, c) for c in crds), 60, interval=0.5)


class KubeRayOperator(Process):
    """All namespaces, no webhooks, as admin."""
    name = "kuberay-operator"
    ports = ("kuberay_metrics", "kuberay_probe")

    def resolve(self, bin_dir: Path, args, build: bool) -> Path:
        return resolve_tool_bin_dir("kuberay", "kuberay-operator", "VIDEOJOB_KUBERAY_BIN_DIR", build)

    def record(self, run: Run) -> None:
        tool_bin_dir = run.tools[self.name]
        run.state["exes"][self.name] = str(tool_bin_dir / "kuberay-operator")
        run.state.setdefault("tool_bin_dirs", {})["kuberay"] = str(tool_bin_dir)

    def argv(self, run: Run) -> list[str]:
        ports = run.state["ports"]
        return [
            run.state["exes"][self.name],
            f"--kubeconfig={run.state['kubeconfig']}",
            f"--metrics-addr=127.0.0.1:{ports['kuberay_metrics']}",
            f"--health-probe-bind-address=127.0.0.1:{ports['kuberay_probe']}",
            "--enable-leader-election=false",
            "--log-stdout-encoder=console",
        ]

    def health_url(self, state: dict, paths: Paths) -> tuple[str, None]:
        return f"http://127.0.0.1:{state['ports'].get('kuberay_probe')}/readyz", None

    def summary(self, run: Run) -> str:
        return f"KubeRay {run.state['kuberay']['version']}"


CRDS = KubeRayCRDs()
OPERATOR = KubeRayOperator()
