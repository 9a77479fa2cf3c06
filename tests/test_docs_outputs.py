"""What the docs show a command printing is what it prints (issue 18: "README
outputs no longer match what runs").

Every ``$ command`` line in a plain ``` block of README.md or docs/*.md is either
run here and compared with what the docs show below it, or listed in
NOT_RUN with the reason. Deterministic commands (`videojob plan`, `videojob
validate`) must print the shown lines exactly, in order (a shown `...` line
stands for lines left out). A run (`videojob run`) is compared by shape: numbers
may differ, a `...` inside a line stands for this machine's paths or port, every
other character must match. `kubectl get vj` blocks are checked against the
CRD's printer columns.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "operator"))
from videojob.crd import PRINTER_COLUMNS  # noqa: E402

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VIDEOJOB = str(REPO / ".venv" / "bin" / "videojob")
EXACT = "exact"
SHAPE = "shape"
# How each shown command is checked (by its first words), or why it is not run here.
CHECKS = {"videojob plan examples/": EXACT, "videojob validate ": EXACT, "videojob run ": SHAPE}
NOT_RUN = {
    "kubectl ": "needs a cluster with the operator (make demo-cluster shows it; columns are checked below)",
    "videojob plan --model ": "shown without its output",
    "videojob plan --sweep ": "shown without its output",
}


def plain_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks without an info string (```), in order."""
    blocks, body, info = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if body is None:
                body, info = [], line[3:].strip()
            else:
                if not info:
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def shown() -> list[tuple[str, str, list[str]]]:
    """(page, command, the output lines shown under it) for every `$ ` line in a plain block."""
    found = []
    for page in PAGES:
        for block in plain_blocks(page.read_text()):
            current = None
            for line in block.splitlines():
                if line.startswith("$ "):
                    current = (page.name, line[2:].split("  #")[0].strip(), [])
                    found.append(current)
                elif current is not None:
                    current[2].append(line)
    return found


def _kind(command: str) -> str | None:
    for prefix, kind in CHECKS.items():
        if command.startswith(prefix):
            return kind
    return None


def test_every_shown_command_is_checked_or_says_why_not():
    commands = shown()
    assert commands, "the docs show no command output"
    for page, command, _ in commands:
        assert _kind(command) or any(command.startswith(p) for p in NOT_RUN), \
            f"{page}: `{command}` is neither checked nor listed with a reason"


def _run(command: str, cwd: Path) -> str:
    argv = command.split()
    assert argv[0] == "videojob"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("VIDEOJOB_OUTPUT_ROOT", None)
    # one stream, as a terminal shows it (the progress bar redraws with \r)
    result = subprocess.run([VIDEOJOB, *argv[1:]], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=900, env=env)
    return result.stdout.replace("\r", "\n")


def _shape(line: str) -> re.Pattern:
    """A shown line as a pattern: numbers match any number, `...` anything, a sha256 digest
    any digest (the frames' digest is the same run after run on one machine, but float
    kernels differ between CPUs: a run on another machine printed another digest)."""
    parts = []
    for piece in re.split(r"(sha256:[0-9a-f]{64}|\.\.\.|\d+(?:\.\d+)?)", line.rstrip()):
        if piece.startswith("sha256:"):
            parts.append("sha256:[0-9a-f]{64}")
        elif piece == "...":
            parts.append(".*")
        elif re.fullmatch(r"\d+(?:\.\d+)?", piece or "x"):
            parts.append(r"\d+(?:\.\d+)?")
        else:
            parts.append(re.escape(piece))
    return re.compile("^" + "".join(parts) + "$")


CHECKED = [(page, command, lines) for page, command, lines in shown() if _kind(command)]


@pytest.mark.parametrize("page,command,lines", CHECKED, ids=[f"{p}:{c[:50]}" for p, c, _ in CHECKED])
def test_shown_output_is_what_runs(page, command, lines, tmp_path):
    kind = _kind(command)
    # a run writes under ./out: run it in a scratch dir with the examples it names
    cwd = tmp_path if kind == SHAPE else REPO
    if kind == SHAPE:
        (tmp_path / "examples").symlink_to(REPO / "examples")
    actual = [line.rstrip() for line in _run(command, cwd).splitlines()]
    position = 0
    for line in lines:
        if not line.strip() or line.strip() == "...":
            continue
        if kind == EXACT:
            match = lambda a, want=line.rstrip(): a == want  # noqa: E731
        else:
            pattern = _shape(line)
            match = lambda a, p=pattern: bool(p.match(a))  # noqa: E731
        for index in range(position, len(actual)):
            if match(actual[index]):
                position = index + 1
                break
        else:
            raise AssertionError(f"{page}: `{command}` no longer prints this line (in this order):\n  {line}\n"
                                 f"it printed:\n" + "\n".join(actual[-60:]))


def test_kubectl_get_vj_tables_have_the_crds_columns():
    """Every `kubectl get vj` table shown has the columns the CRD prints, in order."""
    names = ["NAME"] + [c["name"].upper() for c in PRINTER_COLUMNS if not c.get("priority")]
    wide = ["NAME"] + [c["name"].upper() for c in PRINTER_COLUMNS]
    tables = 0
    for page in PAGES:
        for block in plain_blocks(page.read_text()):
            for line in block.splitlines():
                if line.startswith("NAME ") and "PHASE" in line:
                    tables += 1
                    assert line.split() in (names, wide), f"{page.name}: {line.split()} is not {names} or {wide}"
    assert tables, "no kubectl get vj table shown"
