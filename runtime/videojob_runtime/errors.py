"""Failures the runtime reports, as data the operator can act on.

Everything crossing the actor boundary is a plain dict (``to_dict``), so a
Ray actor never has to pickle a CUDA exception; the operator re-plans on
``OutOfMemory`` and shows ``reason`` and ``message`` otherwise.
"""

from __future__ import annotations

from typing import Any


class JobFailure(Exception):
    """A job that could not finish, with a reason a person can act on."""

    reason = "Failed"

    def __init__(self, message: str, stage: str = "", **details: Any):
        super().__init__(message)
        self.message = message
        self.stage = stage
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "stage": self.stage, "message": self.message, **self.details}


class OutOfMemory(JobFailure):
    """GPU (or injected) out-of-memory in a stage; carries what was measured."""

    reason = "OutOfMemory"

    def __init__(self, stage: str, peak_bytes: int, message: str = "", **details: Any):
        text = message or f"out of memory during {stage} at a measured peak of {peak_bytes / 1024**3:.2f} GiB"
        super().__init__(text, stage=stage, peak_bytes=peak_bytes, **details)
        self.peak_bytes = peak_bytes


class Cancelled(JobFailure):
    reason = "Cancelled"


class Preempted(Cancelled):
    """Stopped at a boundary by a cancel that asked for a checkpoint (a preemption):
    an agreed stop like a cancel, whose details say which step the next attempt
    resumes from (``checkpointStep``: 0 when none is on disk)."""

    reason = "Preempted"


class ModelSourceMissing(JobFailure):
    reason = "ModelSourceMissing"


class InjectedOOM(RuntimeError):
    """Raised by the test hook VIDEOJOB_INJECT_OOM=<stage>; handled like a CUDA OOM."""


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, InjectedOOM):
        return True
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover - the runtime always has torch
        pass
    return "out of memory" in str(exc).lower() and "cuda" in str(exc).lower()
