"""What the operator and a job's driver say to each other, through Ray's Jobs API.

The operator submits one Ray job per attempt whose entrypoint runs
``python -m videojob_runtime.driver --request <base64 JSON>``; the driver
prints one-line records to its stdout, which the operator reads back with
``GET /api/jobs/{id}/logs``. Both sides import this module (it needs neither
torch nor ray), so the two ends cannot disagree on a field.

Records are lines ``@@videojob {json}`` (the marker keeps them apart from
whatever Ray and libraries print): ``{"type": "progress", ...}`` while the job
runs, exactly one ``{"type": "result", ...}`` at the end; and one
``{"type": "group", "name", "reused", "world", "seconds"}`` once the job's
actor group is ready (found by name and reused, or started).
"""

from __future__ import annotations

import base64
import json
import re
import shlex
from typing import Any, Iterator, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

MARKER = "@@videojob "
PROTOCOL_VERSION = 1


class GroupRequest(BaseModel):
    """The actor group a driver finds by name or creates."""

    model_config = ConfigDict(extra="forbid")

    name: str
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1
    device: Literal["cpu", "cuda"] = "cpu"
    bundle_resources: dict[str, float] = Field(default_factory=dict)
    cpus_per_rank: Optional[float] = None
    # Keep the group (a warm pipeline) after the job; False: tear it down.
    keep: bool = False


class DriverRequest(BaseModel):
    """One attempt of one VideoJob, as the driver receives it."""

    model_config = ConfigDict(extra="forbid")

    version: int = PROTOCOL_VERSION
    namespace: str
    name: str
    uid: str
    attempt: int = 1
    group: GroupRequest
    # runtime JobRequest fields (videojob_runtime.request.JobRequest), minus output_dir:
    job: dict[str, Any]
    # Where the files go: resolved by the driver, on the cluster's side of the volumes.
    output_uri: Optional[str] = None
    placement_timeout_s: float = 300.0
    job_timeout_s: float = 3600.0
    progress_interval_s: float = 1.0

    def encode(self) -> str:
        return base64.urlsafe_b64encode(self.model_dump_json().encode()).decode()

    @classmethod
    def decode(cls, text: str) -> "DriverRequest":
        return cls.model_validate_json(base64.urlsafe_b64decode(text.encode()))

    def entrypoint(self, python: str = "python") -> str:
        return f"{shlex.quote(python)} -m videojob_runtime.driver --request {self.encode()}"


_SAFE = re.compile(r"[^a-z0-9-]+")


def submission_id(namespace: str, name: str, uid: str, attempt: int) -> str:
    """Deterministic per (job, attempt): written to status before the POST, so a
    restarted operator adopts the driver instead of submitting another."""
    base = _SAFE.sub("-", f"vj-{namespace}-{name}".lower()).strip("-")[:80]
    return f"{base}-{uid.split('-')[0][:8]}-a{attempt}"


def record(kind: str, **fields: Any) -> str:
    return MARKER + json.dumps({"type": kind, **fields}, default=str, separators=(",", ":"))


def records(logs: str) -> Iterator[dict[str, Any]]:
    """The driver's records in a log text, oldest first (malformed lines skipped)."""
    for line in logs.splitlines():
        start = line.find(MARKER)
        if start < 0:
            continue
        try:
            item = json.loads(line[start + len(MARKER):])
        except ValueError:
            continue
        if isinstance(item, dict) and "type" in item:
            yield item


def last_progress(logs: str) -> dict[str, Any] | None:
    found = None
    for item in records(logs):
        if item["type"] == "progress":
            found = item
    return found


def result_of(logs: str) -> dict[str, Any] | None:
    for item in records(logs):
        if item["type"] == "result":
            return item
    return None


GROUP_PREFIX = "vj-"


def group_name(owner_uid: str, tag: str = "") -> str:
    """An actor group's name, derived from the job that owns it (its uid), so a
    sweeper can tell whose a group is. The runtime names groups with this too."""
    if not owner_uid or not all(c.isalnum() or c == "-" for c in owner_uid):
        raise ValueError(f"group owner uid must be letters, digits and '-', got {owner_uid!r}")
    return f"{GROUP_PREFIX}{owner_uid}" + (f"-{tag}" if tag else "")


def teardown_entrypoint(group: str, world: int = 0, python: str = "python") -> str:
    """The entrypoint of a driver that removes group ``group`` by name (its
    ranks ``0..world-1``, any other rank alive under that name, its placement
    group) and prints one result record (``removed``: what it found); for a
    group whose driver was killed before it could tear it down."""
    if not group.startswith(GROUP_PREFIX) or not all(c.isalnum() or c == "-" for c in group):
        raise ValueError(f"not a group name: {group!r}")
    return f"{shlex.quote(python)} -m videojob_runtime.driver --teardown {group} --world {int(world)}"
