"""`cleanup --state-dir D`: remove what a crashed runner with state dir D left behind:
processes in its network namespaces (and its hostNetwork containers), the namespaces,
links and bridge with its prefix, /etc/netns/<prefix>-*, /dev/shm/<prefix>, its uses of
mount points created on the host (removed when no other runner uses them), and the
per-pod dirs (logs and PVC data stay)."""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
from pathlib import Path

from .containers import proc_start_time
from .hostpaths import release_prefix
from .network import cleanup_prefix
from .util import state_prefix

SHM = Path("/dev/shm")


class CleanupError(Exception):
    pass


def lock_state_dir(state_dir: Path):
    """An exclusive lock on <state-dir>/runner.lock; CleanupError if a live runner holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fh = open(state_dir / "runner.lock", "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise CleanupError(f"another pod runner (pid {holder}) is using state dir {state_dir}; "
                           f"stop it first or use another --state-dir") from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def read_state(state_dir: Path) -> dict:
    try:
        return json.loads((state_dir / "runner.json").read_text())
    except (OSError, ValueError):
        return {}


def kill_recorded(state: dict) -> list[str]:
    """SIGKILL the recorded pid 1 of every container still running (same start time)."""
    killed = []
    for pod in state.get("pods", []):
        for c in pod.get("containers", []):
            pid, start = c.get("pid"), c.get("pidStart")
            if pid and start and proc_start_time(pid) == start:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(f"process {pid} ({pod['namespace']}/{pod['name']}/{c['name']})")
                except ProcessLookupError:
                    pass
    return killed


def cleanup(state_dir: Path, holding_lock: bool = False) -> list[str]:
    state_dir = Path(state_dir).resolve()
    prefix = state_prefix(state_dir)
    lock = None if holding_lock else lock_state_dir(state_dir)
    try:
        state = read_state(state_dir)
        removed = kill_recorded(state)
        removed += cleanup_prefix(prefix)
        removed += [f"host path {p}" for p in release_prefix(prefix)]
        shm = SHM / prefix
        if shm.exists():
            shutil.rmtree(shm, ignore_errors=True)
            removed.append(f"dir {shm}")
        pods = state_dir / "pods"
        if pods.exists():
            shutil.rmtree(pods, ignore_errors=True)
            removed.append(f"dir {pods}")
        if state:
            state["pods"], state["hostPaths"] = [], []
            (state_dir / "runner.json").write_text(json.dumps(state, indent=2))
        return removed
    finally:
        if lock is not None:
            lock.close()
