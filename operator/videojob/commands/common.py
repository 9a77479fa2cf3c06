"""What the `videojob` subcommands share: the exit-code table, printing that
stays quiet when the reader of stdout has gone, and reading YAML documents."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import yaml

from ..api import InvalidVideoJob, Problem

# Exit codes, one table for validate, plan and run (docs/running.md "Exit codes").
EXIT_OK = 0
EXIT_BAD_INPUT = 1  # a file, flag or field is wrong; the message names it
EXIT_JOB_FAILED = 2  # the job ran and failed, or could not be placed or finished (stage and reason printed)
EXIT_DOES_NOT_FIT = 3  # no layout fits the GPUs (the reason names the smallest change that would)


def _emit(text: str) -> None:
    """Print to stdout; when the reader has gone (``videojob plan --json | head``),
    stop writing quietly instead of ending in BrokenPipeError."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        _stdout_gone()


def _stdout_gone() -> None:
    """Point stdout at /dev/null, so nothing more (the interpreter's final flush
    included) is written to a pipe whose reader has gone."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _documents(path: Path) -> Iterator[tuple[str, object]]:
    """(label, document) for each YAML document in a file; problems as exceptions."""
    text = path.read_text()
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if not docs:
        raise InvalidVideoJob([Problem("(document)", "the file holds no YAML document")])
    for index, doc in enumerate(docs):
        label = str(path) if len(docs) == 1 else f"{path}[{index}]"
        yield label, doc
