"""Settings read from the environment (``VIDEOJOB_`` prefix), typed.

One model per process kind, so each says exactly what it reads. Values are
read when a model is instantiated, not at import, so a test or a pod can set
the environment first.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field
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
                             description="Threads for the jobs' daemons and handlers: at least the most VideoJobs "
                                         "that are not finished at once, plus some for deletions.")
    queue_status_interval_s: float = Field(default=30.0, ge=0,
                                           description="Least seconds between rewrites of a queued job's place "
                                                       "(a long queue moves every time a job starts).")
    cpus_per_rank: Optional[float] = Field(
        default=None, gt=0, description="CPUs each CPU rank's bundle asks for (default: the machine's CPUs / ranks, at most 1).")
    placement_timeout_s: float = Field(default=300.0, gt=0, description="Seconds to wait for the group's placement.")
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
        description="Directory in which each job's fetched inputs get their own directory, removed when the job "
                    "ends (unset: the system temp dir). The ranks read them there: it must be on their machine.")


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
    ray_http_timeout_s: float = Field(default=10.0, gt=0, description="Seconds per HTTP call to Ray.")
    inventory_file: Optional[str] = Field(
        default=None,
        description="YAML with the GPUs one job may use (gpuMemory, gpusPerNode, hostMemory, gpuType, device); "
                    "unset: this machine's CPUs as CPU ranks (the embedded trial).")
    progress_interval_s: float = Field(default=2.0, gt=0, description="Least seconds between progress writes.")
    poll_interval_s: float = Field(default=1.0, gt=0, description="Seconds between looks at a running job.")
    watch_timeout_s: int = Field(default=600, gt=0,
                                   description="Seconds before the API server ends a watch (kopf re-opens it).")
    namespaces: list[str] = Field(default_factory=list,
                                  description="Namespaces to watch (empty: all; comma-separated in the env).")
    metrics_port: int = Field(default=8080, ge=0, le=65535,
                              description="Port of /metrics and /healthz (0: pick a free one).")
    driver_python: str = Field(default="python",
                               description="The Python the Ray job entrypoint runs (in the runtime image).")
    placement_timeout_s: float = Field(default=600.0, gt=0, description="Seconds a group may wait to be placed.")
    job_timeout_s: float = Field(default=6 * 3600.0, gt=0, description="Seconds one attempt may run.")
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
    max_attempts: int = Field(default=3, ge=1, le=20,
                              description="Attempts a job gets (out-of-memory re-plans and lost-rank retries "
                                          "included) before it fails with its whole story in status.")
    retry_backoff_s: float = Field(default=5.0, ge=0,
                                   description="Seconds before the first retry after a lost actor, driver or pod; "
                                               "doubled for each further retry.")
    oom_margin: float = Field(default=1.25, gt=1.0, le=4.0,
                              description="After an out-of-memory failure the job is re-planned assuming it needs "
                                          "this many times the estimated memory (compounded per such failure).")
    allow_fault_injection: bool = Field(
        default=False, description="Honour the videojob.io/inject-fault annotation (tests only: it makes a job "
                                   "fail on purpose).")

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings):
        return init_settings, _CommaListEnv(settings_cls), dotenv_settings, file_secret_settings


from pydantic_settings import EnvSettingsSource  # noqa: E402


class _CommaListEnv(EnvSettingsSource):
    """``VIDEOJOB_NAMESPACES=a,b`` (as a Deployment's env writes it), besides JSON lists."""

    def prepare_field_value(self, field_name, field, value, value_is_complex):
        if field_name == "namespaces" and isinstance(value, str) and not value.strip().startswith("["):
            return [v.strip() for v in value.split(",") if v.strip()]
        return super().prepare_field_value(field_name, field, value, value_is_complex)
