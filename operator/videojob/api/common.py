"""Shared pieces of the API models: camelCase wire names and field-level rules.

A field-level rule is written once, as a CEL expression the API server runs
and a Python predicate ``videojob validate`` and the operator run, so a bad
value gets the same verdict with or without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError, core_schema

API_GROUP = "videojob.io"
API_VERSION = "v1alpha1"
KIND = "VideoJob"
PLURAL = "videojobs"
SINGULAR = "videojob"
SHORT_NAMES = ("vj",)
CATEGORIES = ("all", "videojob")


class WireModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown keys are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=False,
    )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict Kubernetes stores (aliases, no unset Nones)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


@dataclass(frozen=True)
class Cel:
    """A single-field rule: ``rule`` for the API server, ``check`` for Python.

    Used as ``Annotated[str, Cel(...)]``; the CRD generator copies it into
    ``x-kubernetes-validations`` and pydantic runs ``check`` after parsing.
    """

    rule: str
    message: str
    check: Callable[[Any], bool]

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        def run(value: Any) -> Any:
            if value is not None and not self.check(value):
                raise PydanticCustomError("videojob_rule", self.message)
            return value

        return core_schema.no_info_after_validator_function(run, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> Any:
        result = handler(schema)
        rules = result.setdefault("x-kubernetes-validations", [])
        rules.append({"rule": self.rule, "message": self.message})
        return result


def cel_list(values: tuple[str, ...] | list[str]) -> str:
    """A CEL list literal of strings."""
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"
