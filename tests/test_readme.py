"""The README is the front door, docs/ the depth: what they show must be what the
repository has, and the README stays a door (short, linking every doc)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from helpers import REPO

README = (REPO / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
EVERYTHING = README + "".join(DOCS.values())
# A front door, not the manual (issue 18: ~250 lines; the depth is in docs/).
README_MAX_LINES = 260


def _section(title: str) -> str:
    start = README.index(f"## {title}")
    end = README.find("\n## ", start + 3)
    return README[start:end if end != -1 else None]


def test_the_architecture_picture_is_there():
    assert "![architecture](docs/architecture.png)" in README
    png = (REPO / "docs" / "architecture.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not installed (apt-get install graphviz)")
def test_the_architecture_source_renders():
    result = subprocess.run(["dot", "-Tcanon", str(REPO / "docs" / "architecture.dot")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for component in ("kube-apiserver", "kopf operator", "planner", "gang scheduler", "KubeRay", "Ray head", "PVC"):
        assert component in result.stdout, component


def test_the_gpu_cluster_example_is_the_values_file():
    """The abridged values in "On a GPU cluster" agree with the file the
    helm command installs (and the chart tests install)."""
    section = _section("On a GPU cluster")
    command = re.search(r"helm install videojob charts/videojob .*?-f (\S+)", section, re.S)
    assert command, "the section's helm install names no values file"
    values = yaml.safe_load((REPO / command.group(1)).read_text())
    shown = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))

    def subset(small, big, path="$"):
        if isinstance(small, dict):
            assert isinstance(big, dict), path
            for key, value in small.items():
                assert key in big, f"{path}.{key} is shown but not in {command.group(1)}"
                subset(value, big[key], f"{path}.{key}")
        elif isinstance(small, list):
            assert isinstance(big, list) and len(small) == len(big), path
            for i, (a, b) in enumerate(zip(small, big)):
                subset(a, b, f"{path}[{i}]")
        else:
            assert small == big, f"{path}: README shows {small!r}, the file has {big!r}"

    subset(shown, values)


def test_the_readme_is_a_door():
    """Short, and every page of docs/ is linked from it (and every link there resolves)."""
    assert len(README.splitlines()) <= README_MAX_LINES, f"README.md has {len(README.splitlines())} lines"
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)\)", README))
    assert set(DOCS) <= linked, f"docs/ pages the README does not link: {sorted(set(DOCS) - linked)}"
    assert linked <= set(DOCS), f"the README links missing pages: {sorted(linked - set(DOCS))}"


def test_links_in_docs_resolve():
    for name, text in DOCS.items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            assert (REPO / "docs" / target).resolve().exists(), f"docs/{name} links {target}, which does not exist"


def test_make_targets_the_readme_names_exist():
    makefiles = (REPO / "Makefile").read_text() + (REPO / "hack" / "cluster.mk").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefiles, re.M))
    named = (set(re.findall(r"`make (?:-s )?([a-z][a-z0-9-]*)", EVERYTHING))
             | set(re.findall(r"^make (?:-s )?([a-z][a-z0-9-]*)", EVERYTHING, re.M))
             | set(re.findall(r"\$\(make -s ([a-z][a-z0-9-]*)\)", EVERYTHING)))
    assert named and named <= targets, f"README.md and docs/ name missing make targets: {sorted(named - targets)}"


def test_paths_the_readme_names_exist():
    paths = set(re.findall(r"`((?:charts|examples|hack|docs|benchmarks|tests|tools|operator|runtime|crds)/[\w./-]+)`",
                           EVERYTHING))
    missing = sorted(p for p in paths if not (REPO / p.rstrip("/")).exists() and "<" not in p and "*" not in p)
    assert paths and not missing, f"README.md and docs/ name paths that do not exist: {missing}"


def test_kind_e2e_says_so_where_it_cannot_run(tmp_path):
    """Without a Docker daemon (or kind) the e2e script must exit 0 and say it
    did not run, never claim a run. Run with a docker stub that fails as an
    unreachable daemon does, so the answer is the same on every machine."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "docker").write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    (stub / "docker").chmod(0o755)

    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(REPO / "hack" / "kind-e2e.sh")], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("SKIPPED: kind e2e not run"), result.stdout
    assert "Succeeded" not in result.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)")
def test_shell_scripts_pass_shellcheck():
    scripts = [REPO / "hack" / "kind-e2e.sh", REPO / "hack" / "cluster" / "build-tools.sh",
               REPO / "hack" / "cluster" / "build-gotool.sh"]
    result = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chaos_figures_are_the_soaks_own():
    """The README's chaos sentence quotes benchmarks/results/chaos.json, which the soak
    writes: a newer run changes the file, and this test says the README must follow."""
    import json

    result = json.loads((REPO / "benchmarks" / "results" / "chaos.json").read_text())
    section = " ".join(_section("Faults lose nothing").split())
    quoted = re.search(r"seed (\d+)\): (\d+) jobs, (\d+) faults, (\d+) attempts, (\d+) retries: (\d+) lost, "
                       r"(\d+) duplicated, (\d+) left over", section)
    assert quoted, f"the README's chaos sentence changed shape: {section[:600]}"
    expected = (result["seed"], result["jobs"], sum(result["faultsByKind"].values()), result["attempts"],
                result["retries"], result["lost"], result["duplicated"], result["leftOver"])
    assert tuple(int(g) for g in quoted.groups()) == expected
    assert result["passed"] and result["booksMatch"], "the README says the last soak passed"


def test_the_checkpoint_and_preemption_figures_are_the_benchmarks_own():
    """The README's preemption section quotes benchmarks/results/checkpoint.json and
    preemption_sim.json, which `make bench` writes: a newer run must be quoted anew."""
    import json

    results = REPO / "benchmarks" / "results"
    cost = json.loads((results / "checkpoint.json").read_text())["families"].values()
    sim = json.loads((results / "preemption_sim.json").read_text())
    section = " ".join(_section("Preemption loses no steps").split())
    quoted = re.search(r"costs at most ([\d.]+) ms and (\d+) kB, ([\d.]+)% of a step", section)
    assert quoted, f"the README's checkpoint sentence changed shape: {section[:600]}"
    assert float(quoted.group(1)) == round(1000 * max(f["checkpointSeconds"] for f in cost), 1)
    assert int(quoted.group(2)) == round(max(f["checkpointBytes"] for f in cost) / 1000)
    assert float(quoted.group(3)) == round(100 * max(f["shareOfStep"] for f in cost), 2)
    assert all(f["resumeBitIdentical"] for f in cost), "the README says resumes are bit-identical"
    fleet = re.search(r"\((\S+): (\d+) GPUs, (\d+) jobs\) the high-priority p95 wait is ([\d.]+) s without "
                      r"preemption, ([\d.]+) s with preemption and checkpoints, and ([\d.]+) s with preemption "
                      r"from step 0, which loses ([\d.]+)x the GPU-seconds; videos per hour are ([\d.]+) in all three",
                      section)
    assert fleet, f"the README's simulation sentence changed shape: {section[:900]}"
    cmp = sim["comparison"]
    assert fleet.group(1).endswith("preemption_sim.json`")
    assert (int(fleet.group(2)), int(fleet.group(3))) == (sim["fleet"]["gpus"], sim["jobs"])
    wait = cmp["highWaitP95"]
    assert [float(g) for g in fleet.group(4, 5, 6)] == [wait["no-preemption"], wait["preempt-checkpoint"],
                                                         wait["preempt-restart"]]
    assert float(fleet.group(7)) == round(cmp["ratios"]["gpuSecondsLost preempt-restart / preempt-checkpoint"], 2)
    assert len(set(cmp["videosPerHour"].values())) == 1 and float(fleet.group(8)) == cmp["videosPerHour"]["no-preemption"]


def test_the_kueue_load_figures_are_the_benchmarks_own():
    """docs/performance.md quotes benchmarks/results/kueue_load.json (make bench)."""
    import json

    doc = json.loads((REPO / "benchmarks" / "results" / "kueue_load.json").read_text())
    text = " ".join((REPO / "docs" / "performance.md").read_text().split())
    assert f"{doc['jobs']} jobs from four teams" in text and f"All {doc['succeeded']} succeeded" in text
    assert f"{doc['jobsPerSecondAdmitted']} jobs/s admitted" in text
    assert f"operator peak RSS {doc['operatorPeakRssMiB']} MiB" in text
    assert f"left {doc['workloadsLeftAfterDeletion']} Workloads" in text
    for team, share in doc["shares"]["teams"].items():
        assert f"{team} {share['admittedGPUShare']} / {share['nominalQuotaShare']}" in text, team
