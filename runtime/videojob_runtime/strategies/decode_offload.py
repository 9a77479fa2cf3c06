"""Move the idle denoiser's weights to the host for the VAE decode.

Without offload every rank keeps the transformer resident through the decode,
where it does nothing: multi-GPU jobs run out of memory there (the VAE's
working set does not shrink with more ranks; DESIGN.md, e.g. ConsisID on 6
GPUs). With this strategy the denoiser goes to the host right before the
pipeline's first ``vae.decode`` call of the job and comes back before the next
job's denoise (``restore``, called by the worker when it prepares a job), so
a warm pipeline keeps its layout. The frames are unchanged: only where the
weights sit during the decode changes.

It hooks ``vae.decode`` on the pipeline (an instance attribute), so it runs
where the decode runs: every rank for plain diffusers pipelines (Wan), the
last rank only under xfuser's CogVideoX/ConsisID wrappers (the others never
call the VAE and keep their weights). Only without offload: offload hooks
already move the weights (a ValueError names the field otherwise).

On a CPU the host and the "device" are the same memory: the moves are real
``Module.to`` calls that change nothing; ``events`` records them in order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

__all__ = ["DecodeOffloadConfig", "DecodeOffload", "apply_decode_offload", "restore_denoiser"]

_ATTR = "_videojob_decode_offload"


@dataclass(frozen=True)
class DecodeOffloadConfig:
    """This job's choice: move the denoiser to ``host`` for the decode."""

    enabled: bool = False
    host: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"DecodeOffloadConfig.enabled must be a bool, got {self.enabled!r}")
        try:
            host = torch.device(self.host)
        except (RuntimeError, TypeError):
            raise ValueError(f"DecodeOffloadConfig.host {self.host!r} is not a torch device") from None
        if host.type != "cpu":
            raise ValueError(f"DecodeOffloadConfig.host must be a cpu device, got {self.host!r}")


@dataclass
class DecodeOffload:
    """The hook's state on one pipeline (kept across jobs on a warm pipeline)."""

    denoiser: torch.nn.Module
    device: torch.device
    config: DecodeOffloadConfig = field(default_factory=DecodeOffloadConfig)
    parked: bool = False
    # ("park" | "restore" | "decode", device) in call order, for tests and reports.
    events: list[tuple[str, str]] = field(default_factory=list)
    park_seconds: float = 0.0
    restore_seconds: float = 0.0

    def before_decode(self) -> None:
        self.events.append(("decode", str(self.device)))
        if self.config.enabled and not self.parked:
            start = time.perf_counter()
            self.denoiser.to(self.config.host)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()  # the weights' blocks go back for the decode's allocations
            self.park_seconds = time.perf_counter() - start
            self.parked = True
            self.events.append(("park", self.config.host))

    def restore(self) -> bool:
        """Weights back on the device (before a job's denoise); True when they moved."""
        if not self.parked:
            return False
        start = time.perf_counter()
        self.denoiser.to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.restore_seconds = time.perf_counter() - start
        self.parked = False
        self.events.append(("restore", str(self.device)))
        return True

    def report(self) -> dict:
        return {"enabled": self.config.enabled, "parked": self.parked,
                "parkSeconds": round(self.park_seconds, 4), "restoreSeconds": round(self.restore_seconds, 4)}


def _install(pipe, denoiser: torch.nn.Module, device: torch.device) -> DecodeOffload:
    state = getattr(pipe, _ATTR, None)
    if state is not None:
        return state
    vae = getattr(pipe, "vae", None)
    if vae is None:
        raise ValueError(f"DecodeOffloadConfig: {type(pipe).__name__} has no vae")
    state = DecodeOffload(denoiser, device)
    decode = vae.decode  # the bound method (diffusers' own forward hooks live inside it)

    def decode_after_parking(*args, **kwargs):
        state.before_decode()
        return decode(*args, **kwargs)

    vae.decode = decode_after_parking
    setattr(pipe, _ATTR, state)
    return state


def apply_decode_offload(pipe, denoiser: torch.nn.Module, config: DecodeOffloadConfig, device: str,
                         offload: str = "none") -> DecodeOffload | None:
    """Before a job: bring a denoiser parked by the previous job back to
    ``device``, then arm (or disarm) the move for this job's decode on ``pipe``
    (the diffusers pipeline that calls ``vae.decode``)."""
    if not isinstance(config, DecodeOffloadConfig):
        raise ValueError(f"config must be a DecodeOffloadConfig, got {type(config).__name__}")
    if config.enabled and offload != "none":
        raise ValueError(f"DecodeOffloadConfig.enabled: only without offload (this pipeline has offload "
                         f"{offload!r}, whose hooks already move the weights)")
    state = getattr(pipe, _ATTR, None)
    if state is None and not config.enabled:
        return None  # never armed on this pipeline: nothing to install or undo
    state = _install(pipe, denoiser, torch.device(device))
    state.park_seconds = state.restore_seconds = 0.0
    state.restore()
    state.config = config
    return state


def restore_denoiser(pipe) -> float | None:
    """Bring a parked denoiser back (seconds it took), None when nothing was parked."""
    state = getattr(pipe, _ATTR, None)
    if state is None or not state.restore():
        return None
    return state.restore_seconds
