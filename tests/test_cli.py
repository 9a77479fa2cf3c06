"""`videojob validate` and `videojob crd` as a user runs them (a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import EXAMPLES, INVALID, REPO, expected_field


def videojob(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "videojob.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_validate_examples_exit_zero():
    result = videojob("validate", *map(str, EXAMPLES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(EXAMPLES)} file(s) valid" in result.stdout


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_validate_bad_file_exits_one_naming_field(path):
    result = videojob("validate", str(path))
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert lines and all(line.startswith(f"{path}: ") for line in lines)
    assert any(line.startswith(f"{path}: {expected_field(path)}: ") for line in lines), result.stdout


def test_validate_mixed_files_reports_only_bad_ones():
    result = videojob("validate", str(EXAMPLES[0]), str(INVALID[0]))
    assert result.returncode == 1
    assert str(EXAMPLES[0]) not in result.stdout and str(INVALID[0]) in result.stdout


def test_validate_missing_file_and_bad_yaml(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    result = videojob("validate", str(tmp_path / "nope.yaml"), str(broken))
    assert result.returncode == 1
    assert "nope.yaml: (file): cannot read" in result.stdout
    assert "broken.yaml: (yaml): not valid YAML" in result.stdout


def test_validate_multi_document_file(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text(EXAMPLES[0].read_text() + "\n---\n" + INVALID[0].read_text())
    result = videojob("validate", str(both))
    assert result.returncode == 1
    assert f"{both}[1]: {expected_field(INVALID[0])}: " in result.stdout
    assert f"{both}[0]" not in result.stdout


def test_crd_command_prints_the_crd():
    result = videojob("crd")
    assert result.returncode == 0
    assert "kind: CustomResourceDefinition" in result.stdout and "name: videojobs.videojob.io" in result.stdout
