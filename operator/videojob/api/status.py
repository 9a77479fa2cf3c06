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
    SUBMITTED = "Submitted"  # no longer set (the attempt write says Running); kept for older statuses
    RAY_UNAVAILABLE = "RayUnavailable"
    RAY_AUTH_FAILED = "RayAuthFailed"
    WAITING_FOR_DRIVER = "WaitingForDriver"  # the driver's Ray job waits for a node with the driver resources
    WAITING_FOR_NODE = "WaitingForNode"  # the group's placement waits for a node the autoscaler is launching
    WAITING_FOR_PLACEMENT = "WaitingForPlacement"  # ... while nothing is launching (placement_timeout_s counts)
    NO_PLACEMENT = "NoPlacement"  # nothing could place the group: re-queued, or failed after the requeue limit
    PROTOCOL_INCOMPATIBLE = "ProtocolIncompatible"  # the RayCluster's runtime cannot run the operator's request
    PREEMPTED = "Preempted"  # a job of higher priority needed the GPUs: checkpointed, stopped, queued again
    SUBMISSION_REFUSED = "SubmissionRefused"  # Ray's Jobs API refused the driver for good (a 4xx): not retried
    KUEUE_PENDING = "KueuePending"  # kueue mode: the attempt's Workload waits for Kueue (its message says why)
    KUEUE_EVICTED = "KueueEvicted"  # kueue mode: Kueue evicted or preempted the Workload: stopped, queued again
    # kueue mode: someone set the Workload's spec.active false: stopped at a checkpoint, and the job
    # waits (its next Workload is made inactive too) until a Workload of it is active again
    KUEUE_DEACTIVATED = "KueueDeactivated"
    OPERATOR_ERROR = "OperatorError"  # the operator failed handling the job (e.g. RBAC it lacks): tried again


ConditionStatus = Literal["True", "False", "Unknown"]


class Condition(WireModel):
    """One aspect of the job's state, Kubernetes-style (one entry per type)."""

    type: ConditionType = Field(description="Planned, Admitted, ActorsReady or Completed.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: Reason = Field(description="Why, in one CamelCase word (e.g. DoesNotFit, OutOfMemory).")
    message: str = Field(default="", description="What happened and what to do, for a person.")
    last_transition_time: Optional[datetime] = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: Optional[int] = Field(default=None, description="The spec generation this was set for.")


class PlanStatus(WireModel):
    """The layout chosen for the job and what the planner expects of it."""

    gpus: int = Field(ge=0, description="GPUs the layout uses (ulysses x ring x cfg), all in one pod.")
    ulysses: int = Field(default=1, ge=1, description="Ulysses sequence-parallel degree.")
    ring: int = Field(default=1, ge=1, description="Ring-attention sequence-parallel degree.")
    cfg: int = Field(default=1, ge=1, description="CFG-parallel degree (1 or 2).")
    offload: Literal["none", "model", "group", "sequential"] = Field(
        default="none", description="Where weights live while the job runs (none: all on the GPU).")
    vae_tiling: bool = Field(default=False, description="The VAE decodes in tiles.")
    vae_slicing: bool = Field(default=False, description="The VAE decodes one video of a batch at a time.")
    cache: str = Field(default="off", description="The step cache the job runs with (auto resolved).")
    fp8_weights: bool = Field(default=False, description="The denoiser's weights are stored in float8.")
    decode_offload: bool = Field(default=False, description="The denoiser goes to the host while the VAE decodes.")
    estimated_peak_gi_b_per_gpu: Optional[float] = Field(default=None, alias="estimatedPeakGiBPerGPU",
                                                         description="Planned peak memory per GPU, GiB.")
    estimated_seconds: Optional[float] = Field(default=None, description="Planned wall time, seconds.")
    summary: str = Field(default="", description="One line, e.g. 'u2 x cfg2, no offload'.")
    gpu_class: Optional[str] = Field(default=None, description="The GPU class (kind of pod) the job runs on.")


class ProgressStatus(WireModel):
    """How far denoising is."""

    step: int = Field(default=0, ge=0, description="Denoising steps done.")
    steps: int = Field(default=0, ge=0, description="Denoising steps in all.")
    percent: int = Field(default=0, ge=0, le=100, description="step / steps, percent (0-100).")


class MeasuredStatus(WireModel):
    """What the run measured (next to the plan's estimates)."""

    peak_gi_b: Optional[float] = Field(default=None, alias="peakGiB",
                                       description="Measured peak memory per GPU, GiB (max_memory_allocated).")
    load_seconds: Optional[float] = Field(default=None, description="Seconds loading weights (0 when reused).")
    encode_seconds: Optional[float] = Field(default=None, description="Seconds encoding the prompt.")
    denoise_seconds: Optional[float] = Field(default=None, description="Seconds denoising.")
    decode_seconds: Optional[float] = Field(default=None, description="Seconds decoding with the VAE.")
    write_seconds: Optional[float] = Field(default=None, description="Seconds writing the mp4, poster and result.")
    upload_seconds: Optional[float] = Field(default=None, description="Seconds of write_seconds spent uploading "
                                                                      "them to object storage (s3:// outputs).")
    cache_skip_ratio: Optional[float] = Field(default=None, description="Share of denoiser work the step cache "
                                                                        "reused (0-1).")
    steps_computed: Optional[int] = Field(default=None, ge=0, description="Denoising steps computed by all "
                                                                          "attempts together.")
    checkpoint_seconds: Optional[float] = Field(default=None, description="Seconds the last attempt spent "
                                                                          "saving checkpoints.")
    checkpoint_bytes: Optional[int] = Field(default=None, ge=0, description="Size of one checkpoint, bytes.")


class Attempt(WireModel):
    """One try at running the job; kept so a failed job shows its history."""

    number: int = Field(ge=1, description="1 for the first attempt.")
    plan: Optional[PlanStatus] = Field(default=None, description="The layout this attempt ran with.")
    started_at: Optional[datetime] = Field(default=None, description="When it started (RFC 3339).")
    finished_at: Optional[datetime] = Field(default=None, description="When it ended (RFC 3339).")
    result: Literal["Running", "Succeeded", "Failed", "OutOfMemory", "Cancelled", "Interrupted", "Lost",
                    "Requeued", "Preempted"] = Field(
        default="Running", description="How it ended. Requeued: its group could not be placed and the job went "
                                       "back to the queue. Preempted: a job of higher priority needed its GPUs; it "
                                       "saved a checkpoint and went back to the queue with its priority and age. "
                                       "Neither counts against maxAttempts.")
    reason: Optional[str] = Field(default=None, description="Why it ended so, in one word.")
    message: str = Field(default="", description="What happened: the rank, the stage, the error.")
    submission_id: Optional[str] = Field(
        default=None, description="The Ray job (driver) of this attempt; written before it is submitted, so a "
                                  "restarted operator adopts it instead of submitting another.")
    group: Optional[str] = Field(default=None, description="The actor group this attempt runs on.")
    workload: Optional[str] = Field(default=None, description="kueue admission mode: the Kueue Workload that "
                                                              "admitted this attempt (in the job's namespace).")
    resumed_from_step: Optional[int] = Field(
        default=None, ge=0, description="The checkpoint's step this attempt resumed from (0: from the start).")
    steps_computed: Optional[int] = Field(
        default=None, ge=0, description="Denoising steps this attempt computed (as far as known when it ended).")


class ActorGroupStatus(WireModel):
    """The Ray actor group that runs the job."""

    name: str = Field(description="Its name in Ray (namespace videojob).")
    reused: bool = Field(default=False, description="A warm group was reused (no weight load).")
    kept: bool = Field(default=False, description="The group stays loaded after the job (a warm group that "
                                                  "a later job with the same model, layout and class reuses).")
    pool_key: Optional[str] = Field(default=None, description="What a job must match to reuse this group: a "
                                                              "digest of model, source, layout and GPU class.")


class QueueStatus(WireModel):
    """Where a waiting job stands."""

    position: int = Field(ge=0, description="1 for the next job to start; 0 once admitted.")
    waiting_for: str = Field(default="", description="What it waits for, e.g. '2 free GPUs'.")


class OutputStatus(WireModel):
    """Where the video is."""

    uri: str = Field(description="The directory holding NAME.mp4, NAME.png and NAME.json; for s3:// the "
                                 "objects' prefix, the tenants' prefix and the namespace's part in it "
                                 "(s3://BUCKET/TENANT_PREFIX/NAMESPACE/PREFIX).")
    video: Optional[str] = Field(default=None, description="The mp4 (for s3://, the object's uri).")
    result: Optional[str] = Field(default=None, description="NAME.json, written last: the 'done' marker.")
    video_url: Optional[str] = Field(default=None, description="A presigned https URL of the mp4, when the "
                                                               "cluster's admin turns them on (s3:// only).")
    video_url_expires: Optional[str] = Field(default=None, description="When video_url stops working (UTC, "
                                                                       "RFC 3339).")
    bytes: Optional[int] = Field(default=None, ge=0, description="Size of the mp4, bytes.")
    frames_digest: Optional[str] = Field(default=None, description="SHA-256 of the 8-bit frames: equal digests, "
                                                                   "equal videos.")


class VideoJobStatus(WireModel):
    """What the operator knows about the job; written by the operator only."""

    phase: Phase = Field(default=Phase.PENDING, description="Pending, Planned, Queued, Running, Succeeded, "
                                                            "Failed or Cancelled.")
    conditions: list[Condition] = Field(
        default_factory=list, description="The latest condition of each type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    observed_generation: Optional[int] = Field(default=None, description="The spec generation the status is for.")
    plan: Optional[PlanStatus] = Field(default=None, description="The chosen layout and its estimates.")
    progress: Optional[ProgressStatus] = Field(default=None, description="Denoising progress.")
    queue: Optional[QueueStatus] = Field(default=None, description="Queue position while waiting for GPUs.")
    attempts: list[Attempt] = Field(default_factory=list, description="Every try at running the job, oldest first.")
    measured: Optional[MeasuredStatus] = Field(default=None, description="Measured memory and stage times.")
    actor_group: Optional[ActorGroupStatus] = Field(default=None, description="The actor group running the job.")
    output: Optional[OutputStatus] = Field(default=None, description="The written video.")
    message: str = Field(default="", description="The latest news for a person, one line.")
    start_time: Optional[datetime] = Field(default=None, description="When the first attempt started (RFC 3339).")
    completion_time: Optional[datetime] = Field(default=None, description="When the job ended (RFC 3339).")
