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
