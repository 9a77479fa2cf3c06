"""`videojob validate` and `videojob crd` as a user runs them (a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import EXAMPLES, INVALID, REPO, expected_field
from videojob.catalog import MODEL_IDS


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


def test_set_keeps_text_fields_as_text():
    """README's own example: YAML would read `off` as false; a text field keeps what was written."""
    from videojob.cli import apply_overrides

    doc = apply_overrides({"spec": {}}, ["cache.policy=off", "prompt=42", "negativePrompt=no", "parallel.ulysses=2",
                                         "memory.vaeTiling=true", "seed=null", "resources.gpuMemory=24Gi"])
    spec = doc["spec"]
    assert spec["cache"]["policy"] == "off" and spec["prompt"] == "42" and spec["negativePrompt"] == "no"
    assert spec["parallel"]["ulysses"] == 2 and spec["memory"]["vaeTiling"] is True and spec["seed"] is None
    assert spec["resources"]["gpuMemory"] == "24Gi"


@pytest.mark.parametrize("model", [m for m in MODEL_IDS])
def test_plan_model_flag_works_for_every_model_without_inputs(model):
    """A plan needs no input images: `plan --model consisid` must not ask for a face."""
    result = subprocess.run([sys.executable, "-m", "videojob.cli", "plan", "--model", model, "--gpu-memory", "80Gi",
                             "--gpus", "8"], capture_output=True, text=True, timeout=60)
    assert result.returncode in (0, 3), result.stderr
    assert "faceImage" not in result.stderr and "image" not in result.stderr


def test_profile_out_never_defaults_into_the_package():
    from videojob.cli import build_parser

    args = build_parser().parse_args(["profile"])
    assert args.out == "calibration.json"
