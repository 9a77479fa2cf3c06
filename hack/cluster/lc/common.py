"""Shared by every module: where things are, errors, logging, state.json and
the lock that serialises up/down/release."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from pathlib import Path

HACK = Path(__file__).resolve().parents[1]  # hack/cluster
REPO = HACK.parents[1]
SERVICE_CIDR = "10.96.0.0/12"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
ISSUER = "https://kubernetes.default.svc.cluster.local"


class ClusterError(RuntimeError):
    """A failure with a message meant for the user (no traceback needed)."""


def log(msg: str) -> None:
    print(f"localcluster: {msg}", file=sys.stderr, flush=True)


class Paths:
    def __init__(self, root: Path):
        self.root = root
        self.pki = root / "pki"
        self.etcd_data = root / "etcd"
        self.state = root / "state.json"
        self.kubeconfig = root / "kubeconfig"
        self.kcm_kubeconfig = root / "controller-manager.kubeconfig"
        self.scheduler_kubeconfig = root / "scheduler.kubeconfig"
        self.lock = root / ".lock"

    def log(self, component: str) -> Path:
        return self.root / f"{component}.log"


def cluster_dir(arg: str | None) -> Paths:
    root = Path(arg or os.environ.get("VIDEOJOB_CLUSTER_DIR") or REPO / ".cluster")
    return Paths(root.resolve())


@contextlib.contextmanager
def locked(paths: Paths, what: str, timeout: float = 900.0):
    """Serialise up/down/release between processes (parallel test sessions)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    with open(paths.lock, "w") as fh:
        deadline = time.monotonic() + timeout
        announced = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not announced:
                    log(f"waiting for another localcluster command to release {paths.lock}")
                    announced = True
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"{what}: timed out after {timeout:.0f}s waiting for the lock {paths.lock}"
                    ) from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def read_state(paths: Paths) -> dict | None:
    try:
        return json.loads(paths.state.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log(f"ignoring unreadable {paths.state}: {exc}")
        return None


def write_state(paths: Paths, state: dict) -> None:
    tmp = paths.state.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(paths.state)
