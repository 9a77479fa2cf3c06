"""Per-attempt directories for fetched inputs, on a volume every Ray pod shares.

In a cluster the driver runs on one pod and the ranks on GPU pods, so the
copies the driver fetches must be where every rank can read them at the same
path: VIDEOJOB_INPUT_STAGING_ROOT (``RunSettings.input_staging_root``; the
chart sets it to ``<data volume>/staging`` in every Ray container). Under it:

- each attempt gets a directory of its own, ``vj-inputs-<ns>-<name>-<uid>-a<N>-<random>``,
  so concurrent jobs, and attempts of one job, never share one;
- it is removed when the attempt ends, however it ends (the driver's stop
  removes it on SIGTERM too);
- a driver killed outright (SIGKILL, a lost pod) cannot remove its own: while
  an attempt runs, its driver touches ``.alive`` in the directory every
  ``heartbeat_s``, and the next driver to stage inputs removes every
  directory whose ``.alive`` is older than ``input_staging_stale_s``.

A rank that cannot see the directory fails naming the setting
(``missing_staged_file``), not with a file-not-found deep in the pipeline.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("videojob.runtime.staging")

PREFIX = "vj-inputs-"
ALIVE = ".alive"
SETTING = "VIDEOJOB_INPUT_STAGING_ROOT"
_UNSAFE = re.compile(r"[^A-Za-z0-9.-]+")


def staging_root(configured: str | None) -> Path:
    """Where per-attempt directories go: the setting, else this machine's temp dir."""
    return Path(configured) if configured else Path(tempfile.gettempdir())


def sweep_stale(root: Path, stale_s: float, now: float | None = None) -> list[str]:
    """Remove the per-attempt directories under ``root`` whose heartbeat (``.alive``,
    else the directory itself) is older than ``stale_s``; returns their names."""
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            beat = os.stat(os.path.join(entry.path, ALIVE)).st_mtime
        except OSError:
            try:
                beat = entry.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue  # removed meanwhile (by another driver's sweep)
        if now - beat > stale_s:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    if removed:
        log.warning("removed %d stale input staging dir(s) under %s (no heartbeat for %.0f s; their drivers "
                    "were killed): %s", len(removed), root, stale_s, ", ".join(removed))
    return removed


class StagingDir:
    """One attempt's directory: created in ``__enter__`` (with its heartbeat),
    removed in ``__exit__``."""

    def __init__(self, root: Path, tag: str, stale_s: float):
        self.root, self.stale_s = root, stale_s
        self.tag = _UNSAFE.sub("-", tag).strip("-")[:100] or "job"
        self.heartbeat_s = max(1.0, min(60.0, stale_s / 4))
        self.path: Path | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        sweep_stale(self.root, self.stale_s)
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{self.tag}-", dir=self.root))
        self._beat()
        self._thread = threading.Thread(target=self._beats, name="videojob-staging-heartbeat", daemon=True)
        self._thread.start()
        return self.path

    def _beat(self) -> None:
        try:
            (self.path / ALIVE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
        except OSError as exc:  # the volume went away: the job's own reads will say so
            log.warning("could not mark %s alive: %s", self.path, exc)

    def _beats(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._beat()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def missing_staged_file(field: str, path: Path, local_dir: str | None) -> str | None:
    """The message for a rank that cannot see a file the driver staged (None:
    ``local_dir`` is not a staging directory, so some other message fits)."""
    if not local_dir or not Path(local_dir).name.startswith(PREFIX):
        return None
    configured = os.environ.get(SETTING)
    where = f"{SETTING}={configured}" if configured else f"{SETTING} is unset (the driver's own temp dir)"
    seen = "the directory exists here but not the file" if Path(local_dir).is_dir() else "the directory is not here"
    return (f"{field}: the job's driver fetched this input into {path}, which this rank (on "
            f"{socket.gethostname()}) cannot see ({seen}): {SETTING} must name a directory every Ray node mounts "
            f"at the same path, such as the shared data volume; {where}")


__all__ = ["PREFIX", "SETTING", "StagingDir", "missing_staged_file", "staging_root", "sweep_stale"]
