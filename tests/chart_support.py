"""Shared by tests/test_chart.py, tests/test_chart_kuberay.py and
tests/test_chart_schema.py (the chart rendered by `helm template`, no cluster): the
chart's paths and values, the fixtures helm and chart (module scope: each test module
renders a distinct set of values once), and helpers that pick rendered objects.

A test module imports the fixtures it uses, `helm` with `chart` (chart asks for it)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import REPO, helm_binary, inventory_source
from videojob.inventory import load_inventory


CHART = REPO / "charts" / "videojob"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
RELEASE, NAMESPACE = "vj", "vj-system"
HELM_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


class Helm:
    """helm template with a cache: each distinct set of values renders once per module."""

    def __init__(self, binary: str, tmp: Path):
        self.binary, self.tmp = binary, tmp
        self.cache: dict[str, subprocess.CompletedProcess] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.binary, *args], capture_output=True, text=True, cwd=REPO, timeout=HELM_TIMEOUT_S)

    def template(self, ci: str | None = None, values: dict | None = None) -> subprocess.CompletedProcess:
        key = json.dumps([ci, values], sort_keys=True)
        if key not in self.cache:
            args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
            if ci:
                args += ["-f", str(CHART / "ci" / ci)]
            if values is not None:
                path = self.tmp / f"values-{len(self.cache)}.yaml"
                path.write_text(yaml.safe_dump(values))
                args += ["-f", str(path)]
            self.cache[key] = self.run(*args)
        return self.cache[key]

    def render(self, ci: str | None = None, values: dict | None = None) -> list[dict]:
        result = self.template(ci, values)
        assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
        return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.fixture(scope="module")
def chart(helm, tmp_path_factory) -> Helm:
    return Helm(helm, tmp_path_factory.mktemp("values"))


def _merged(base: dict, over: dict) -> dict:
    """``over`` over ``base``, maps merged at every depth (as helm merges values files)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def ci_values(ci: str | None, extra: dict | None = None) -> dict:
    """The effective values of a ci file (and ``extra`` values over it)."""
    merged = json.loads(json.dumps(VALUES))
    merged = _merged(merged, yaml.safe_load((CHART / "ci" / ci).read_text()) if ci else {})
    return _merged(merged, extra or {})


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def operator_container(docs: list[dict]) -> dict:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def class_groups(rc: dict) -> dict[str, dict]:
    """The RayCluster's worker groups of GPU classes (all but the drivers group), by name."""
    return {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] != DRIVERS}


def drivers_group(rc: dict) -> dict:
    (group,) = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == DRIVERS]
    return group


def ray_containers(rc: dict) -> list[tuple[str, dict]]:
    """(where, container) of every Ray container of the RayCluster (head, drivers, classes)."""
    return [(where, pod["containers"][0]) for where, pod in pod_specs([rc])]


def pod_specs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod the chart renders."""
    specs = [(f"Deployment/{d['metadata']['name']}", d["spec"]["template"]["spec"])
             for d in of_kind(docs, "Deployment")]
    for rc in of_kind(docs, "RayCluster"):
        specs.append(("RayCluster head", rc["spec"]["headGroupSpec"]["template"]["spec"]))
        specs += [(f"RayCluster group {g['groupName']}", g["template"]["spec"]) for g in rc["spec"]["workerGroupSpecs"]]
    return specs


MODES = [None, *[p.name for p in CI_VALUES]]
KUBERAY_CI = [p.name for p in CI_VALUES if ci_values(p.name)["ray"]["mode"] == "kuberay"]
DRIVERS = "drivers"  # the drivers' worker group, and its Ray resource vj-driver
DRIVER_RESOURCE = "vj-driver"
# kuberay without a token Secret is refused; tests that set other values give one
TOKEN = {"ray": {"mode": "kuberay", "auth": {"existingSecret": "ray-token"}}}


def _inventory(docs: list[dict], tmp_path: Path):
    """The inventory the operator reads: the file VIDEOJOB_INVENTORY_FILE names, found in
    the ConfigMap the Deployment mounts there, loaded by the operator's own loader."""
    path, configmap_name = inventory_source(one(docs, "Deployment"))
    configmap = next(c for c in of_kind(docs, "ConfigMap") if c["metadata"]["name"] == configmap_name)
    local = tmp_path / path.name
    local.write_text(configmap["data"][path.name])
    return load_inventory(str(local))


def _class(**overrides) -> dict:
    klass = {"name": "a100-80", "gpuMemory": "80Gi", "gpusPerPod": 8, "maxPods": 1, "hostMemory": "1Ti"}
    klass.update(overrides)
    return {k: v for k, v in klass.items() if v is not None}
