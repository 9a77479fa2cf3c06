"""Denoising checkpoints on disk: one file per saved step, written atomically.

A checkpoint holds what the rest of the denoising depends on (``resume.py``
fills it): the latents in their layout-independent (gathered) form, the
scheduler's state, the step's other outputs (CogVideoX's DPM
``old_pred_original_sample``), the generator's and torch's RNG states.

File format (``step-000012.ckpt``): the magic line, an 8-byte big-endian
header length, a JSON header (format, job fingerprint, step, steps, payload
size and SHA-256), then the payload (``torch.save``; read back with
``weights_only=True``, so a hostile file cannot run code). Written under a
temporary name in the same directory, fsynced, then renamed: a reader sees a
whole file or none. A partial, corrupt or foreign file (another job's
fingerprint, another step count) is never used: ``newest`` falls back to an
older file, or to step 0, and says why for each file it passed over.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from videojob.jobrequest import CHECKPOINTS_DIR, FINGERPRINT_FIELDS, checkpoint_key

MAGIC = b"VIDEOJOB-CHECKPOINT\n"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{6})\.ckpt$")
# A header is a few hundred bytes: a bigger length is a corrupt or foreign file.
_MAX_HEADER = 64 * 1024

def fingerprint(fields: dict[str, Any], inputs: dict[str, bytes] | None = None) -> str:
    """SHA-256 (hex) of the result-changing fields and the bytes of the input images."""
    h = hashlib.sha256()
    h.update(json.dumps({k: fields.get(k) for k in FINGERPRINT_FIELDS}, sort_keys=True).encode())
    for name, data in sorted((inputs or {}).items()):
        h.update(f"\0{name}\0{len(data)}\0".encode())
        h.update(hashlib.sha256(data).digest())
    return h.hexdigest()


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


def encode(ckpt: Checkpoint) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(ckpt.state, buf)
    payload = buf.getvalue()
    header = json.dumps({"format": FORMAT, "fingerprint": ckpt.fingerprint, "step": ckpt.step,
                         "steps": ckpt.steps, "size": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}, sort_keys=True).encode()
    return MAGIC + struct.pack(">Q", len(header)) + header + payload


def decode(data: bytes, expect_fingerprint: str, expect_steps: int, expect_step: int | None = None) -> Checkpoint:
    """The checkpoint in ``data``; ValueError says what is wrong with it."""
    import torch

    if not data.startswith(MAGIC):
        raise ValueError("not a VideoJob checkpoint (bad magic)")
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
    (two: a crash while the newest is written still leaves the one before)."""

    def __init__(self, directory: str | Path, job_fingerprint: str, steps: int, keep: int = 2):
        if keep < 1:
            raise ValueError(f"CheckpointStore.keep must be at least 1, got {keep}")
        if steps < 2:
            raise ValueError(f"CheckpointStore.steps must be at least 2 (a 1-step job has no boundary), got {steps}")
        self.directory = Path(directory)
        self.fingerprint, self.steps, self.keep = job_fingerprint, steps, keep

    def save(self, step: int, state: dict[str, Any]) -> tuple[Path, int, float]:
        """Write step ``step``'s checkpoint; returns (path, bytes, seconds)."""
        start = time.perf_counter()
        data = encode(Checkpoint(step=step, steps=self.steps, fingerprint=self.fingerprint, state=state))
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / file_name(step)
        tmp = self.directory / f".{final.name}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(self.directory)
        self._prune()
        return final, len(data), time.perf_counter() - start

    def steps_on_disk(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def load(self, step: int) -> Checkpoint:
        path = self.directory / file_name(step)
        ckpt = decode(path.read_bytes(), self.fingerprint, self.steps, expect_step=step)
        ckpt.path = path
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

    def _prune(self) -> None:
        for step in self.steps_on_disk()[self.keep:]:
            (self.directory / file_name(step)).unlink(missing_ok=True)
        for p in self.directory.glob(".step-*.tmp-*"):  # a crashed writer's leftovers (not our pid's: done)
            if not p.name.endswith(f".tmp-{os.getpid()}"):
                p.unlink(missing_ok=True)

    def remove(self) -> None:
        """After success: the checkpoints have nothing left to give (nor has the
        shared hidden directory above them, once no other job's are in it)."""
        shutil.rmtree(self.directory, ignore_errors=True)
        if self.directory.parent.name == CHECKPOINTS_DIR:
            try:
                self.directory.parent.rmdir()
            except OSError:  # another job's checkpoints, or already gone
                pass


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
