"""`videojob validate` and `videojob crd` as a user runs them (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

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


# --- `videojob plan` as a new user types it (issue 18) -----------------------------------------------------


def test_plan_gpu_memory_bare_number_is_gib():
    """`--gpu-memory 24` is a 24 GiB GPU, as GPU sizes are written, never 24 bytes."""
    bare = videojob("plan", "--model", "cogvideox-5b", "--gpu-memory", "24")
    with_unit = videojob("plan", "--model", "cogvideox-5b", "--gpu-memory", "24GiB")
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert "on up to 1 x 24 GiB GPUs" in bare.stdout
    assert bare.stdout == with_unit.stdout
    assert "a bare number is GiB" in videojob("plan", "--help").stdout


@pytest.mark.parametrize("value", ["24000000000", "0", "24XB"])
def test_plan_gpu_memory_that_is_no_size_is_bad_input_naming_the_flag(value):
    result = videojob("plan", "--model", "cogvideox-5b", "--gpu-memory", value)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "--gpu-memory: " in result.stderr and "Traceback" not in result.stderr


def test_plan_nothing_fits_is_said_once():
    result = videojob("plan", "--model", "cogvideox-5b", "--gpu-memory", "2GiB")
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stdout.lower().count("nothing fits") == 1, result.stdout
    assert "on up to 1 x 2 GiB GPUs" in result.stdout


@pytest.mark.parametrize("argv, flag, valid", [
    (["plan", "--model", "cogvideox-5b", "--gpu-type", "v100"], "--gpu-type", "'a100', 'l40', 'h100', 'h200'"),
    (["plan", "--model", "cogvideox-5b", "--gpus", "two"], "--gpus", "int"),
    (["run", "examples/tiny-cpu.yaml", "--no-such-flag"], "--no-such-flag", "unrecognized"),
])
def test_a_bad_flag_is_bad_input_exit_1_naming_it(argv, flag, valid):
    """Exit 2 is a failed job (docs/running.md, Exit codes); a bad flag is bad input."""
    result = videojob(*argv)
    assert result.returncode == 1, result.stderr
    assert flag in result.stderr and valid in result.stderr and "Traceback" not in result.stderr


def test_plan_gpu_type_is_case_insensitive():
    result = videojob("plan", "--model", "cogvideox-5b", "--gpu-type", "H100")
    assert result.returncode == 0, result.stderr
    assert "GiB GPUs (h100)" in result.stdout


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "cogvideox-5b", "--gpus", "8", "--json", "--all"],
    ["plan", "--model", "cogvideox-5b", "--gpus", "8", "--all"],
    ["plan", "--sweep", "cogvideox-2b"],
    ["validate", "examples/tiny-cpu.yaml"],
    ["crd"],
], ids=["plan-json", "plan-table", "sweep", "validate", "crd"])
def test_output_into_a_pipe_whose_reader_is_gone_ends_quietly(argv):
    """`videojob plan --json | head`: the reader has gone before the output is
    written (its end is closed here at once); the command ends quietly, exit 0."""
    proc = subprocess.Popen([sys.executable, "-m", "videojob.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=60)
    text = stderr.decode()
    assert "BrokenPipeError" not in text and "Traceback" not in text and "Exception ignored" not in text, text
    assert proc.returncode == 0, text


@pytest.mark.parametrize("example, gpus", [("tiny-cpu.yaml", 2), ("wan2.1-t2v.yaml", 4)])
def test_plan_of_an_example_that_pins_its_degrees_names_the_gpus_flag(example, gpus):
    """The job's parallel override needs more GPUs than the default --gpus 1: the
    smallest change that would fit is a flag of this command, and it does fit."""
    path = f"examples/{example}"
    result = videojob("plan", path)
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"Would fit with: --gpus {gpus}" in result.stdout, result.stdout
    assert json.loads(videojob("plan", path, "--json").stdout)["fitsWith"][0] == f"--gpus {gpus}"
    assert videojob("plan", path, "--gpus", str(gpus)).returncode == 0


def test_plan_nothing_fits_names_the_memory_flags():
    small = videojob("plan", "--model", "cogvideox-5b", "--gpu-memory", "2")
    assert "Would fit with: --gpu-memory 12GiB" in small.stdout, small.stdout
    both = videojob("plan", "--model", "wan2.1-t2v-14b", "--gpu-memory", "8GiB", "--host-memory", "16GiB")
    assert "Would fit with: --gpu-memory 16GiB --host-memory 64GiB" in both.stdout, both.stdout
    assert videojob("plan", "--model", "wan2.1-t2v-14b", "--gpu-memory", "16GiB", "--host-memory",
                    "64GiB").returncode == 0


def test_set_takes_the_text_inside_quotes():
    """`--set 'cache.policy="off"'`: users quote words YAML reads as booleans; the value is the text inside."""
    from videojob.api import parse_videojob
    from videojob.cli import apply_overrides

    doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
    apply_overrides(doc, ['cache.policy="off"', "prompt='it''s \"quoted\"'", 'negativePrompt="no"',
                          "model.dtype='float32'"])
    spec = doc["spec"]
    assert spec["cache"]["policy"] == "off" and spec["prompt"] == 'it\'s "quoted"' and spec["negativePrompt"] == "no"
    assert spec["model"]["dtype"] == "float32"
    assert parse_videojob(doc).spec.cache.policy == "off"
    assert apply_overrides({"spec": {}}, ['prompt="unbalanced'])["spec"]["prompt"] == '"unbalanced'
