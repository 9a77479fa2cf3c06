"""``videojob run`` as a user meets it: where the files go, exit codes, and Ray hygiene.

Each case runs the real CLI in a subprocess (its own embedded Ray), so what
is checked is what a user sees: the exit code, one line on stderr naming the
stage and reason, the files written, and that no Ray found on the machine
(a stale state file, ``RAY_ADDRESS``, a running cluster) is ever used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("xfuser")
pytest.importorskip("ray")

from helpers import REPO, RayHead  # noqa: E402
from videojob_runtime.output import probe_mp4  # noqa: E402

EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"


def _run(tmp_path: Path, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "VIDEOJOB_OUTPUT_ROOT": str(tmp_path / "outputs"),
                "RAY_TMPDIR": str(tmp_path / "raytmp"), **(env or {})}
    full_env.pop("RAY_AUTH_TOKEN", None)  # the CLI makes its own
    return subprocess.run([sys.executable, "-m", "videojob.cli", "run", str(EXAMPLE), "--set", "sampling.steps=2",
                           *args], capture_output=True, text=True, timeout=timeout, env=full_env)


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_run_writes_to_the_specs_output_uri(tmp_path):
    result = _run(tmp_path, "--quiet")
    assert result.returncode == 0, result.stderr[-3000:]
    where = tmp_path / "outputs" / "videos" / "tiny-cpu"  # spec.output.uri local://videos/tiny-cpu
    assert _files(where) == ["tiny-cpu.json", "tiny-cpu.log", "tiny-cpu.mp4", "tiny-cpu.png"]
    assert probe_mp4(where / "tiny-cpu.mp4")["frames"] == 9
    summary = json.loads((where / "tiny-cpu.json").read_text())
    assert summary["plan"]["ulysses"] == 2 and summary["spec"]["sampling"]["steps"] == 2
    assert summary["seed"] == 0 and summary["seedDrawn"] is False
    assert summary["framesDigest"].startswith("sha256:")
    assert "ulysses2" in result.stdout and "embedded local cluster" in result.stdout
    assert "per CPU rank" in result.stdout and "per GPU" not in result.stdout, "a CPU run says CPU rank"


def test_out_overrides_the_output_uri_and_says_so_and_an_unset_seed_is_drawn(tmp_path):
    out = tmp_path / "elsewhere"
    result = _run(tmp_path, "--out", str(out), "--set", "seed=null")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--out {out} overrides spec.output.uri local://videos/tiny-cpu" in result.stderr
    assert not (tmp_path / "outputs").exists()
    summary = json.loads((out / "tiny-cpu.json").read_text())
    assert summary["seedDrawn"] is True and 0 <= summary["seed"] < 2**32
    assert f"seed {summary['seed']}" in result.stdout


def test_a_stale_ray_state_file_and_ray_address_are_ignored(tmp_path):
    state = tmp_path / "raytmp" / "ray"
    state.mkdir(parents=True)
    (state / "ray_current_cluster").write_text("127.0.0.1:1")  # a cluster that no longer exists
    result = _run(tmp_path, "--quiet", env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_ray_cluster_already_running_is_not_used(tmp_path):
    with RayHead() as head:
        # The machine's "current cluster" and RAY_ADDRESS both name the running head.
        result = _run(tmp_path, "--quiet", env={"RAY_ADDRESS": head.address, "RAY_TMPDIR": str(head.root)})
        assert result.returncode == 0, result.stderr[-3000:]
        used = next(line for line in result.stdout.splitlines() if line.strip().startswith("ray:"))
        assert head.address not in used and f":{head.port}" not in used
        names = head.run_python("import ray; ray.init(); "
                                "print(sorted(a['Name'] for a in ray._private.state.actors().values()))")
        assert "vj-" not in names, f"videojob run created actors in the running cluster: {names}"


def test_bad_input_exits_1_naming_the_field(tmp_path):
    result = _run(tmp_path, "--set", "video.frames=10")
    assert result.returncode == 1 and "spec.video.frames" in result.stderr


def test_a_job_failure_exits_2_with_the_stage_and_leaves_no_video(tmp_path):
    result = _run(tmp_path, "--set", "model.name=tiny-cogvideox-i2v", "--set", "parallel=null",
                  "--set", "image=local://missing.png", "--quiet")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "failed in inputs" in result.stderr and "Traceback" not in result.stderr
    where = tmp_path / "outputs" / "videos" / "tiny-cpu"
    assert _files(where) == ["tiny-cpu.json", "tiny-cpu.log"]
    record = json.loads((where / "tiny-cpu.json").read_text())
    assert record["ok"] is False and record["error"]["stage"] == "inputs"


def test_no_placement_within_the_timeout_exits_2(tmp_path):
    result = _run(tmp_path, "--quiet", env={"VIDEOJOB_CPUS_PER_RANK": "64", "VIDEOJOB_PLACEMENT_TIMEOUT_S": "2"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "NoPlacement" in result.stderr and "placement" in result.stderr and "Traceback" not in result.stderr
    where = tmp_path / "outputs" / "videos" / "tiny-cpu"
    record = json.loads((where / "tiny-cpu.json").read_text())
    assert record["error"]["reason"] == "NoPlacement"
    assert "Traceback" in (where / "tiny-cpu.log").read_text(), "the full traceback goes to the log"


def test_a_failure_while_writing_leaves_nothing_partial(tmp_path):
    """Atomic output, checked on the worker: a fault after the video's temporary
    file is written leaves no video, poster, result or temporary file."""
    from videojob_runtime.worker import JobRequest, RankWorker

    req = JobRequest(job_id="w", model_id="tiny-cogvideox", task="t2v", prompt="a tiny video", width=64, height=64,
                     frames=9, fps=8, steps=2, guidance=6.0, output_dir=str(tmp_path / "o"), output_name="clip",
                     inject_fault={"stage": "write", "kind": "error"})
    out = RankWorker(0, 1).run(req)
    assert not out["ok"] and out["error"]["stage"] == "write"
    assert _files(tmp_path / "o") == []
