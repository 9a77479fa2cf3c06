"""The CRD is generated from the models; checked-in copies must not drift."""

from __future__ import annotations

import json

import yaml

from helpers import REPO
from videojob.api import SPEC_RULES
from videojob.crd import CRD_FILE, build_crd, render_crd


def test_crd_file_matches_models():
    assert (REPO / "crds" / CRD_FILE).read_text() == render_crd(), "crds/ drifted: run `make crds`"


def test_chart_crd_copy_matches():
    assert (REPO / "charts" / "videojob" / "crds" / CRD_FILE).read_text() == render_crd(), (
        "the chart's CRD copy drifted: run `make crds`"
    )


def _walk(node, path="$"):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_schema_is_structural():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "additionalProperties", "title", "const"):
            assert banned not in node, f"{banned} at {path}"
        if "properties" in node or "x-kubernetes-validations" in node and path.endswith("spec"):
            assert node.get("type") == "object", path
    text = json.dumps(schema)
    assert '"exclusiveMinimum": 0' not in text  # OpenAPI 3.0 wants a boolean


def test_crd_carries_every_cross_field_rule():
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = spec["x-kubernetes-validations"]
    assert len(rules) == len(SPEC_RULES) + 1  # + the immutability transition rule
    cross = rules[:-1]
    assert all(r["fieldPath"].startswith(".") and r["messageExpression"] for r in cross)
    assert rules[-1]["rule"] == "self == oldSelf" and "immutable" in rules[-1]["message"]


def test_spec_rules_run_at_creation_only():
    """The spec is immutable, so its rules are guarded to run on create, not on
    every status or metadata write (each is one CEL evaluation per rule)."""
    spec = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    found = [(path, rule) for path, node in _walk(spec) for rule in node.get("x-kubernetes-validations") or []]
    assert len(found) > len(SPEC_RULES) + 1  # the field rules (URIs, quantities) are found too
    for path, rule in found:
        if rule["rule"] == "self == oldSelf":
            assert path == "$" and "optionalOldSelf" not in rule
            continue
        assert rule["rule"].startswith("oldSelf.hasValue() || (") and rule["rule"].endswith(")"), path
        assert rule["optionalOldSelf"] is True, path


def test_printer_columns_and_status_subresource():
    version = yaml.safe_load(render_crd().split("\n", 1)[1])["spec"]["versions"][0]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:6] == ["Phase", "Progress", "GPUs", "Class", "Queue", "Model"] and "Age" in names
    assert version["subresources"] == {"status": {}}


def _undescribed(node: dict, path: str) -> list[str]:
    missing = []
    for name, prop in (node.get("properties") or {}).items():
        here = f"{path}.{name}"
        if not str(prop.get("description", "")).strip():
            missing.append(here)
        missing += _undescribed(prop, here)
        if prop.get("type") == "array":
            missing += _undescribed(prop.get("items", {}), here + "[]")
    return missing


def test_every_field_has_a_description():
    """`kubectl explain videojob.spec...` shows what each field means, its unit and its default."""
    from videojob.crd import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing = _undescribed(schema["properties"]["spec"], "spec") + _undescribed(schema["properties"]["status"], "status")
    assert missing == []


def test_conditions_are_a_map_list_keyed_by_type():
    from videojob.crd import build_crd

    status = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"] and "type" in conditions["items"]["required"]
