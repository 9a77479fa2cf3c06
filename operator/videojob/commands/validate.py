"""`videojob validate`: check VideoJob files, one line per problem."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import yaml

from ..api import InvalidVideoJob, parse_videojob
from .common import EXIT_BAD_INPUT, EXIT_OK, _documents, _emit

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
        _emit(line)
    if not problems:
        _emit(f"{len(args.files)} file(s) valid")
        return EXIT_OK
    return EXIT_BAD_INPUT
