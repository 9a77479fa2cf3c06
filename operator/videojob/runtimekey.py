"""The runtime key: one secret the operator and every Ray process share, no tenant can read.

Why: two things must not be forged or read by a tenant, and both cross a
place a tenant can reach or that Ray keeps for ever:

- a driver request that carries a signed https input (its query is a
  credential) travels in the Ray submission's ``runtime_env``, which Ray's job
  table and its runtime env agent's log keep: it goes there sealed (AES-GCM
  under a key derived from this one), and only the driver opens it;
- a checkpoint lies in the tenant's own output directory: each is signed
  (HMAC-SHA256 under a key derived per job from this one), and a rank
  restores only a file signed for its job.

Where the key is: the file named by ``VIDEOJOB_RUNTIME_KEY_FILE`` (the chart
mounts its Secret there in the operator pod and in every Ray pod), else this
user's ``$XDG_CONFIG_HOME/videojob/runtime-key`` (``~/.config/...``), made on
first use (0600, 32 random bytes as hex) by whichever process needs it first:
one machine, one user (``videojob run``, the embedded Ray, the tests) shares
it without any setting. A key file holds at least 32 bytes; they are used as
they are (the chart writes 64 random characters).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_ENV = "VIDEOJOB_RUNTIME_KEY_FILE"
MIN_KEY_BYTES = 32
SEALED_PREFIX = "sealed1."
_NONCE_BYTES = 12
_cache: dict[str, bytes] = {}


class RuntimeKeyError(RuntimeError):
    """The key cannot be read or made, or a sealed text was sealed under another key."""


def key_path() -> Path:
    """The key file this process uses (module docstring)."""
    configured = os.environ.get(KEY_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "videojob" / "runtime-key"


def load() -> bytes:
    """The key; made at the default path when none is there (never at a configured one:
    a missing mount is an error, not a new key the other side does not have)."""
    path = key_path()
    cached = _cache.get(str(path))
    if cached is not None:
        return cached
    configured = bool(os.environ.get(KEY_ENV))
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        if configured:
            raise RuntimeKeyError(f"the runtime key file {path} ({KEY_ENV}) does not exist: mount the chart's "
                                  "runtime key Secret there (runtimeKey in the chart's values)") from None
        key = _make(path)
    except OSError as exc:
        raise RuntimeKeyError(f"cannot read the runtime key file {path} ({KEY_ENV}): {exc}") from None
    if len(key) < MIN_KEY_BYTES:
        raise RuntimeKeyError(f"the runtime key file {path} ({KEY_ENV}) holds {len(key)} bytes; it needs at "
                              f"least {MIN_KEY_BYTES} random ones")
    _cache[str(path)] = key
    return key


def _make(path: Path) -> bytes:
    """Write a new key at ``path`` unless another process got there first (then read theirs)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_hex(MIN_KEY_BYTES).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temp, path)  # atomic, and never replaces a key another process made
        except FileExistsError:
            pass
        finally:
            temp.unlink(missing_ok=True)
        return path.read_bytes().strip()
    except OSError as exc:
        raise RuntimeKeyError(f"cannot make the runtime key file {path}: {exc}; set {KEY_ENV} to a file "
                              f"holding {MIN_KEY_BYTES}+ random bytes") from None


def derive(purpose: str, *context: str, key: bytes | None = None) -> bytes:
    """A 32-byte key for one purpose and context (e.g. one job's checkpoints), from the runtime key."""
    message = "\0".join(("videojob", purpose, *context)).encode()
    return hmac.new(key if key is not None else load(), message, hashlib.sha256).digest()


def seal(data: bytes, purpose: str = "request") -> str:
    """``data`` encrypted and authenticated for whoever holds the runtime key (text safe for an env var)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = secrets.token_bytes(_NONCE_BYTES)
    sealed = AESGCM(derive(purpose)).encrypt(nonce, data, purpose.encode())
    return SEALED_PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode()


def unseal(text: str, purpose: str = "request") -> bytes:
    """What ``seal`` sealed; RuntimeKeyError when it was sealed under another key or changed."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if not text.startswith(SEALED_PREFIX):
        raise RuntimeKeyError("not a sealed text")
    try:
        raw = base64.urlsafe_b64decode(text[len(SEALED_PREFIX):].encode())
    except ValueError:
        raise RuntimeKeyError("a sealed text that is not base64") from None
    try:
        return AESGCM(derive(purpose)).decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], purpose.encode())
    except (InvalidTag, ValueError):
        raise RuntimeKeyError(f"the request was sealed under another runtime key than this process's "
                              f"({key_path()}): the operator and the Ray pods must mount the same runtime key "
                              "Secret (runtimeKey in the chart's values)") from None
