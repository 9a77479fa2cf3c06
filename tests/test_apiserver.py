"""The VideoJob CRD on a real kube-apiserver (hack/cluster/localcluster.py).

Never skipped in CI: conftest's kube_cluster fixture fails when CI=true or
VIDEOJOB_REQUIRE_CLUSTER=1 and the cluster cannot start.
"""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from helpers import EXAMPLES, INVALID, REPO, expected_field, load, wait_for
from videojob.api import InvalidVideoJob, parse_spec
from videojob.catalog import CACHE_POLICIES, MODEL_IDS, TASKS
from videojob.crd import CRD_FILE, CRD_NAME

pytestmark = pytest.mark.cluster
GROUP, VERSION, PLURAL = "videojob.io", "v1alpha1", "videojobs"


@pytest.fixture(scope="module")
def crd(kube_cluster):
    """Install (or update) the CRD and wait until the server serves it."""
    kube_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds" / CRD_FILE))
    kube_cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{CRD_NAME}")
    # Established can precede discovery by a moment; wait until kubectl resolves `vj`.
    wait_for("kubectl to resolve the `vj` short name",
             lambda: kube_cluster.kubectl("get", "vj", "-A", check=False).returncode == 0, timeout=30)
    return kube_cluster


@pytest.fixture(scope="module")
def custom_api(crd):
    api_client = k8s_config.new_client_from_config(config_file=str(crd.kubeconfig))
    yield k8s.CustomObjectsApi(api_client)
    api_client.close()


def test_crd_is_established(crd):
    out = json.loads(crd.kubectl("get", f"crd/{CRD_NAME}", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in out["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True"
    assert out["status"]["acceptedNames"]["shortNames"] == ["vj"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted(crd, namespace, path):
    crd.kubectl("create", "-n", namespace, "-f", str(path))
    stored = json.loads(crd.kubectl("get", "vj", "-n", namespace, load(path)["metadata"]["name"], "-o", "json").stdout)
    assert stored["spec"] == load(path)["spec"], "the server pruned or changed fields of a valid spec"


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_bad_files_are_rejected_naming_the_field(crd, namespace, path):
    result = crd.kubectl("create", "-n", namespace, "-f", str(path), check=False)
    assert result.returncode != 0, f"the server accepted {path.name}"
    assert f"{expected_field(path)}:" in result.stderr, result.stderr
    assert crd.kubectl("get", "vj", "-n", namespace, "-o", "name").stdout.strip() == ""


def test_get_shows_printer_columns(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", str(REPO / "examples" / "tiny-cpu.yaml"))
    status = {"phase": "Running", "progress": {"step": 2, "steps": 4, "percent": 50},
              "plan": {"gpus": 2, "ulysses": 2, "summary": "ulysses2, no offload"}}
    crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": status}))
    lines = crd.kubectl("get", "vj", "-n", namespace).stdout.splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "PROGRESS", "GPUS", "MODEL", "AGE"]
    assert lines[1].split()[:5] == ["tiny-cpu", "Running", "50", "2", "tiny-cogvideox"]
    wide = crd.kubectl("get", "videojobs", "-n", namespace, "-o", "wide").stdout
    assert "PLAN" in wide.splitlines()[0] and "ulysses2, no offload" in wide


def test_category_lists_videojobs(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", str(REPO / "examples" / "tiny-cpu.yaml"))
    assert "videojob.videojob.io/tiny-cpu" in crd.kubectl("get", "videojob", "-n", namespace, "-o", "name").stdout
    assert "tiny-cpu" in crd.kubectl("get", "all", "-n", namespace).stdout


def test_status_subresource_ignores_spec_and_main_ignores_status(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", str(REPO / "examples" / "tiny-cpu.yaml"))
    crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"spec": {"prompt": "changed through status"}, "status": {"phase": "Running"}}))
    obj = json.loads(crd.kubectl("get", "vj", "tiny-cpu", "-n", namespace, "-o", "json").stdout)
    assert obj["spec"]["prompt"] == "A tiny test video."
    assert obj["status"]["phase"] == "Running"
    generation = obj["metadata"]["generation"]

    crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--type=merge",
                "-p", json.dumps({"status": {"phase": "Failed"}}))
    obj = json.loads(crd.kubectl("get", "vj", "tiny-cpu", "-n", namespace, "-o", "json").stdout)
    assert obj["status"]["phase"] == "Running", "status changed through the main resource"
    assert obj["metadata"]["generation"] == generation


def test_status_schema_rejects_bad_phase(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", str(REPO / "examples" / "tiny-cpu.yaml"))
    result = crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--subresource=status", "--type=merge",
                         "-p", json.dumps({"status": {"phase": "Exploded"}}), check=False)
    assert result.returncode != 0 and "status.phase" in result.stderr


# A spec space around the rules: mostly near-valid values, so both verdicts occur.
_specs = st.fixed_dictionaries(
    {"model": st.fixed_dictionaries({"name": st.sampled_from(MODEL_IDS)}), "prompt": st.just("a cat")},
    optional={
        "task": st.sampled_from(TASKS),
        "image": st.just("pvc://inputs/a.png"),
        "faceImage": st.just("pvc://inputs/face.png"),
        "video": st.fixed_dictionaries({}, optional={
            "width": st.sampled_from([16, 48, 64, 100, 256, 512, 720, 721, 1280, 2048, 4096]),
            "height": st.sampled_from([16, 48, 480, 512, 700, 704, 720, 768]),
            "frames": st.sampled_from([1, 9, 16, 17, 32, 33, 49, 50, 81, 161]),
        }),
        "sampling": st.fixed_dictionaries({}, optional={"guidanceScale": st.sampled_from([0.0, 1.0, 1.5, 6.0])}),
        "cache": st.fixed_dictionaries({"policy": st.sampled_from(CACHE_POLICIES)}),
        "resources": st.fixed_dictionaries({"maxGPUs": st.integers(1, 8)}),
        "parallel": st.fixed_dictionaries({}, optional={
            "ulysses": st.integers(1, 8), "ring": st.integers(1, 3), "cfg": st.integers(1, 2)}),
    },
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_specs)
def test_server_and_python_agree(custom_api, namespace, spec):
    """CEL in the CRD and the Python rules give the same verdict on the same spec."""
    try:
        parse_spec(spec)
        python_problems: list[str] = []
    except InvalidVideoJob as exc:
        python_problems = [p.field for p in exc.problems]
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "VideoJob", "metadata": {"name": "probe"}, "spec": spec}
    try:
        custom_api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, dry_run="All")
        server_error = None
    except k8s.ApiException as exc:
        assert exc.status == 422, exc.body
        server_error = json.loads(exc.body)["message"]
    assert (server_error is None) == (not python_problems), (
        f"spec {yaml.safe_dump(spec)}python: {python_problems}\nserver: {server_error}"
    )
    if server_error:
        assert any(f"{field}:" in server_error for field in python_problems), (python_problems, server_error)
