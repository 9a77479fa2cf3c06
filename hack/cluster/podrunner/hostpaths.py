"""Mount points (and working dirs) the runner has to create on the host's own file
system, because a container mounts a volume at a path the host lacks (e.g.
/var/run/secrets/kubernetes.io/serviceaccount).

Several runners may share such a path, and removing a directory that is a mount point
in another mount namespace silently detaches that mount there (Linux >= 3.18), so the
paths are reference-counted machine-wide: /run/podrunner/hostpaths.json lists every
path some runner created with the runners (prefix -> pid) that use it. A runner that
stops (or `cleanup`) drops its uses; a path nobody alive uses any more is removed,
deepest first, only while still empty. Paths the host had before are never touched."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from pathlib import Path

from .util import atomic_write, debug

REGISTRY_DIR = Path("/run/podrunner")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


@contextlib.contextmanager
def _registry():
    REGISTRY_DIR.mkdir(parents=True, exist_ok=True)
    with open(REGISTRY_DIR / "hostpaths.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = REGISTRY_DIR / "hostpaths.json"
        try:
            reg = json.loads(path.read_text())
        except (OSError, ValueError):
            reg = {}
        reg.setdefault("paths", {})
        before = json.dumps(reg, sort_keys=True)
        yield reg
        if json.dumps(reg, sort_keys=True) != before:
            atomic_write(path, json.dumps(reg, indent=1, sort_keys=True))


def users_of(path: str) -> dict[str, int]:
    """Runners (prefix -> pid) registered as users of a created path (for tests and cleanup)."""
    with _registry() as reg:
        return dict((reg["paths"].get(path) or {}).get("users") or {})


class HostPaths:
    def __init__(self, prefix: str, on_change=lambda: None):
        self.prefix = prefix
        self.pid = os.getpid()
        self.used: list[str] = []         # registered paths this runner relies on, in creation order
        self._lock = threading.Lock()
        self._on_change = on_change

    def ensure(self, paths: list[tuple[str, bool]]) -> None:
        """Create the missing mount points (dirs, or empty files for file mounts)."""
        changed = False
        with self._lock, _registry() as reg:
            for path, is_file in paths:
                p = Path(path)
                chain = [p, *p.parents]
                if p.exists() or p.is_symlink():
                    for q in chain:   # protect what other runners created from their removal
                        entry = reg["paths"].get(str(q))
                        if entry is not None and entry["users"].get(self.prefix) != self.pid:
                            entry["users"][self.prefix] = self.pid
                            changed |= self._note(str(q))
                    continue
                missing = []
                q = p if not is_file else p.parent
                while not q.exists():
                    missing.append(q)
                    q = q.parent
                for d in reversed(missing):
                    d.mkdir()
                    reg["paths"][str(d)] = {"file": False, "users": {self.prefix: self.pid}}
                    changed |= self._note(str(d))
                if is_file:
                    p.touch()
                    reg["paths"][str(p)] = {"file": True, "users": {self.prefix: self.pid}}
                    changed |= self._note(str(p))
                debug("created a mount point on the host", path=str(p))
        if changed:
            self._on_change()

    def _note(self, path: str) -> bool:
        if path in self.used:
            return False
        self.used.append(path)
        return True

    def release(self) -> list[str]:
        """Drop this runner's uses; remove what no live runner uses any more."""
        with self._lock:
            removed = release_prefix(self.prefix)
            self.used = []
        return removed


def release_prefix(prefix: str) -> list[str]:
    removed = []
    with _registry() as reg:
        paths = reg["paths"]
        for entry in paths.values():
            entry["users"].pop(prefix, None)
            entry["users"] = {k: v for k, v in entry["users"].items() if _alive(v)}
        for path in sorted([p for p, e in paths.items() if not e["users"]], key=lambda p: -p.count("/")):
            p = Path(path)
            try:
                if p.is_dir() and not p.is_symlink():
                    p.rmdir()
                    removed.append(path)
                elif p.is_file() and p.stat().st_size == 0:
                    p.unlink()
                    removed.append(path)
            except OSError:
                pass   # something put content there: not ours to delete
            del paths[path]
    return removed
