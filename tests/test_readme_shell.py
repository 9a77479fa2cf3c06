"""The README's shell blocks, run word for word in a new shell (issue 18).

A new user copies the README's ```sh blocks into a fresh shell: nothing
activated, no variable of ours set. This runs them the same way, in order, in
one `bash -e` with a clean environment (HOME, a PATH without the venv, LANG),
from the repository root. A block the machine cannot run says why in the
HTML comment just above it (`<!-- readme-shell: REASON -->`); `make test` is
skipped because it is what runs this test. Every other line runs, and what
the README says it does is checked: the demo's video, the tools on PATH, the
plan, the run's files.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers import REPO

README = REPO / "README.md"
SKIP_LINES = {"make test": "this is the command running the tests"}
BLOCK = re.compile(r"(?:<!--\s*readme-shell:\s*(?P<why>.*?)\s*-->\s*\n)?```sh\n(?P<body>.*?)```", re.S)


def readme_blocks() -> list[tuple[str | None, str]]:
    """(reason it is not run or None, body) of every ```sh block, in order."""
    return [(m.group("why"), m.group("body")) for m in BLOCK.finditer(README.read_text())]


def runnable_script() -> str:
    lines = []
    for why, body in readme_blocks():
        if why:
            continue
        for line in body.splitlines():
            command = line.split("#", 1)[0].strip()
            if command in SKIP_LINES:
                continue
            lines.append(line)
    return "\n".join(lines) + "\n"


def clean_env(home: Path) -> dict[str, str]:
    """A new login's environment: no venv on PATH, none of our variables; Go where the
    machine has it (README: make test needs Go)."""
    venv = str(REPO / ".venv")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not p.startswith(venv)]
    if Path("/usr/local/go/bin").is_dir() and "/usr/local/go/bin" not in path:
        path.append("/usr/local/go/bin")
    return {"HOME": str(home), "PATH": os.pathsep.join(path), "LANG": "C.UTF-8", "TERM": "dumb",
            "USER": os.environ.get("USER", "root")}


def test_every_block_is_run_or_says_why_not():
    blocks = readme_blocks()
    assert blocks, "the README shows no shell block"
    for why, body in blocks:
        assert why is None or len(why) > 10, f"a skipped block must say why: {body[:80]!r}"
    script = runnable_script()
    for expected in ("make demo", 'eval "$(make -s env)"', "videojob validate", "videojob plan", "videojob run"):
        assert expected in script, f"the README's runnable blocks lost `{expected}`"


def test_the_readme_runs_word_for_word(tmp_path):
    script = runnable_script()
    # the user's HOME, so the tool caches (~/.cache/videojob, pip's) are found as on their machine
    env = clean_env(Path(os.environ.get("HOME", str(tmp_path))))
    probe = ('echo "PATHS videojob=$(command -v videojob) kubectl=$(command -v kubectl) '
             'helm=$(command -v helm) KUBECONFIG=$KUBECONFIG"')
    result = subprocess.run(["bash", "--noprofile", "--norc", "-e", "-o", "pipefail", "-c", script + probe],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"the README's commands failed ({result.returncode}):\n{out[-6000:]}"
    video = REPO / "out" / "videos" / "tiny-cpu" / "tiny-cpu.mp4"
    assert video.is_file() and video.stat().st_size > 0, "make demo / videojob run wrote no video"
    paths = re.search(r"^PATHS (.*)$", result.stdout, re.M).group(1)
    assert f"videojob={REPO}/.venv/bin/videojob" in paths, paths
    built = subprocess.run(["bash", str(REPO / "hack" / "cluster" / "build-tools.sh"), "--print"],
                           capture_output=True, text=True, env={**env}).returncode == 0
    if built:  # make test built them (CI always has): then eval "$(make -s env)" must find them
        assert "kubectl=/" in paths and "helm=/" in paths, paths
    assert f"KUBECONFIG={REPO}/.cluster/kubeconfig" in paths, paths
    assert "Chosen:" in result.stdout, "videojob plan printed no choice"
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.parametrize("reason", [why for why, _ in readme_blocks() if why])
def test_skipped_blocks_are_for_what_this_machine_lacks(reason):
    """Only commands that need a GPU cluster (or an installed chart) are not run."""
    assert re.search(r"GPU|cluster|KubeRay|chart", reason), reason
