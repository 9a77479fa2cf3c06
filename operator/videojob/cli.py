"""The `videojob` command line.

Subcommands are small functions over the same library the operator uses, so
what `videojob validate` says is what the operator would say.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator, Sequence

import yaml

from .api import InvalidVideoJob, Problem, parse_videojob
from .crd import render_crd


def _documents(path: Path) -> Iterator[tuple[str, object]]:
    """(label, document) for each YAML document in a file; problems as exceptions."""
    text = path.read_text()
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if not docs:
        raise InvalidVideoJob([Problem("(document)", "the file holds no YAML document")])
    for index, doc in enumerate(docs):
        label = str(path) if len(docs) == 1 else f"{path}[{index}]"
        yield label, doc


def validate_files(paths: Sequence[str]) -> list[str]:
    """One line per problem, ``FILE: FIELD: REASON``; empty when all are valid."""
    lines: list[str] = []
    for name in paths:
        path = Path(name)
        try:
            for label, doc in _documents(path):
                try:
                    parse_videojob(doc)
                except InvalidVideoJob as exc:
                    lines += [f"{label}: {p.field}: {p.message}" for p in exc.problems]
        except OSError as exc:
            lines.append(f"{name}: (file): cannot read: {exc.strerror or exc}")
        except yaml.YAMLError as exc:
            lines.append(f"{name}: (yaml): not valid YAML: {str(exc).splitlines()[0]}")
        except InvalidVideoJob as exc:
            lines += [f"{name}: {p.field}: {p.message}" for p in exc.problems]
    return lines


def _cmd_validate(args: argparse.Namespace) -> int:
    problems = validate_files(args.files)
    for line in problems:
        print(line)
    if not problems:
        print(f"{len(args.files)} file(s) valid")
        return 0
    return 1


def _cmd_crd(args: argparse.Namespace) -> int:
    text = render_crd()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="videojob", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser("validate", help="check VideoJob files; exit 1 with one line per problem")
    validate.add_argument("files", nargs="+", metavar="FILE")
    validate.set_defaults(func=_cmd_validate)

    crd = sub.add_parser("crd", help="print the VideoJob CRD generated from the API models")
    crd.add_argument("--out", help="write to this file instead of stdout")
    crd.set_defaults(func=_cmd_crd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
