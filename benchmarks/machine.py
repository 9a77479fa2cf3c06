"""What every benchmark result records, the same way: the commit, the machine, the command.

``record(...)`` is the header of every file under ``benchmarks/results/``:
the commit (``git rev-parse HEAD``) and whether the tree had uncommitted
changes (the numbers then belong to the commit plus those changes: their
paths are listed), the machine (``describe()``), the command that wrote the
file, and when. ``write_result`` writes a result with that header; scripts
write nothing by hand into results files.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def describe() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem_gib = None
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            mem_gib = round(kib / 1024**2, 1)
    except (OSError, StopIteration):
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:  # the planner benchmark runs without torch too
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memoryGiB": mem_gib,
        "python": sys.version.split()[0],
        "gpu": gpu,
    }


def git_state() -> dict[str, Any]:
    """The commit the tree is at, and the paths that differ from it (tracked and untracked)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=normal").splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "changedPaths": []}
    # Results files written earlier in the same `make bench` are outputs, not source changes.
    changed = [path for path in changed if not path.startswith("benchmarks/results/")]
    return {"commit": commit, "dirty": bool(changed), "changedPaths": sorted(changed)}


def command() -> str:
    """The command that is running, as typed from the repository root (and the make target, if any)."""
    script = Path(sys.argv[0]).resolve()
    try:
        script_arg = str(script.relative_to(REPO))
    except ValueError:
        script_arg = str(script)
    text = shlex.join(["python", script_arg, *sys.argv[1:]])
    target = os.environ.get("VIDEOJOB_BENCH_TARGET")  # set by the Makefile's bench targets
    return f"{text} (via {target})" if target else text


def record() -> dict[str, Any]:
    return {**git_state(), "machine": describe(), "command": command(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_result(name: str, result: dict[str, Any], path: Path | None = None) -> Path:
    """Write ``result`` under benchmarks/results/``name`` (or ``path``), headed by ``record()``."""
    out = path or RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": result.pop("benchmark", Path(name).stem), **record(), **result}
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(tmp, out)
    return out
