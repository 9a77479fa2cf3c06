"""Settings read from the environment (``VIDEOJOB_`` prefix), typed.

One model per process kind, so each says exactly what it reads. Values are
read when a model is instantiated, not at import, so a test or a pod can set
the environment first.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Optional

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RunSettings(BaseSettings):
    """``videojob run`` and the embedded runtime (one machine, no cluster)."""

    model_config = SettingsConfigDict(env_prefix="VIDEOJOB_", extra="ignore")

    ray_address: Optional[str] = Field(
        default=None,
        description="Ray cluster to connect to (ray.init address). Unset: start an embedded local Ray "
                    "with its own temp dir, never one found on the machine.",
    )
    output_root: str = Field(default="out", description="Where local:// outputs resolve for `videojob run`.")
    max_workers: int = Field(default=2048, ge=8, le=100_000,
                             description="Most threads lent to jobs at once (planning, submitting, watching a "
                                         "driver); a queued job holds none, so this bounds jobs running at once, "
                                         "not jobs in the queue.")
    queue_status_interval_s: float = Field(default=30.0, ge=0,
                                           description="Least seconds between rewrites of a queued job's place "
                                                       "(a long queue moves every time a job starts).")
    cpus_per_rank: Optional[float] = Field(
        default=None, gt=0, description="CPUs each CPU rank's bundle asks for (default: the machine's CPUs / ranks, at most 1).")
    placement_timeout_s: float = Field(default=300.0, gt=0, description="Seconds to wait for the group's placement.")
    group_start_timeout_s: float = Field(
        default=600.0, gt=0,
        description="Seconds a placed group's rank actors may take to start (a fresh worker imports torch, "
                    "diffusers and xfuser) and then to meet for torch.distributed; apart from the placement "
                    "timeout, which is about finding room.")
    job_timeout_s: float = Field(default=3600.0, gt=0, description="Seconds a job may run before it is cancelled.")
    # https inputs (spec.image, spec.faceImage): the driver fetches each once per
    # job, before the ranks start, into a directory removed when the job ends.
    input_fetch_timeout_s: float = Field(
        default=30.0, gt=0,
        description="Seconds to wait for an https input's server to accept the connection, and for each read.")
    input_fetch_deadline_s: float = Field(
        default=300.0, gt=0, description="Seconds one https input may take to download in all.")
    input_max_bytes: int = Field(
        default=64 * 2**20, gt=0,
        description="Largest https input (an image, or ConsisID's face embeddings) fetched; a larger one fails "
                    "the job naming the field.")
    input_ca_bundle: Optional[str] = Field(
        default=None,
        description="PEM file of the certificate authorities https inputs are checked against "
                    "(unset: the system's). Certificates are always checked.")
    input_allow_private_hosts: bool = Field(
        default=False,
        description="Fetch https inputs from loopback, private, link-local and other non-public addresses "
                    "(off: a spec could otherwise make the runtime read cluster services or a cloud's "
                    "metadata endpoint).")
    input_staging_root: Optional[str] = Field(
        default=None,
        description="Directory in which each attempt's fetched inputs get their own directory, removed when the "
                    "attempt ends (unset: the system temp dir). The ranks read them there: in a cluster it must be "
                    "a volume every Ray pod mounts at the same path (the chart: <data volume>/staging).")
    input_staging_stale_s: float = Field(
        default=900.0, ge=60,
        description="A staging directory whose driver has not marked it alive for this long (a driver killed "
                    "before it could clean up) is removed by the next driver that stages inputs.")


# S3Settings.tenant_prefix: plain names joined by '/' (no empty, '.' or '..' segment: a key
# prefix that cannot climb or vanish); the chart's values.schema.json has the same pattern.
_PREFIX_NAME = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"
TENANT_PREFIX = re.compile(rf"^{_PREFIX_NAME}(/{_PREFIX_NAME}){{0,7}}\Z")


class S3Settings(BaseSettings):
    """The cluster admin's S3 store for s3:// outputs, inputs and model sources.

    Credentials are never here nor in a spec: boto3's own chain reads them
    (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY from the chart's Secret, or
    a web identity token where the cloud offers workload identity)."""

    model_config = SettingsConfigDict(env_prefix="VIDEOJOB_S3_", extra="ignore")

    endpoint_url: Optional[str] = Field(
        default=None, description="The S3 endpoint, e.g. https://s3.eu-west-1.amazonaws.com or a local server "
                                  "(unset: AWS's endpoint for the region).")
    region: str = Field(default="us-east-1", description="The region requests are signed for.")
    addressing_style: str = Field(default="path", pattern="^(path|virtual|auto)$",
                                  description="path (BUCKET in the path: most self-hosted servers) or virtual "
                                              "(BUCKET in the host name).")
    buckets: Optional[str] = Field(
        default=None, description="Comma-separated buckets a job may name; unset: an operator job (a tenant's) "
                                  "may name none, `videojob run` any the credentials reach. An operator job's "
                                  "keys are under TENANT_PREFIX/<namespace>/.")
    tenant_prefix: str = Field(
        default="videojob-tenants",
        description="The fixed key prefix every operator job's keys are under, its namespace's folder inside it "
                    "(TENANT_PREFIX/<namespace>/key), so no namespace reaches a folder the admin keeps beside it "
                    "in a listed bucket; '/'-separated plain names, not empty, no '.' or '..'. `videojob run` "
                    "(no namespace) uses keys as written.")
    cache_root: Optional[str] = Field(
        default=None, description="Where s3:// inputs and model sources are downloaded once per pod (a volume "
                                  "every rank of the pod mounts; unset: VIDEOJOB_INPUT_STAGING_ROOT/s3-cache, "
                                  "else the system temp dir).")
    staging_root: Optional[str] = Field(
        default=None, description="Where an s3:// output's files and checkpoints are written before they are "
                                  "uploaded (unset: the cache root's outputs/ directory).")
    part_bytes: int = Field(default=8 * 2**20, ge=5 * 2**20, le=5 * 2**30,
                            description="Multipart upload part size; files up to this size go in one PUT.")
    model_max_bytes: int = Field(default=200 * 2**30, gt=0,
                                 description="Most bytes an s3:// model source may download in all.")
    presign_expiry_s: int = Field(default=0, ge=0, le=7 * 86400,
                                  description="Seconds a presigned URL of the video in the job's result lasts "
                                              "(0: no presigned URL).")
    timeout_s: float = Field(default=60.0, gt=0, description="Seconds to connect to the store and for each read.")

    @field_validator("tenant_prefix")
    @classmethod
    def _tenant_prefix(cls, value: str) -> str:
        if not TENANT_PREFIX.match(value) or ".." in value:
            raise ValueError(f"VIDEOJOB_S3_TENANT_PREFIX (the chart's runtime.s3.tenantPrefix) must be a key prefix "
                             f"of '/'-separated names of letters, digits, '.', '_' and '-', each starting and "
                             f"ending with a letter or digit, e.g. videojob-tenants: not empty, no '..', no "
                             f"leading or trailing '/'; got {value!r}")
        return value

    def listed_buckets(self) -> list[str]:
        return [b.strip() for b in (self.buckets or "").split(",") if b.strip()]

    def bucket_allowed(self, bucket: str) -> bool:
        listed = self.listed_buckets()
        return not listed or bucket in listed


class OperatorSettings(BaseSettings):
    """``videojob operator`` (kopf inside): where Ray is, what the cluster offers, how often to look."""

    model_config = SettingsConfigDict(env_prefix="VIDEOJOB_", extra="ignore")

    ray_mode: str = Field(
        default="embedded", pattern="^(embedded|address)$",
        description="embedded: start a local Ray head as a child process (a CPU trial; the runtime must be "
                    "installed beside the operator); address: use the Ray cluster at ray_dashboard_url.")
    ray_dashboard_url: Optional[str] = Field(
        default=None, description="The Ray head's dashboard (Jobs API), e.g. http://raycluster-head:8265.")
    ray_token_file: Optional[str] = Field(
        default=None, description="File holding the bearer token Ray's dashboard expects (a mounted Secret).")
    runtime_key_file: Optional[str] = Field(
        default=None, description="The runtime key shared with every Ray process (a mounted Secret; "
                                  "videojob.runtimekey reads it, and so do the drivers and ranks): unset, this "
                                  "user's ~/.config/videojob/runtime-key, made on first use.")
    ray_http_timeout_s: float = Field(default=10.0, gt=0, description="Seconds per HTTP call to Ray.")
    ray_http_retries: int = Field(
        default=4, ge=0, le=10,
        description="Tries again of one HTTP call to Ray that could not connect (backoff 0.5 s, doubling) "
                    "before the job says Ray is unavailable and waits rayRetryS.")
    inventory_file: Optional[str] = Field(
        default=None,
        description="YAML with the GPUs one job may use (gpuMemory, gpusPerNode, hostMemory, gpuType, device); "
                    "unset: this machine's CPUs as CPU ranks (the embedded trial).")
    progress_interval_s: float = Field(default=2.0, gt=0, description="Least seconds between progress writes.")
    poll_interval_s: float = Field(default=1.0, gt=0, description="Seconds between looks at a running job.")
    watch_timeout_s: int = Field(default=600, gt=0,
                                   description="Seconds before the API server ends a watch (kopf re-opens it).")
    kube_api_timeout_s: float = Field(
        default=30.0, gt=0, le=600,
        description="Seconds any call to the Kubernetes API waits for its answer before it gives up (and is "
                    "retried): a connection dropped silently must not wedge a job's thread, the sweeper or the "
                    "Workload watch (a watch waits its server-side timeout plus this).")
    namespaces: list[str] = Field(default_factory=list,
                                  description="Namespaces to watch (empty: all; comma-separated in the env).")
    metrics_port: int = Field(default=8080, ge=0, le=65535,
                              description="Port of /metrics and /healthz (0: pick a free one).")
    driver_python: str = Field(
        default="python",
        description="The Python every driver (the Ray job entrypoint, `PYTHON -m videojob_runtime.driver`) runs "
                    "with; it must import videojob_runtime. address mode: `python` (the runtime image's, first on "
                    "the Ray node's PATH). embedded mode, unless set: the operator's own Python (sys.executable), "
                    "whose environment also runs the Ray head it starts; see driver_interpreter.")
    placement_timeout_s: float = Field(
        default=600.0, gt=0,
        description="Seconds a group may wait to be placed while no node for it is being launched (the time the "
                    "autoscaler spends launching one does not count: placement_max_wait_s bounds that).")
    placement_max_wait_s: float = Field(
        default=3600.0, gt=0,
        description="Most seconds one attempt's group may wait to be placed in all, while the autoscaler launches "
                    "nodes of its class (a pod scaled from zero plus an image pull); at least placement_timeout_s.")
    placement_requeue_limit_s: float = Field(
        default=3600.0, ge=0,
        description="A job whose group cannot be placed (no room, nothing launching) is re-queued without using "
                    "up an attempt; after this many seconds of such re-queues, counted from the first, it fails "
                    "with reason NoPlacement (0: fail at the first).")
    job_timeout_s: float = Field(default=6 * 3600.0, gt=0, description="Seconds one attempt may run.")
    driver_resources: dict[str, float] = Field(
        default={},  # pydantic copies it per instance
        description="Ray resources every driver the operator submits asks for (its Ray job's entrypoint_resources), "
                    "so drivers run only on nodes that offer them, never on the Ray head; a JSON object in the env, "
                    'e.g. VIDEOJOB_DRIVER_RESOURCES=\'{"vj-driver": 1}\'. {} (the default): anywhere, the head '
                    "included (Ray pins such drivers to the head), as the embedded and address modes have it.")
    ray_retry_s: float = Field(default=5.0, gt=0, description="Seconds between tries while Ray is unreachable.")
    embedded_ray_cpus: Optional[int] = Field(default=None, ge=1,
                                             description="CPUs the embedded Ray head offers (default: all).")
    max_workers: int = Field(default=2048, ge=8, le=100_000,
                             description="Threads for the jobs' daemons and handlers: at least the most VideoJobs "
                                         "that are not finished at once, plus some for deletions.")
    queue_status_interval_s: float = Field(default=30.0, ge=0,
                                           description="Least seconds between rewrites of a queued job's place "
                                                       "(a long queue moves every time a job starts).")
    cpus_per_rank: Optional[float] = Field(
        default=None, gt=0, description="CPUs each CPU rank's bundle asks for (device cpu only; default: the "
                                        "Ray cluster's CPUs / ranks, at most 1).")
    warm_group_ttl_s: float = Field(
        default=600.0, ge=0, description="Seconds an idle warm group (a loaded pipeline kept after its job) stays "
                                         "before it is torn down; 0: never keep groups after a job.")
    sweep_interval_s: float = Field(default=15.0, gt=0,
                                    description="Seconds between sweeps of idle-group TTLs and ownerless groups.")
    ttl_seconds_after_finished: int = Field(
        default=604800, ge=-1, le=10 * 365 * 86400,
        description="Seconds a finished VideoJob (Succeeded, Failed or Cancelled) is kept before the operator "
                    "deletes it, for jobs without spec.ttlSecondsAfterFinished (default 7 days; its outputs "
                    "stay where they were written); -1: kept until someone deletes it.")
    ray_job_retention_s: float = Field(
        default=300.0, ge=0,
        description="Seconds a finished driver whose end the operator did not get to delete (it crashed between "
                    "writing the attempt's end and deleting the driver) stays in Ray's job table before the "
                    "sweeper deletes it; also the least seconds between the sweeper's looks at the whole table.")
    health_stall_s: float = Field(
        default=60.0, ge=1.0,
        description="/healthz answers 503 (the liveness probe fails) when kopf's event loop, or the Admissions "
                    "lock, has shown no progress for this many seconds (the sweeper: for the longest one step of a "
                    "sweep may take, its calls' timeouts and tries, when that is longer); the heartbeats come every "
                    "min(5, this / 4) seconds, whether or not there are jobs.")
    max_attempts: int = Field(default=3, ge=1, le=20,
                              description="Attempts a job gets (out-of-memory re-plans and lost-rank retries "
                                          "included) before it fails with its whole story in status.")
    retry_backoff_s: float = Field(default=5.0, ge=0,
                                   description="Seconds before the first retry after a lost actor, driver or pod; "
                                               "doubled for each further retry.")
    oom_margin: float = Field(default=1.25, gt=1.0, le=4.0,
                              description="After an out-of-memory failure the job is re-planned assuming it needs "
                                          "this many times the estimated memory (compounded per such failure).")
    admission: str = Field(
        default="builtin", pattern="^(builtin|kueue)$",
        description="Who admits jobs: builtin (the operator's own scheduler owns every GPU of its classes) or "
                    "kueue (each attempt is a Kueue Workload in the job's LocalQueue; Kueue's quotas, fair "
                    "sharing and preemption decide; no warm groups are kept, as their GPUs would be outside "
                    "Kueue's books).")
    kueue_default_queue: str = Field(
        default="default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="kueue mode: the LocalQueue of jobs without spec.queueName (in their namespace).")
    kueue_poll_interval_s: float = Field(
        default=2.0, gt=0, description="kueue mode: seconds between looks at a running job's Workload (evicted?); "
                                       "a waiting job parks and is woken by the Workload watch when its Workload "
                                       "changes (at least every 60 s; every this many seconds without a watch).")
    allow_fault_injection: bool = Field(
        default=False, description="Honour the videojob.io/inject-fault annotation (tests only: it makes a job "
                                   "fail on purpose).")

    @field_validator("driver_resources", mode="before")
    @classmethod
    def _driver_resources(cls, value):
        if isinstance(value, str):
            value = _json_object(value)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"VIDEOJOB_DRIVER_RESOURCES must be a JSON object of Ray resource names to amounts, "
                             f'e.g. {{"vj-driver": 1}}; got {value!r}')
        for name, amount in value.items():
            problem = driver_resource_problem(name, amount)
            if problem:
                raise ValueError(f"VIDEOJOB_DRIVER_RESOURCES: {problem}")
        return {str(k): float(v) for k, v in value.items()}

    @model_validator(mode="after")
    def _placement_bounds(self):
        if self.placement_max_wait_s < self.placement_timeout_s:
            raise ValueError(f"VIDEOJOB_PLACEMENT_MAX_WAIT_S ({self.placement_max_wait_s:g}) must be at least "
                             f"VIDEOJOB_PLACEMENT_TIMEOUT_S ({self.placement_timeout_s:g}): it bounds the whole "
                             "wait, the timeout only the part with nothing launching")
        return self

    @property
    def driver_interpreter(self) -> str:
        """The Python drivers run with: driver_python when it is set (the environment, or
        the chart, which always sets it); else, in embedded mode, the operator's own
        (``videojob operator`` from a venv that is not activated would otherwise hand
        its drivers whatever `python` comes first on PATH, which cannot import the
        runtime); else `python`."""
        if self.ray_mode == "embedded" and "driver_python" not in self.model_fields_set:
            return sys.executable or self.driver_python
        return self.driver_python

    @property
    def entrypoint_resources(self) -> dict[str, float]:
        """What each driver's Ray job asks for besides its 0 CPUs ({}: anywhere)."""
        return dict(self.driver_resources)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return init_settings, _CommaListEnv(settings_cls), dotenv_settings, file_secret_settings


# Ray's own resource names: a Ray job takes them as entrypoint_num_cpus and the like,
# and Ray refuses them among custom resources.
_RAY_BUILTIN = {"CPU", "GPU", "memory", "object_store_memory"}
_RESOURCE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:/-]{0,61}[A-Za-z0-9])?$")


def driver_resource_problem(name: object, amount: object) -> str | None:
    """Why ``name: amount`` cannot be a driver's Ray resource (None: it can)."""
    if not isinstance(name, str) or not _RESOURCE_NAME.match(name):
        return (f"resource name {name!r} must be 1-63 letters, digits, '-', '_', '.', ':' or '/', starting and "
                "ending with a letter or digit (the name a Ray worker group advertises in rayStartParams.resources)")
    if name in _RAY_BUILTIN:
        return (f"{name!r} is one of Ray's own resources ({', '.join(sorted(_RAY_BUILTIN))}); drivers ask for none "
                "of them: name the custom resource the drivers' worker group advertises, e.g. vj-driver")
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) or amount <= 0:
        return f"{name}: {amount!r} must be a positive number (the share of one driver slot, usually 1)"
    return None


from pydantic_settings import EnvSettingsSource  # noqa: E402


class _CommaListEnv(EnvSettingsSource):
    """``VIDEOJOB_NAMESPACES=a,b`` (as a Deployment's env writes it), besides JSON lists."""

    def prepare_field_value(self, field_name, field, value, value_is_complex):
        if field_name == "driver_resources" and isinstance(value, str):
            return value  # parsed by the field's validator, whose errors name the variable
        if field_name == "namespaces" and isinstance(value, str) and not value.strip().startswith("["):
            return [v.strip() for v in value.split(",") if v.strip()]
        return super().prepare_field_value(field_name, field, value, value_is_complex)


def _json_object(text: str):
    """VIDEOJOB_DRIVER_RESOURCES: a JSON object (an empty value: {})."""
    import json

    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"VIDEOJOB_DRIVER_RESOURCES must be a JSON object such as '{{\"vj-driver\": 1}}', got "
                         f"{text!r} ({exc})") from None
