"""Generate the VideoJob CustomResourceDefinition from the API models.

The pydantic models are the one source of truth: this turns their JSON
schema into a structural openAPIV3Schema (refs inlined, nullable unions
collapsed, JSON-Schema-2020 bounds rewritten for OpenAPI 3.0) and adds the
cross-field CEL rules, printer columns and the status subresource.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from .api.common import API_GROUP, API_VERSION, CATEGORIES, KIND, PLURAL, SHORT_NAMES, SINGULAR
from .api.rules import SPEC_RULES
from .api.spec import VideoJobSpec
from .api.status import VideoJobStatus

CRD_NAME = f"{PLURAL}.{API_GROUP}"
CRD_FILE = f"{API_GROUP}_{PLURAL}.yaml"

_DROP = {"title", "default", "additionalProperties", "$defs"}

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase"},
    {
        "name": "Progress",
        "type": "integer",
        "jsonPath": ".status.progress.percent",
        "description": "Percent of denoising steps done",
    },
    {"name": "GPUs", "type": "integer", "jsonPath": ".status.plan.gpus", "description": "GPUs in the chosen layout"},
    {"name": "Class", "type": "string", "jsonPath": ".status.plan.gpuClass", "description": "GPU class"},
    {"name": "Queue", "type": "integer", "jsonPath": ".status.queue.position",
     "description": "Place in the queue of its GPU class (1: next)"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "description": "Catalog model id"},
    {
        "name": "Plan",
        "type": "string",
        "jsonPath": ".status.plan.summary",
        "priority": 1,
        "description": "Chosen layout in one line",
    },
    {"name": "Waiting-For", "type": "string", "jsonPath": ".status.queue.waitingFor", "priority": 1,
     "description": "What a queued job waits for"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _inline({**target, **extra}, defs)
    if "anyOf" in node:
        variants = [v for v in node["anyOf"] if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"cannot express union {node['anyOf']} structurally")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        merged = {**variants[0], **{k: v for k, v in rest.items() if k not in _DROP}}
        return _inline(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: _inline(prop, defs) for name, prop in value.items()}
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = _inline(value, defs)
    if out.get("type") == "string" and "enum" in out and "maxLength" not in out:
        # Bounded strings keep the API server's CEL cost estimate small.
        out["maxLength"] = max(len(v) for v in out["enum"])
    if out.get("type") == "object" and "properties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def structural_schema(model: type) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)  # type: ignore[attr-defined]
    return _inline(schema, schema.get("$defs", {}))


IMMUTABLE_SPEC_RULE = {"rule": "self == oldSelf",
                       "message": "spec is immutable: delete the VideoJob and create it again"}


def creation_only(schema: Any) -> None:
    """Make every CEL rule under ``schema`` run when the object is created, not on
    its updates: ``oldSelf.hasValue() || (rule)`` with ``optionalOldSelf``.

    Why: the spec is immutable (``IMMUTABLE_SPEC_RULE``), so a spec rule that
    held at creation still holds; but the API server evaluates every rule on
    every write, status and metadata patches included, and the operator writes
    each job's status several times. What each write costs with and without the
    guard: benchmarks/crd_write_cost.py (benchmarks/results/crd_write_cost.json).
    """
    if isinstance(schema, dict):
        for rule in schema.get("x-kubernetes-validations") or []:
            if "oldSelf" not in rule["rule"]:
                rule["rule"] = f"oldSelf.hasValue() || ({rule['rule']})"
                rule["optionalOldSelf"] = True
        for value in schema.values():
            creation_only(value)
    elif isinstance(schema, list):
        for value in schema:
            creation_only(value)


def build_crd() -> dict[str, Any]:
    spec_schema = structural_schema(VideoJobSpec)
    spec_schema["x-kubernetes-validations"] = [rule.to_crd() for rule in SPEC_RULES]
    creation_only(spec_schema)
    # Immutable after creation, as a Kubernetes Job's template is.
    spec_schema["x-kubernetes-validations"].append(dict(IMMUTABLE_SPEC_RULE))
    status_schema = structural_schema(VideoJobStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/name": "videojob", "app.kubernetes.io/part-of": "videojob"},
        },
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A request for one generated video.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated by `videojob crd` from the API models. Do not edit: run `make crds`.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)
