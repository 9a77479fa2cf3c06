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
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("torch")
require_module("xfuser")
require_module("ray")

from helpers import REPO, RayHead  # noqa: E402
from videojob_runtime.output import probe_mp4  # noqa: E402

EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"


def _run(tmp_path: Path, *args: str, env: dict | None = None, timeout: float = 300,
         cwd: Path | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "VIDEOJOB_OUTPUT_ROOT": str(tmp_path / "outputs"),
                "RAY_TMPDIR": str(tmp_path / "raytmp"), **(env or {})}
    full_env.pop("RAY_AUTH_TOKEN", None)  # the CLI makes its own
    if not (env or {}).get("VIDEOJOB_DATA_ROOT"):
        full_env.pop("VIDEOJOB_DATA_ROOT", None)  # `videojob run` reads local:// inputs here, or under --inputs
    return subprocess.run([sys.executable, "-m", "videojob.cli", "run", str(EXAMPLE), "--set", "sampling.steps=2",
                           *args], capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd)


I2V = ("--set", "model.name=tiny-cogvideox-i2v", "--set", "parallel=null")


def _tree(directory: Path) -> list[str]:
    """Every path under ``directory``, relative, sorted."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_run_writes_to_the_specs_output_uri_and_never_uses_a_running_ray(tmp_path):
    """`make demo`: the files and the CLI's own lines; Ray's start-up chatter (its
    token-auth WARNING, "Started a local Ray instance") is not among them, and a
    successful run leaves no log (an earlier failed run's log is removed with it).
    Also (one run, for CI time): a Ray cluster already running on the machine, named by
    both its "current cluster" file and RAY_ADDRESS, is not used and gets no actor."""
    where = tmp_path / "outputs" / "videos" / "tiny-cpu"  # spec.output.uri local://videos/tiny-cpu
    where.mkdir(parents=True)
    (where / "tiny-cpu.log").write_text("an earlier run's failure\n")
    with RayHead() as head:
        result = _run(tmp_path, env={"RAY_ADDRESS": head.address, "RAY_TMPDIR": str(head.root)})
        assert result.returncode == 0, result.stderr[-3000:]
        used = next(line for line in result.stdout.splitlines() if line.strip().startswith("ray:"))
        assert head.address not in used and f":{head.port}" not in used
        names = head.run_python("import ray; ray.init(); "
                                "print(sorted(a['Name'] for a in ray._private.state.actors().values()))")
        assert "vj-" not in names, f"videojob run created actors in the running cluster: {names}"
    assert _files(where) == ["tiny-cpu.json", "tiny-cpu.mp4", "tiny-cpu.png"]
    lines = [line.split("\r")[-1] for line in result.stderr.splitlines() if line.split("\r")[-1].strip()]
    assert lines[0] == f"output: spec.output.uri local://videos/tiny-cpu -> {where}"
    assert all(line.startswith("[") and "steps" in line for line in lines[1:]), result.stderr
    assert "WARNING" not in result.stderr and "INFO" not in result.stderr and "Ray instance" not in result.stderr
    assert probe_mp4(where / "tiny-cpu.mp4")["frames"] == 9
    summary = json.loads((where / "tiny-cpu.json").read_text())
    assert summary["plan"]["ulysses"] == 2 and summary["spec"]["sampling"]["steps"] == 2
    assert summary["seed"] == 0 and summary["seedDrawn"] is False
    assert summary["framesDigest"].startswith("sha256:")
    assert "ulysses2" in result.stdout and "embedded local cluster" in result.stdout
    assert "per CPU rank" in result.stdout and "per GPU" not in result.stdout, "a CPU run says CPU rank"


def test_out_overrides_the_output_uri_inputs_are_read_here_and_an_unset_seed_is_drawn(tmp_path):
    """`--out` wins over spec.output.uri and says so; local:// inputs are read where
    `videojob run` runs (it says so) and the ranks read them there too; an unset seed is
    drawn. Also (one run, for CI time): a stale Ray state file and RAY_ADDRESS naming a
    cluster that no longer exists are ignored."""
    from PIL import Image

    (tmp_path / "pics").mkdir()
    Image.new("RGB", (64, 64), (200, 40, 40)).save(tmp_path / "pics" / "red.png")
    state = tmp_path / "raytmp" / "ray"
    state.mkdir(parents=True)
    (state / "ray_current_cluster").write_text("127.0.0.1:1")  # a cluster that no longer exists
    out = tmp_path / "elsewhere"
    result = _run(tmp_path, *I2V, "--set", "image=local://pics/red.png", "--out", str(out), "--set", "seed=null",
                  env={"RAY_ADDRESS": "127.0.0.1:1"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"--out {out} overrides spec.output.uri local://videos/tiny-cpu" in result.stderr
    assert f"inputs: local:// under {tmp_path}" in result.stderr
    assert not (tmp_path / "outputs").exists()
    assert _files(out) == ["tiny-cpu.json", "tiny-cpu.mp4", "tiny-cpu.png"]
    summary = json.loads((out / "tiny-cpu.json").read_text())
    assert summary["seedDrawn"] is True and 0 <= summary["seed"] < 2**32
    assert summary["spec"]["image"] == "local://pics/red.png"
    assert f"seed {summary['seed']}" in result.stdout


def test_bad_input_exits_1_naming_the_field(tmp_path):
    result = _run(tmp_path, "--set", "video.frames=10")
    assert result.returncode == 1 and "spec.video.frames" in result.stderr


def test_a_job_failure_exits_2_with_the_stage_and_leaves_no_video(tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "broken.png").write_bytes(b"not a png")  # there (the up-front check passes); unreadable on the ranks
    result = _run(tmp_path, *I2V, "--set", "image=local://broken.png", "--inputs", str(inputs), "--quiet")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "failed in inputs" in result.stderr and "Traceback" not in result.stderr
    where = tmp_path / "outputs" / "videos" / "tiny-cpu"
    assert _files(where) == ["tiny-cpu.json", "tiny-cpu.log"]
    record = json.loads((where / "tiny-cpu.json").read_text())
    assert record["ok"] is False and record["error"]["stage"] == "inputs"
    log = (where / "tiny-cpu.log").read_text()
    assert "Started a local Ray instance" in log, "Ray's start-up lines go to the log of a failed run"


def test_a_missing_local_input_is_found_up_front_naming_the_field_path_and_setting(tmp_path):
    """Before Ray and the group start (then it took ~15 s and wrote a failure
    record): bad input, exit 1, one line, nothing written."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    result = _run(tmp_path, *I2V, "--set", "image=local://cats/missing.png", "--inputs", str(inputs))
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{EXAMPLE}: spec.image: ") and str(inputs / "cats" / "missing.png") in lines[0]
    assert "--inputs DIR" in lines[0] and "VIDEOJOB_DATA_ROOT" in lines[0]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("case", ["proc", "a-file", "under-a-file", "dev-null", "name-too-long", "empty",
                                  "read-only", "under-read-only"])
def test_an_out_that_cannot_hold_the_files_is_bad_input_and_leaves_nothing(tmp_path, case):
    """`--out /proc/x`, a file, a read-only directory...: one line naming --out,
    exit 1, no traceback, nothing left behind (directories made on the way are removed again)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "a-file").write_text("kept\n")
    readonly = work / "ro"
    if case.endswith("read-only"):
        readonly.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip(f"a read-only directory needs mount (root): {mounted.stderr.strip()}")
    out = {"proc": "/proc/x", "a-file": str(work / "a-file"), "under-a-file": str(work / "a-file" / "sub"),
           "dev-null": "/dev/null", "name-too-long": str(work / "new" / "deeper" / ("x" * 300)), "empty": "",
           "read-only": str(readonly), "under-read-only": str(readonly / "new")}[case]
    try:
        before = _tree(work)
        result = _run(tmp_path, "--out", out)
        after = _tree(work)
    finally:
        if case.endswith("read-only"):
            subprocess.run(["umount", str(readonly)], check=True)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert after == before and (work / "a-file").read_text() == "kept\n"
    assert not (tmp_path / "outputs").exists() and not Path("/proc/x").exists()


def test_ray_errors_surface_and_its_chatter_goes_to_the_run_log(capsys):
    """What `videojob run` does with Ray's log records in its process: all to the
    run's log (written when the job fails), errors also to stderr."""
    import logging

    from videojob.cli import _run_logging
    from videojob_runtime.local import ray_logs_to

    ray_logger = logging.getLogger("ray")
    handlers = list(ray_logger.handlers)
    with _run_logging() as run_log, ray_logs_to():
        logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
        ray_logger.warning("Token authentication is enabled for this Ray cluster.")
        ray_logger.error("the GCS went away")
    err = capsys.readouterr().err
    assert "the GCS went away" in err and "Token" not in err and "Started" not in err
    log = "\n".join(run_log.lines)
    assert "Started a local Ray instance." in log and "Token authentication" in log and "the GCS went away" in log
    assert ray_logger.handlers == handlers, "Ray's own handlers are put back"


def test_an_output_root_that_cannot_hold_the_files_names_the_field_and_variable(tmp_path):
    result = _run(tmp_path, env={"VIDEOJOB_OUTPUT_ROOT": "/proc/videojob-outputs"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "spec.output.uri local://videos/tiny-cpu" in result.stderr and "VIDEOJOB_OUTPUT_ROOT" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


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
