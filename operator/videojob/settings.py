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
    cpus_per_rank: Optional[float] = Field(
        default=None, gt=0, description="CPUs each CPU rank's bundle asks for (default: the machine's CPUs / ranks, at most 1).")
    placement_timeout_s: float = Field(default=300.0, gt=0, description="Seconds to wait for the group's placement.")
    job_timeout_s: float = Field(default=3600.0, gt=0, description="Seconds a job may run before it is cancelled.")
