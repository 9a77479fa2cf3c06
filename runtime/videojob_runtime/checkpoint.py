"""Denoising checkpoints on disk: one file per saved step, written atomically.

A checkpoint holds what the rest of the denoising depends on (``resume.py``
fills it): the latents in their layout-independent (gathered) form, the
scheduler's state, the step's other outputs (CogVideoX's DPM
``old_pred_original_sample``), the generator's and torch's RNG states.

File format (``step-000012.ckpt``): the magic line, an 8-byte big-endian
header length, a JSON header (format, job fingerprint, step, steps, payload
size and SHA-256), the payload (``torch.save``; read back with
``weights_only=True``, so a hostile file cannot run code), then a 32-byte
HMAC-SHA256 of all that under the job's key (``job_key``: derived from the
runtime key, which no tenant can read, for the job's namespace and
fingerprint). The files lie in the tenant's own output directory: a file the
tenant made or changed, or one of another job, fails the HMAC and is never
read further (format 1, unsigned, is refused the same way). Written under a
temporary name in the same directory, fsynced, then renamed: a reader sees a
whole file or none. A partial, corrupt or foreign file (another job's
fingerprint, another step count) is never used: ``newest`` falls back to an
older file, or to step 0, and says why for each file it passed over.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from videojob.jobrequest import CHECKPOINTS_DIR, FINGERPRINT_FIELDS, checkpoint_key

from .beneath import Beneath
from .errors import JobFailure

MAGIC = b"VIDEOJOB-CHECKPOINT\n"
FORMAT = 2  # 2: signed (the HMAC after the payload); 1 was unsigned and is refused
_TAG_BYTES = 32
_NAME = re.compile(r"^step-(\d{6})\.ckpt$")
# A header is a few hundred bytes: a bigger length is a corrupt or foreign file.
_MAX_HEADER = 64 * 1024

def fingerprint(fields: dict[str, Any], inputs: dict[str, bytes] | None = None) -> str:
    """SHA-256 (hex) of the result-changing fields and the bytes of the input images. An
    input given by its bytes counts by them alone, not by where it was read: an https
    input is staged under a new path each attempt, and its job must still resume."""
    h = hashlib.sha256()
    named = {k: (None if k in (inputs or {}) else fields.get(k)) for k in FINGERPRINT_FIELDS}
    h.update(json.dumps(named, sort_keys=True).encode())
    for name, data in sorted((inputs or {}).items()):
        h.update(f"\0{name}\0{len(data)}\0".encode())
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


def job_key(namespace: str | None, job_fingerprint: str) -> bytes:
    """The key a job's checkpoints are signed with: one per namespace and spec (and
    input bytes), from the runtime key that only the operator and Ray hold."""
    from videojob import runtimekey

    try:
        return runtimekey.derive("checkpoint", namespace or "", job_fingerprint)
    except runtimekey.RuntimeKeyError as exc:
        raise JobFailure(f"checkpoints: {exc}", stage="checkpoint") from None


def _tag(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def job_directory(output_dir: Path, job: dict[str, Any]) -> Path:
    """A job's hidden checkpoint directory beside its output, keyed by what changes its frames."""
    return Path(output_dir) / CHECKPOINTS_DIR / f"{job.get('output_name') or 'video'}-{checkpoint_key(job)}"


def file_name(step: int) -> str:
    return f"step-{step:06d}.ckpt"


@dataclass
class Checkpoint:
    step: int
    steps: int
    fingerprint: str
    state: dict[str, Any]
    path: Path | None = None
    nbytes: int = 0


@dataclass
class Found:
    """What ``newest`` chose (None: start from step 0) and why it passed over the others."""

    checkpoint: Checkpoint | None
    refused: list[str] = field(default_factory=list)


def encode(ckpt: Checkpoint, key: bytes) -> bytes:
    """The file's bytes, signed with ``key`` (``job_key``)."""
    import torch

    buf = io.BytesIO()
    torch.save(ckpt.state, buf)
    payload = buf.getvalue()
    header = json.dumps({"format": FORMAT, "fingerprint": ckpt.fingerprint, "step": ckpt.step,
                         "steps": ckpt.steps, "size": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}, sort_keys=True).encode()
    signed = MAGIC + struct.pack(">Q", len(header)) + header + payload
    return signed + _tag(key, signed)


def decode(data: bytes, expect_fingerprint: str, expect_steps: int, key: bytes,
           expect_step: int | None = None) -> Checkpoint:
    """The checkpoint in ``data``, signed with ``key``; ValueError says what is wrong with it.
    The signature is checked first: nothing of an unsigned or forged file is parsed."""
    import torch

    if not data.startswith(MAGIC):
        raise ValueError("not a VideoJob checkpoint (bad magic)")
    if len(data) < len(MAGIC) + 8 + _TAG_BYTES or not hmac.compare_digest(
            _tag(key, data[:-_TAG_BYTES]), data[-_TAG_BYTES:]):
        raise ValueError("not signed for this job (written by someone else, changed since, from before "
                         "checkpoints were signed, or under another runtime key)")
    data = data[:-_TAG_BYTES]
    at = len(MAGIC)
    if len(data) < at + 8:
        raise ValueError("truncated header")
    (hlen,) = struct.unpack(">Q", data[at:at + 8])
    if hlen > _MAX_HEADER or len(data) < at + 8 + hlen:
        raise ValueError("truncated or corrupt header")
    try:
        header = json.loads(data[at + 8:at + 8 + hlen])
    except ValueError:
        raise ValueError("corrupt header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format') if isinstance(header, dict) else '?'} is not {FORMAT}")
    if header.get("fingerprint") != expect_fingerprint:
        raise ValueError("foreign: written for another spec (its fingerprint differs)")
    if header.get("steps") != expect_steps:
        raise ValueError(f"foreign: written for {header.get('steps')} steps, this job has {expect_steps}")
    step = header.get("step")
    if not isinstance(step, int) or not 0 < step < expect_steps or (expect_step is not None and step != expect_step):
        raise ValueError(f"step {step!r} does not fit (file for step {expect_step}, job of {expect_steps} steps)")
    payload = data[at + 8 + hlen:]
    if len(payload) != header.get("size"):
        raise ValueError(f"truncated: payload {len(payload)} bytes of {header.get('size')}")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("corrupt: checksum mismatch")
    try:  # weights_only: tensors, numbers, lists and dicts; anything that would run code is refused
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - pickle and torch raise many kinds
        raise ValueError(f"corrupt or unsafe payload ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})") \
            from None
    if not isinstance(state, dict):
        raise ValueError("corrupt: payload is not a state dict")
    return Checkpoint(step=step, steps=expect_steps, fingerprint=expect_fingerprint, state=state, nbytes=len(data))


class CheckpointStore:
    """One job's checkpoint directory. ``keep``: how many newest files to keep
    (two: a crash while the newest is written still leaves the one before).
    ``root``: the checked directory it lies in (the job's namespace's, from the
    driver): every operation opens the directory again from there without
    following links (``beneath``), so a link planted after the check is refused,
    never written through; None: the directory is the caller's own."""

    def __init__(self, directory: str | Path, job_fingerprint: str, steps: int, keep: int = 2,
                 root: str | Path | None = None, key: bytes | None = None):
        if keep < 1:
            raise ValueError(f"CheckpointStore.keep must be at least 1, got {keep}")
        if steps < 2:
            raise ValueError(f"CheckpointStore.steps must be at least 2 (a 1-step job has no boundary), got {steps}")
        self.directory = Path(directory)
        self.root = Path(root) if root is not None else None
        self.fingerprint, self.steps, self.keep = job_fingerprint, steps, keep
        # None: the key of a job outside any namespace (``videojob run``)
        self.key = key if key is not None else job_key(None, job_fingerprint)

    def _open(self, directory: Path | None = None, create: bool = False) -> Beneath:
        return Beneath.at(directory or self.directory, self.root, create=create, field="spec.output.uri",
                          stage="checkpoint")

    def save(self, step: int, state: dict[str, Any]) -> tuple[Path, int, float]:
        """Write step ``step``'s checkpoint; returns (path, bytes, seconds)."""
        start = time.perf_counter()
        data = encode(Checkpoint(step=step, steps=self.steps, fingerprint=self.fingerprint, state=state), self.key)
        final = file_name(step)
        with self._open(create=True) as where:
            partial = where.write_new(final, data, fsync=True, mode=0o600)
            try:
                where.replace(partial, final)
            except BaseException:
                where.unlink(partial)
                raise
            where.fsync()
            self._prune(where)
        return self.directory / final, len(data), time.perf_counter() - start

    def steps_on_disk(self) -> list[int]:
        try:
            with self._open() as where:
                return self._steps(where)
        except (FileNotFoundError, NotADirectoryError):
            return []

    @staticmethod
    def _steps(where: Beneath) -> list[int]:
        found = (_NAME.match(name) for name in where.names())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def load(self, step: int) -> Checkpoint:
        with self._open() as where:
            data = where.read(file_name(step))
        ckpt = decode(data, self.fingerprint, self.steps, self.key, expect_step=step)
        ckpt.path = self.directory / file_name(step)
        return ckpt

    def newest(self, below: int | None = None) -> Found:
        """The newest valid checkpoint (of a step under ``below`` when given)."""
        refused: list[str] = []
        for step in self.steps_on_disk():
            if below is not None and step >= below:
                continue
            try:
                return Found(self.load(step), refused)
            except (OSError, ValueError, RuntimeError, EOFError) as exc:  # torch.load raises RuntimeError
                refused.append(f"{file_name(step)}: {str(exc)[:200]}")
        return Found(None, refused)

    def _prune(self, where: Beneath) -> None:
        for step in self._steps(where)[self.keep:]:
            where.unlink(file_name(step))
        for name in where.names():  # a crashed writer's leftovers (ours is renamed by now)
            if name.startswith(".step-") and name.endswith(".partial"):
                where.unlink(name)

    def remove(self) -> None:
        """After success: the checkpoints have nothing left to give (nor has the
        shared hidden directory above them, once no other job's are in it)."""
        try:
            with self._open(self.directory.parent) as parent:
                parent.rmtree(self.directory.name)
                if self.directory.parent.name == CHECKPOINTS_DIR and not parent.names():
                    with self._open(self.directory.parent.parent) as above:
                        above.rmdir(CHECKPOINTS_DIR)  # another job's checkpoints appeared meanwhile: left
        except (OSError, JobFailure):  # already gone, or a link where a directory was (refused: left alone)
            pass
