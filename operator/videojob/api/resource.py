"""The VideoJob object as a whole, and the one way to parse it.

``parse_videojob`` runs the field checks (pydantic) and the cross-field rules
and raises ``InvalidVideoJob`` listing every problem as (field, message), so a
user fixes everything in one go.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import Field, ValidationError

from ..redaction import redact_url
from .common import API_GROUP, API_VERSION, KIND, WireModel
from .rules import spec_problems
from .spec import VideoJobSpec
from .status import VideoJobStatus
from .uris import name_problem

API_VERSION_FULL = f"{API_GROUP}/{API_VERSION}"


class VideoJob(WireModel):
    api_version: str = Field(default=API_VERSION_FULL, alias="apiVersion")
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: VideoJobSpec
    status: Optional[VideoJobStatus] = None

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a VideoJob: a dotted field path and what to do."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidVideoJob(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def _path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1] = f"{parts[-1]}[{item}]" if parts else f"[{item}]"
        else:
            parts.append(str(item))
    return ".".join(parts)


def _describe(error: dict[str, Any]) -> str:
    """Turn a pydantic error into a sentence that says what would be valid."""
    kind, ctx, value = error["type"], error.get("ctx", {}), error.get("input")
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
        return "is not a VideoJob field (check the spelling; field names are camelCase)"
    if kind == "greater_than_equal":
        return f"must be at least {ctx['ge']} (got {value!r})"
    if kind == "less_than_equal":
        return f"must be at most {ctx['le']} (got {value!r})"
    if kind == "greater_than":
        return f"must be greater than {ctx['gt']} (got {value!r})"
    if kind == "less_than":
        return f"must be less than {ctx['lt']} (got {value!r})"
    if kind == "string_too_short":
        return f"must have at least {ctx['min_length']} character(s)"
    if kind == "string_too_long":
        return f"must have at most {ctx['max_length']} characters (got {len(value)})"
    if kind == "literal_error" and isinstance(value, bool):
        return (
            f"got the boolean {str(value).lower()}: YAML reads unquoted off/on/yes/no as booleans; "
            f"quote the value, e.g. \"off\" (valid: {ctx['expected'].replace(chr(39), '')})"
        )
    if kind == "literal_error":
        return f"{value!r} is not one of: {ctx['expected'].replace(chr(39), '')}"
    if kind == "enum":
        return f"{value!r} is not one of: {ctx['expected'].replace(chr(39), '')}"
    if isinstance(value, str) and "://" in value:
        value = redact_url(value)  # a presigned URL's query is its key: never in a message
    return f"{error['msg']} (got {value!r})"


def _without(data: Any, locs: list[tuple[Any, ...]]) -> Any:
    """A deep copy of ``data`` with the values at ``locs`` removed."""
    data = copy.deepcopy(data)
    for loc in locs:
        node = data
        for key in loc[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(loc[-1], None)
    return data


def _salvage(data: Any, exc: ValidationError) -> VideoJobSpec | None:
    """The spec with its malformed values dropped, or None if that fails too."""
    locs: list[tuple[Any, ...]] = []
    for _ in range(4):
        for e in exc.errors():
            loc = tuple(e["loc"])
            # A missing required key: drop the object that lacks it.
            locs.append(loc[:-1] if e["type"] == "missing" and len(loc) > 1 else loc)
        try:
            return VideoJobSpec.model_validate(_without(data, locs))
        except ValidationError as again:
            exc = again
    return None


def parse_spec(data: Any, prefix: str = "spec", for_plan: bool = False) -> VideoJobSpec:
    """Parse and check a spec alone; raises InvalidVideoJob with every problem.

    When some fields are malformed, the cross-field rules still run on the
    rest (the malformed values removed), so one pass reports everything.
    ``for_plan``: skip what only running needs (input images), for `videojob plan --model`.
    """
    try:
        spec = VideoJobSpec.model_validate(data)
    except ValidationError as exc:
        problems = [Problem(_path((prefix, *e["loc"])), _describe(e)) for e in exc.errors()]
        rest = _salvage(data, exc)
        if rest is not None:
            seen = {p.field for p in problems}
            problems += [
                Problem(f"{prefix}.{f}", m) for f, m in spec_problems(rest, for_plan) if f"{prefix}.{f}" not in seen
            ]
        raise InvalidVideoJob(problems) from None
    problems = [Problem(f"{prefix}.{f}", m) for f, m in spec_problems(spec, for_plan)]
    if problems:
        raise InvalidVideoJob(problems)
    return spec


def _name_problems(metadata: Any) -> list[Problem]:
    """metadata.name must be a DNS-1123 subdomain, as the API server requires:
    it becomes the job's file names (NAME.mp4, NAME.json, ...), so a name
    such as ``../x`` must be refused here too, not only by a cluster."""
    if not isinstance(metadata, dict) or not (metadata.get("name") or metadata.get("generateName")):
        return [Problem("metadata.name", "is required")]
    if metadata.get("name"):
        problem = name_problem(metadata["name"])
        return [Problem("metadata.name", problem)] if problem else []
    # The server appends 5 random characters to generateName.
    if name_problem(f"{metadata['generateName']}x") is not None:
        return [Problem("metadata.generateName", f"{metadata['generateName']!r} is not the start of a DNS-1123 "
                        "subdomain (Kubernetes' rule for object names): lower-case letters, digits, '-' and '.', "
                        "starting with a letter or digit")]
    return []


def parse_videojob(doc: Any) -> VideoJob:
    """Parse a whole VideoJob document; raises InvalidVideoJob with every problem."""
    if not isinstance(doc, dict):
        raise InvalidVideoJob([Problem("(document)", "must be a mapping with apiVersion, kind, metadata and spec")])
    problems: list[Problem] = []
    if doc.get("apiVersion") != API_VERSION_FULL:
        problems.append(Problem("apiVersion", f"must be {API_VERSION_FULL} (got {doc.get('apiVersion')!r})"))
    if doc.get("kind") != KIND:
        problems.append(Problem("kind", f"must be {KIND} (got {doc.get('kind')!r})"))
    problems.extend(_name_problems(doc.get("metadata")))
    if "spec" not in doc:
        problems.append(Problem("spec", "is required"))
    else:
        try:
            parse_spec(doc["spec"])
        except InvalidVideoJob as exc:
            problems.extend(exc.problems)
    if problems:
        raise InvalidVideoJob(problems)
    try:
        return VideoJob.model_validate(doc)
    except ValidationError as exc:  # status or metadata shape
        raise InvalidVideoJob(
            [Problem(_path(tuple(e["loc"])), _describe(e)) for e in exc.errors()]
        ) from None
