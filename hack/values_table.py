#!/usr/bin/env python3
"""The Markdown table of the chart's values, in docs/chart.md between the markers
``<!-- values-table:start -->`` and ``<!-- values-table:end -->``.

Sources (charts/videojob/):
  values.schema.json  which values exist (every row), their types and enums,
                      and the descriptions of list items' fields
  values.yaml         the defaults, and the descriptions: helm-docs style
                      ``# --`` comments directly above a key (continued by
                      the ``#`` lines right after), so helm-docs reads them too

A key with a ``# --`` comment is one row, whatever its type (a Kubernetes
object such as ``resources`` stays whole); an undocumented object of the
chart's own is broken into its fields. Every row must have a description and
every documented key must be in the schema; otherwise this fails, naming the key.

Usage:
  python3 hack/values_table.py            rewrite the table in docs/chart.md
  python3 hack/values_table.py --check    exit 1 if docs/chart.md's table is out of date
  python3 hack/values_table.py --print    print the table
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "videojob"
README = REPO / "docs" / "chart.md"
START = "<!-- values-table:start -->"
END = "<!-- values-table:end -->"
SKIP = {"global"}  # Helm's own; not a value of this chart


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    description: str


class TableError(ValueError):
    pass


def comments(text: str) -> dict[str, str]:
    """``{dotted.key: description}`` from the ``# --`` comments of a values.yaml.

    A small line reader for the subset values.yaml uses (block mappings, lists
    whose items are never documented): a key's path comes from the keys above
    it at smaller indentation."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    pending: list[str] | None = None
    pending_indent = -1
    list_indent: int | None = None  # inside a list's items: no documented keys
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip(" ")
        indent = len(line) - len(stripped)
        if not stripped:
            pending = None
            continue
        if list_indent is not None:
            if indent > list_indent or (indent == list_indent and stripped.startswith("- ")):
                continue
            list_indent = None
        if stripped.startswith("# --"):
            pending, pending_indent = [stripped[4:].strip()], indent
            continue
        if stripped.startswith("#"):
            if pending is not None and indent == pending_indent:
                pending.append(stripped[1:].strip())
            continue
        if stripped.startswith("- "):
            list_indent = indent
            pending = None
            continue
        match = re.match(r"^([A-Za-z0-9_]+):(\s|$)", stripped)
        if not match:
            raise TableError(f"values.yaml:{number}: cannot read {line!r}")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [match.group(1)])
        if pending is not None:
            out[path] = " ".join(p for p in pending if p)
            pending = None
        stack.append((indent, match.group(1)))
    return out


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its ``$ref`` (to #/definitions/...) merged under its own keys."""
    if "$ref" not in node:
        return node
    ref = node["$ref"]
    if not ref.startswith("#/definitions/"):
        raise TableError(f"unsupported $ref {ref!r}")
    target = _resolve(schema, schema["definitions"][ref.split("/")[-1]])
    merged = {k: v for k, v in target.items() if k != "description"}
    merged.update({k: v for k, v in node.items() if k != "$ref"})
    return merged


def _type(node: dict[str, Any]) -> str:
    kind = node.get("type", "any")
    text = " or ".join(kind) if isinstance(kind, list) else kind
    if "enum" in node:
        text += " (" + ", ".join(json.dumps(v) for v in node["enum"]) + ")"
    elif node.get("pattern", "").startswith("^[0-9]+([.][0-9]+)?(Ki"):
        text += " (quantity)"
    return text


def _default(value: Any) -> str:
    return "`" + json.dumps(value, separators=(", ", ": ")) + "`"


def _lookup(values: Any, path: list[str]) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(values, dict) or key not in values:
            return False, None
        values = values[key]
    return True, values


def rows(chart: Path = CHART) -> list[Row]:
    """One row per value, in the schema's order."""
    schema = json.loads((chart / "values.schema.json").read_text())
    text = (chart / "values.yaml").read_text()
    values = yaml.safe_load(text) or {}
    described = comments(text)
    out: list[Row] = []
    seen: set[str] = set()

    def own_object(node: dict[str, Any]) -> bool:
        return node.get("type") == "object" and "properties" in node

    def walk(node: dict[str, Any], path: list[str]) -> None:
        for key, child in node.get("properties", {}).items():
            if not path and key in SKIP:
                continue
            child = _resolve(schema, child)
            here = path + [key]
            dotted = ".".join(here)
            # A documented key is one row (a Kubernetes object such as resources
            # stays whole); an undocumented object of the chart's is its fields.
            if dotted not in described and own_object(child):
                walk(child, here)
                continue
            found, default = _lookup(values, here)
            if not found:
                raise TableError(f"{dotted} is in values.schema.json but not in values.yaml (give it a default)")
            description = described.get(dotted) or child.get("description")
            if not description:
                raise TableError(f"{dotted} has no description: add a `# --` comment above it in values.yaml")
            seen.add(dotted)
            out.append(Row(dotted, _type(child), _default(default), description))
            items = _resolve(schema, child.get("items", {})) if child.get("type") == "array" else {}
            if own_object(items) and items.get("additionalProperties") is False:  # the chart's own item fields
                required = set(items.get("required", []))
                for field, spec in items["properties"].items():
                    spec = _resolve(schema, spec)
                    item_key = f"{dotted}[].{field}"
                    if not spec.get("description"):
                        raise TableError(f"{item_key} has no description in values.schema.json")
                    if field in required:
                        item_default = "(required)"
                    elif "default" in spec:
                        item_default = _default(spec["default"])
                    else:
                        item_default = ""
                    out.append(Row(item_key, _type(spec), item_default, spec["description"]))

    walk(schema, [])
    unknown = sorted(set(described) - seen)
    if unknown:
        raise TableError(f"values.yaml documents keys values.schema.json does not have: {unknown}")

    def leaves(data: Any, path: list[str], node: dict[str, Any]) -> None:
        for key, value in (data or {}).items():
            dotted = ".".join(path + [key])
            child = _resolve(schema, node.get("properties", {}).get(key, {}))
            if not child:
                raise TableError(f"values.yaml has {dotted}, which values.schema.json does not have")
            if dotted not in described and own_object(child):
                leaves(value, path + [key], child)

    leaves(values, [], schema)
    return out


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(chart: Path = CHART) -> str:
    lines = [
        "| Key | Type | Default | Description |",
        "|---|---|---|---|",
    ]
    for row in rows(chart):
        lines.append(f"| `{row.key}` | {_cell(row.type)} | {_cell(row.default)} | {_cell(row.description)} |")
    return "\n".join(lines) + "\n"


def splice(readme: str, table: str) -> str:
    """``readme`` with the text between the markers replaced by ``table``."""
    if readme.count(START) != 1 or readme.count(END) != 1 or readme.index(START) > readme.index(END):
        raise TableError(f"docs/chart.md needs exactly one {START} followed by one {END}")
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    note = "<!-- Generated by hack/values_table.py from charts/videojob/values.yaml and values.schema.json: " \
           "do not edit; run `make values-table`. -->\n"
    return f"{head}{START}\n{note}{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if docs/chart.md's table is out of date")
    mode.add_argument("--print", action="store_true", help="print the table")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    try:
        table = render()
        if args.print:
            sys.stdout.write(table)
            return 0
        current = args.readme.read_text()
        wanted = splice(current, table)
    except TableError as exc:
        print(f"values_table: {exc}", file=sys.stderr)
        return 1
    if args.check:
        if current != wanted:
            print(f"values_table: the values table in {args.readme.name} is out of date with "
                  "charts/videojob/values.yaml / values.schema.json: run `make values-table`", file=sys.stderr)
            return 1
        print(f"values_table: {args.readme.name} is up to date")
        return 0
    if current != wanted:
        args.readme.write_text(wanted)
        print(f"values_table: wrote the table into {args.readme}")
    else:
        print(f"values_table: {args.readme.name} already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
