"""Small shared helpers: structured logging, RFC 3339 times, atomic writes, names."""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

LOG = logging.getLogger("podrunner")


class KeyValueFormatter(logging.Formatter):
    """One line per record: `time level logger msg key=value ...` (values JSON-quoted when needed)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        parts = [ts, record.levelname[0], record.getMessage()]
        for key, value in getattr(record, "kv", {}).items():
            text = str(value)
            if not text or any(c in text for c in ' "=\n'):
                text = json.dumps(text)
            parts.append(f"{key}={text}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    LOG.handlers[:] = [handler]
    LOG.setLevel(level.upper())
    LOG.propagate = False


def log(level: int, msg: str, **kv) -> None:
    LOG.log(level, msg, extra={"kv": kv})


def info(msg: str, **kv) -> None:
    log(logging.INFO, msg, **kv)


def warn(msg: str, **kv) -> None:
    log(logging.WARNING, msg, **kv)


def debug(msg: str, **kv) -> None:
    log(logging.DEBUG, msg, **kv)


def error(msg: str, exc_info: bool = False, **kv) -> None:
    LOG.error(msg, exc_info=exc_info, extra={"kv": kv})


def now_rfc3339(ts: float | None = None) -> str:
    """Kubernetes metav1.Time: seconds precision, UTC, `Z`."""
    t = _dt.datetime.fromtimestamp(time.time() if ts is None else ts, _dt.timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: str) -> float:
    text = text.replace("Z", "+00:00")
    return _dt.datetime.fromisoformat(text).timestamp()


def atomic_write(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write via a temp file in the same dir and rename (readers never see half a file)."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise


def write_in_place(path: Path, data: str) -> bool:
    """Rewrite a file keeping its inode (a bind mount of it keeps working); False if unchanged."""
    path = Path(path)
    new = data.encode()
    try:
        with open(path, "rb") as fh:
            if fh.read() == new:
                return False
    except FileNotFoundError:
        pass
    with open(path, "r+b" if path.exists() else "wb") as fh:
        fh.write(new)
        fh.truncate()
    return True


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


def state_prefix(state_dir: Path) -> str:
    """Prefix of every kernel object name a runner creates (netns, links): derived from its
    state dir, so runners with different state dirs never touch each other's objects.
    8 characters: leaves room in the 15-character interface names."""
    digest = hashlib.sha1(str(Path(state_dir).resolve()).encode()).hexdigest()
    return "vjp" + digest[:5]


def short_uid(uid: str) -> str:
    return uid.replace("-", "")[:12]
