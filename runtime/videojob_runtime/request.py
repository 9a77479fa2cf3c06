"""What one rank needs for one job: the request schema that crosses the actor boundary.

The driver builds a ``JobRequest`` from the spec and the chosen plan
(``local.job_request`` today, the operator's driver later) and sends it to
every rank as a plain dict; ``JobRequest.from_dict`` refuses unknown keys so a
driver and a rank of different versions fail loudly instead of dropping a
setting.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from videojob.api.uris import name_problem

STAGES = ("load", "inputs", "encode", "denoise", "decode", "write", "upload")  # upload: between s3:// objects
FAULT_KINDS = ("error", "oom", "exit", "stall")
# Stages of the group's start, not of a job: the driver hands such a fault to
# ``GroupSpec.rendezvous_fault`` (a rank's process dying while the group forms).
GROUP_STAGES = ("rendezvous",)
# "full": the model as published (or the tiny model as catalogued). "medium": the
# benchmarks' size of a full-size DiT (configs.MEDIUM_SIZES: published widths,
# fewer layers, random weights, prompts at the medium size's length).
SIZES = ("full", "medium")


@dataclass(frozen=True)
class FaultInjection:
    """Test hook: make ``rank`` (every rank when None) fail in ``stage``.

    ``kind``: "error" raises a RuntimeError, "oom" an out-of-memory error (as
    a CUDA OOM would), "exit" kills the rank's process (a lost actor),
    "stall" waits (a slow stage: time to cancel it, or to time out) for at most
    ``seconds``, ending early (``stall``) once a cancel or a preemption of the
    job reached the rank (the vote after it then stops the job at once), or once
    the file ``release`` (an absolute path; stalls only) exists: a test creates
    it where the job may go on.
    ``step``: for the denoise stage, the step (1-based) after which it fails;
    None: at the stage's start and, for denoise, after every step.
    ``stage`` "rendezvous" (``GROUP_STAGES``): in the rank's ``init_distributed``,
    before it joins the process group ("oom" has no meaning there; no job, so
    only ``release`` ends a stall there early).
    """

    stage: str
    kind: str = "error"
    rank: int | None = None
    step: int | None = None
    seconds: float = 0.0
    release: str | None = None

    def __post_init__(self) -> None:
        if self.stage not in STAGES + GROUP_STAGES:
            raise ValueError(f"FaultInjection.stage must be one of {STAGES + GROUP_STAGES}, got {self.stage!r}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"FaultInjection.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.stage in GROUP_STAGES and self.kind == "oom":
            raise ValueError(f"FaultInjection.kind 'oom' applies to job stages {STAGES}, not {self.stage!r}")
        if self.release is not None:
            if not isinstance(self.release, str) or not os.path.isabs(self.release):
                raise ValueError(f"FaultInjection.release must be an absolute path, got {self.release!r}")
            if self.kind != "stall":
                raise ValueError(f"FaultInjection.release applies to kind 'stall' only, not {self.kind!r}")

    def applies(self, stage: str, rank: int, step: int | None = None) -> bool:
        if stage != self.stage or (self.rank is not None and rank != self.rank):
            return False
        return self.step is None or step == self.step

    def stall(self, stop: Callable[[], bool] | None = None, poll_s: float = 0.05) -> str:
        """Wait out a "stall": at most ``seconds``, ending early once ``stop()`` is true
        (the job's cancel reached this rank) or the ``release`` file exists. Returns why
        it ended: "stopped", "released" or "elapsed"."""
        deadline = time.monotonic() + max(0.0, float(self.seconds))
        while True:
            if stop is not None and stop():
                return "stopped"
            if self.release is not None and os.path.exists(self.release):
                return "released"
            left = deadline - time.monotonic()
            if left <= 0:
                return "elapsed"
            time.sleep(min(poll_s, left))


@dataclass
class JobRequest:
    """Everything a rank needs for one job (built by the driver from spec + plan)."""

    job_id: str
    model_id: str
    task: str
    prompt: str
    width: int
    height: int
    frames: int
    fps: int
    steps: int
    guidance: float
    # The driver draws a seed when the spec has none, so every rank gets the same one.
    seed: int = 0
    dtype: str = "float32"
    source: str | None = None
    negative_prompt: str = ""
    image: str | None = None  # i2v conditioning image uri
    face_image: str | None = None  # identity (ConsisID): face image uri, embeddings at <uri>.npz
    # A local directory the driver vouches for: image/face_image may then be
    # plain paths inside it (its copies of https inputs, a test's files). A
    # spec never sets it; without it every input must be a pvc:// or local:// uri.
    local_inputs_dir: str | None = None
    # The operator job's namespace (the driver sets it from its request): every
    # local:// and pvc:// location resolves inside that namespace's directory
    # (locations.py). None (`videojob run`): the roots themselves.
    namespace: str | None = None
    offload: str = "none"
    vae_tiling: bool = False
    vae_slicing: bool = False
    fp8_weights: bool = False
    # The plan's decode offload: the denoiser's weights go to the host for the
    # VAE decode and come back before the next job's denoise (offload none only).
    decode_offload: bool = False
    # Skip the CogVideoX VAE's never-read conv cache (bit-identical; the planner counts it).
    skip_unread_conv_cache: bool = True
    cache: str = "off"
    cache_threshold: float | None = None
    output_dir: str | None = None
    # The checked directory output_dir lies in (its namespace's root, from the driver): the
    # ranks open output_dir and checkpoint_dir again from it without following links
    # (beneath.py). None: output_dir is the caller's own (`videojob run`, tests).
    output_root: str | None = None
    # An s3:// output (spec.output.uri): the files are written to output_dir (its
    # staging directory on the pod's volume) and then uploaded there (s3outputs).
    output_object: str | None = None
    output_name: str = "video"  # the job's name (metadata.name): its files are NAME.mp4, .png, .json
    # Without output_dir the frames come back: "uint8" (video) or "float32" (tests compare these).
    frames_dtype: str = "uint8"
    result_extra: dict[str, Any] = field(default_factory=dict)
    # The benchmarks' model size (SIZES). No VideoJob can ask for it: the API has no
    # such field and the drivers never set it (the operator's driver refuses one
    # that is not "full"); benchmarks build their JobRequest themselves.
    size: str = "full"
    # CPU only: count live tensor bytes (a dispatch-mode tracker; costs ~10% on tiny models).
    track_memory: bool = True
    # Test hooks: an out-of-memory error in this stage on every rank (kept for
    # the operator's re-plan tests), or any fault on one rank.
    inject_oom: str | None = None
    inject_fault: dict[str, Any] | None = None
    # Denoising checkpoints (resume.py): the job's own directory (on the output's
    # volume, where every rank reads it), and how often to save (0: never; a
    # checkpoint already there is still resumed from).
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int = 0

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"JobRequest.size must be one of {SIZES}, got {self.size!r}")
        if self.inject_oom is not None and self.inject_oom not in STAGES:
            raise ValueError(f"JobRequest.inject_oom must be one of {STAGES}, got {self.inject_oom!r}")
        if self.decode_offload and self.offload != "none":
            raise ValueError(f"JobRequest.decode_offload needs offload 'none' (got offload {self.offload!r}: "
                             "its hooks already move the weights)")
        self.fault()  # validates inject_fault
        if not isinstance(self.checkpoint_every_steps, int) or self.checkpoint_every_steps < 0:
            raise ValueError(f"JobRequest.checkpoint_every_steps must be a whole number >= 0, "
                             f"got {self.checkpoint_every_steps!r}")
        problem = name_problem(self.output_name)
        if problem is not None:  # it becomes file names: checked wherever a request is made or received
            raise ValueError(f"JobRequest.output_name (metadata.name) {problem}")

    def fault(self) -> FaultInjection | None:
        if self.inject_fault is not None:
            return FaultInjection(**self.inject_fault)
        if self.inject_oom is not None:
            return FaultInjection(stage=self.inject_oom, kind="oom",
                                  step=None if self.inject_oom != "denoise" else max(1, self.steps // 2))
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | "JobRequest") -> "JobRequest":
        if isinstance(data, JobRequest):
            return data
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"JobRequest: unknown field(s) {unknown}: driver and runtime versions differ")
        return cls(**data)
