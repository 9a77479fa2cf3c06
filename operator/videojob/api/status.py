"""VideoJob status: what the operator knows, written only when it changes."""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Literal, Optional

from pydantic import Field

from .common import WireModel


class Phase(str, Enum):
    """Lifecycle of a job. Terminal: Succeeded, Failed, Cancelled."""

    PENDING = "Pending"
    PLANNED = "Planned"
    QUEUED = "Queued"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED)


class ConditionType(str, Enum):
    PLANNED = "Planned"
    ADMITTED = "Admitted"
    ACTORS_READY = "ActorsReady"
    COMPLETED = "Completed"


class Reason(str, Enum):
    """Typed condition reasons: what happened, in CamelCase as Kubernetes does."""

    INVALID_SPEC = "InvalidSpec"
    PLANNED = "Planned"
    DOES_NOT_FIT = "DoesNotFit"
    WAITING_FOR_GPUS = "WaitingForGPUs"
    ADMITTED = "Admitted"
    STARTING_ACTORS = "StartingActors"
    ACTORS_READY = "ActorsReady"
    REUSED_WARM_GROUP = "ReusedWarmGroup"
    RUNNING = "Running"
    OUT_OF_MEMORY = "OutOfMemory"
    REPLANNED = "Replanned"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    OPERATOR_RESTARTED = "OperatorRestarted"


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(WireModel):
    type: ConditionType
    status: ConditionStatus
    reason: Reason
    message: str = ""
    last_transition_time: Optional[datetime] = None
    observed_generation: Optional[int] = None


class PlanStatus(WireModel):
    """The layout chosen for the job and what the planner expects of it."""

    gpus: int = Field(ge=0)
    ulysses: int = Field(default=1, ge=1)
    ring: int = Field(default=1, ge=1)
    cfg: int = Field(default=1, ge=1)
    offload: Literal["none", "model", "group", "sequential"] = "none"
    vae_tiling: bool = False
    vae_slicing: bool = False
    cache: str = "off"
    estimated_peak_gi_b_per_gpu: Optional[float] = Field(default=None, alias="estimatedPeakGiBPerGPU")
    estimated_seconds: Optional[float] = None
    summary: str = Field(default="", description="One line, e.g. 'u2 x cfg2, no offload'.")


class ProgressStatus(WireModel):
    step: int = Field(default=0, ge=0)
    steps: int = Field(default=0, ge=0)
    percent: int = Field(default=0, ge=0, le=100)


class MeasuredStatus(WireModel):
    peak_gi_b: Optional[float] = Field(default=None, alias="peakGiB")
    load_seconds: Optional[float] = None
    encode_seconds: Optional[float] = None
    denoise_seconds: Optional[float] = None
    decode_seconds: Optional[float] = None
    write_seconds: Optional[float] = None


class Attempt(WireModel):
    """One try at running the job; kept so a failed job shows its history."""

    number: int = Field(ge=1)
    plan: Optional[PlanStatus] = None
    started_at: Optional[datetime] = None
    finished_at: Optional[datetime] = None
    result: Literal["Running", "Succeeded", "Failed", "OutOfMemory", "Cancelled", "Interrupted"] = "Running"
    reason: Optional[str] = None
    message: str = ""


class ActorGroupStatus(WireModel):
    name: str
    reused: bool = False


class OutputStatus(WireModel):
    uri: str
    bytes: Optional[int] = Field(default=None, ge=0)


class VideoJobStatus(WireModel):
    phase: Phase = Phase.PENDING
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: Optional[int] = None
    plan: Optional[PlanStatus] = None
    progress: Optional[ProgressStatus] = None
    attempts: list[Attempt] = Field(default_factory=list)
    measured: Optional[MeasuredStatus] = None
    actor_group: Optional[ActorGroupStatus] = None
    output: Optional[OutputStatus] = None
    message: str = ""
    start_time: Optional[datetime] = None
    completion_time: Optional[datetime] = None
