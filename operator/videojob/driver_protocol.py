"""What the operator and a job's driver say to each other, through Ray's Jobs API.

The operator submits one Ray job per attempt whose entrypoint runs
``python -m videojob_runtime.driver --request <base64 JSON>`` (or, for a
request whose https input has a query, ``--request-env`` with the request
sealed under the runtime key in the submission's runtime_env:
``DriverRequest.submission``, ``videojob.runtimekey``); the driver
prints one-line records to its stdout, which the operator reads back with
``GET /api/jobs/{id}/logs``. Both sides import this module (it needs neither
torch nor ray), so the two ends cannot disagree on a field.

Records are lines ``@@videojob {json}`` (the marker keeps them apart from
whatever Ray and libraries print): ``{"type": "progress", ...}`` while the job
runs, exactly one ``{"type": "result", ...}`` at the end; and one
``{"type": "group", "name", "reused", "world", "seconds"}`` once the job's
actor group is ready (found by name and reused, or started). Every record a
driver prints carries ``protocol``: the version that driver speaks.

Versions (``PROTOCOL``, "MAJOR.MINOR"): the operator and the runtime are
upgraded separately (``helm upgrade`` restarts the operator on new code while
a running RayCluster keeps its runtime image), so a driver may be older or
newer than the operator that sends it a request.

- A minor bump only adds optional fields (each marked ``since`` in its
  ``Field``) that an older driver may ignore: it drops fields it does not
  know (listing them in its records as ``ignored``) instead of refusing the
  request. A new optional field is left out of the request while it holds
  its default, so an older driver never even sees it unless it is used.
- ``requires``: features (names in ``FEATURES``) without which the request
  must not run; a driver that lacks one refuses the request.
- A major bump (``version``) changes or removes what was there: a driver of
  another major refuses the request.

A refusal is a result record with reason ``ProtocolIncompatible`` and a
message saying what the runtime speaks and what the operator needs
(``incompatibility``); the operator fails the attempt with it, without a
retry. Drivers of protocol 1.0 (before versions were checked) refuse any
unknown field while decoding (``BadRequest``): the operator recognises that
answer too (``controller.outcome``).
"""

from __future__ import annotations

import base64
import json
import re
import shlex
from typing import Any, Iterator, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

MARKER = "@@videojob "
PROTOCOL_MAJOR = 1
PROTOCOL_MINOR = 2  # 1.2: a request in REQUEST_ENV may be sealed (runtimekey.SEALED_PREFIX)
PROTOCOL = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
PROTOCOL_VERSION = PROTOCOL_MAJOR  # the request's ``version`` field: its major
# What a driver of this protocol can do that a request may require (``requires``):
# placement-wait: waits for a node the autoscaler is launching (group.node_type,
# placement_max_wait_s) instead of failing at placement_timeout_s.
FEATURES = frozenset({"placement-wait"})
UPGRADE_HINT = "upgrade the RayCluster's runtime image to the operator's version"
# The environment variable a driver started as ``--request-env`` reads its request from.
REQUEST_ENV = "VIDEOJOB_DRIVER_REQUEST"


def _since(version: str) -> dict[str, Any]:
    """``Field(json_schema_extra=...)`` of an optional field added in protocol ``version``."""
    return {"since": version}


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
    # The Ray autoscaler's node type that offers this group's GPU class (KubeRay:
    # the worker group's name, which the chart sets to the class name): while
    # one is being launched, the placement waits for it.
    node_type: Optional[str] = Field(default=None, json_schema_extra=_since("1.1"))


class DriverRequest(BaseModel):
    """One attempt of one VideoJob, as the driver receives it. Strict where it is
    built (an unknown keyword is a bug); lenient where it is read (``decode``)."""

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
    # Features the driver must have to run this request (FEATURES); else it refuses it.
    requires: list[str] = Field(default_factory=list, json_schema_extra=_since("1.1"))
    # The most seconds a placement may wait while the autoscaler launches a node for
    # it (placement_timeout_s counts only the time nothing is launching); None: no
    # longer than placement_timeout_s.
    placement_max_wait_s: Optional[float] = Field(default=None, json_schema_extra=_since("1.1"))

    def encode(self) -> str:
        return base64.urlsafe_b64encode(json.dumps(_wire(self), separators=(",", ":")).encode()).decode()

    @classmethod
    def decode(cls, text: str) -> "DriverRequest":
        """The request in ``text``, its unknown fields dropped (``decode_request`` says which)."""
        return decode_request(text)[0]

    def entrypoint(self, python: str = "python") -> str:
        return f"{shlex.quote(python)} -m videojob_runtime.driver --request {self.encode()}"

    def submission(self, python: str = "python") -> tuple[str, dict[str, Any] | None]:
        """(entrypoint, runtime_env) to submit this request with. A request whose
        https input carries a query or fragment (a presigned URL's key) travels in the
        submission's body, as the driver's environment (``REQUEST_ENV``), sealed under
        the runtime key (``runtimekey.seal``: Ray's job table and its runtime env
        agent's log keep the runtime_env, and only a holder of the key opens it), and
        the entrypoint is ``--request-env``. Any other request stays on the command
        line, which every driver version reads (the driver moves it off: ``hide_request``).
        Raises ``runtimekey.RuntimeKeyError`` when the key cannot be read."""
        inputs = (self.job.get("image"), self.job.get("face_image"))
        if not any(isinstance(uri, str) and uri.startswith("https://") and ("?" in uri or "#" in uri)
                   for uri in inputs):
            return self.entrypoint(python), None
        from .runtimekey import seal

        return (f"{shlex.quote(python)} -m videojob_runtime.driver --request-env",
                {"env_vars": {REQUEST_ENV: seal(self.encode().encode())}})


def _wire(model: BaseModel) -> dict[str, Any]:
    """``model`` as JSON data, without the fields added after 1.0 that still hold
    their defaults (an older driver never sees what is not used)."""
    data = model.model_dump(mode="json")
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            data[name] = _wire(value)
        elif (info.json_schema_extra or {}).get("since") and value == info.get_default(call_default_factory=True):
            data.pop(name, None)
    return data


class ProtocolIncompatible(ValueError):
    """A request this driver must not run: another major version, or a required feature it lacks."""


def incompatibility(data: dict[str, Any]) -> str | None:
    """Why a driver of this protocol must refuse the request ``data`` (None: it may run it)."""
    major = data.get("version", 1)
    if not isinstance(major, int) or isinstance(major, bool):
        return f"the request's protocol version {major!r} is not a major version number"
    if major != PROTOCOL_MAJOR:
        return (f"this runtime speaks protocol {PROTOCOL}; the operator needs protocol {major}.x: "
                f"{UPGRADE_HINT if major > PROTOCOL_MAJOR else 'upgrade the operator to match the runtime'}")
    required = data.get("requires") or []
    if not isinstance(required, list) or not all(isinstance(f, str) for f in required):
        return f"the request's requires {required!r} is not a list of feature names"
    missing = sorted(set(required) - FEATURES)
    if missing:
        return (f"this runtime speaks protocol {PROTOCOL} (features: {', '.join(sorted(FEATURES))}); the operator "
                f"needs feature(s) {', '.join(missing)}: {UPGRADE_HINT}")
    return None


def _known(model: type[BaseModel], data: dict[str, Any], path: str, ignored: list[str]) -> dict[str, Any]:
    """``data`` without the keys ``model`` does not know (recorded in ``ignored``), nested models too."""
    out = {}
    for key, value in data.items():
        info = model.model_fields.get(key)
        if info is None:
            ignored.append(path + key)
            continue
        nested = info.annotation
        if isinstance(nested, type) and issubclass(nested, BaseModel) and isinstance(value, dict):
            value = _known(nested, value, f"{path}{key}.", ignored)
        out[key] = value
    return out


def decode_request(text: str) -> tuple[DriverRequest, list[str]]:
    """(the request, the fields this driver does not know and ignored). Raises
    ProtocolIncompatible (a message for a person) or ValueError (not a request)."""
    data = json.loads(base64.urlsafe_b64decode(text.encode()))
    if not isinstance(data, dict):
        raise ValueError(f"the driver request is a JSON {type(data).__name__}, not an object")
    problem = incompatibility(data)
    if problem is not None:
        raise ProtocolIncompatible(problem)
    ignored: list[str] = []
    return DriverRequest.model_validate(_known(DriverRequest, data, "", ignored)), ignored


_SAFE = re.compile(r"[^a-z0-9-]+")


def submission_id(namespace: str, name: str, uid: str, attempt: int) -> str:
    """Deterministic per (job, attempt): written to status before the POST, so a
    restarted operator adopts the driver instead of submitting another."""
    base = _SAFE.sub("-", f"vj-{namespace}-{name}".lower()).strip("-")[:80]
    return f"{base}-{uid.split('-')[0][:8]}-a{attempt}"


def record(kind: str, **fields: Any) -> str:
    """One record line (a driver adds ``protocol=PROTOCOL`` to each)."""
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


def preempt_entrypoint(group: str, job_id: str, world: int, python: str = "python") -> str:
    """The entrypoint of a driver that asks every rank of ``group`` to stop job
    ``job_id`` at its next step boundary, saving a checkpoint first (a preemption)."""
    if not group.startswith(GROUP_PREFIX) or not all(c.isalnum() or c == "-" for c in group):
        raise ValueError(f"not a group name: {group!r}")
    if not job_id or not all(c.isalnum() or c in "-." for c in job_id):
        raise ValueError(f"not a job id: {job_id!r}")
    return (f"{shlex.quote(python)} -m videojob_runtime.driver --preempt {group} --job {job_id} "
            f"--world {int(world)}")


def teardown_entrypoint(group: str, world: int = 0, python: str = "python") -> str:
    """The entrypoint of a driver that removes group ``group`` by name (its
    ranks ``0..world-1``, any other rank alive under that name, its placement
    group) and prints one result record (``removed``: what it found); for a
    group whose driver was killed before it could tear it down."""
    if not group.startswith(GROUP_PREFIX) or not all(c.isalnum() or c == "-" for c in group):
        raise ValueError(f"not a group name: {group!r}")
    return f"{shlex.quote(python)} -m videojob_runtime.driver --teardown {group} --world {int(world)}"
