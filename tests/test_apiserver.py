"""The VideoJob CRD on a real kube-apiserver (hack/cluster/localcluster.py).

Never skipped in CI: conftest's kube_cluster fixture fails when CI=true or
VIDEOJOB_REQUIRE_CLUSTER=1 and the cluster cannot start.
"""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from helpers import EXAMPLES, INVALID, REPO, SPEC_SPACE, expected_field, load, plannable_without_limits
from videojob.api import InvalidVideoJob, parse_spec
from videojob.crd import CRD_NAME

pytestmark = pytest.mark.cluster
GROUP, VERSION, PLURAL = "videojob.io", "v1alpha1", "videojobs"


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
              "plan": {"gpus": 2, "ulysses": 2, "summary": "ulysses2, no offload", "gpuClass": "a100-80"}}
    crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": status}))
    lines = crd.kubectl("get", "vj", "-n", namespace).stdout.splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "PROGRESS", "GPUS", "CLASS", "QUEUE", "MODEL", "AGE"]
    assert lines[1].split()[:6] == ["tiny-cpu", "Running", "50", "2", "a100-80", "tiny-cogvideox"]
    wide = crd.kubectl("get", "videojobs", "-n", namespace, "-o", "wide").stdout
    assert "PLAN" in wide.splitlines()[0] and "ulysses2, no offload" in wide
    # A queued job shows its place and, with -o wide, what it waits for.
    crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": {"phase": "Queued", "progress": None,
                                             "queue": {"position": 3, "waitingFor": "8 GPU(s) in one a100-80 pod"}}}))
    queued = crd.kubectl("get", "vj", "-n", namespace).stdout.splitlines()[1].split()
    assert queued[:5] == ["tiny-cpu", "Queued", "2", "a100-80", "3"], queued
    assert "8 GPU(s) in one a100-80 pod" in crd.kubectl("get", "vj", "-n", namespace, "-o", "wide").stdout


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


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=SPEC_SPACE)
def test_server_and_python_agree(custom_api, namespace, spec):
    """CEL in the CRD and the Python rules give the same verdict on the same spec,
    and what the server accepts the planner can plan (given enough GPUs)."""
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
    else:
        problem = plannable_without_limits(spec)
        assert problem is None, f"the server accepted a spec the planner refuses: {problem}\n{yaml.safe_dump(spec)}"


def test_kubectl_explain_shows_what_fields_mean(crd):
    video = crd.kubectl("explain", "videojob.spec.video").stdout
    for field in ("width", "height", "frames", "fps"):
        assert field in video
    assert "Width in pixels" in video and "native" in video and "Frames per second" in video
    quantity = crd.kubectl("explain", "videojob.spec.resources.gpuMemory").stdout
    assert "Kubernetes quantity" in quantity and "24Gi" in quantity
    conditions = crd.kubectl("explain", "videojob.status.conditions").stdout
    assert "latest condition of each type" in conditions


def test_the_spec_is_immutable_after_creation(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", str(REPO / "examples" / "tiny-cpu.yaml"))
    result = crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--type=merge",
                         "-p", json.dumps({"spec": {"prompt": "something else"}}), check=False)
    assert result.returncode != 0 and "spec is immutable" in result.stderr
    labels = crd.kubectl("label", "vj", "tiny-cpu", "-n", namespace, "team=video", check=False)
    assert labels.returncode == 0, "metadata stays editable"
    # The field rules run at creation only (crd.creation_only); a hostile value
    # slipped in by an update is still refused, by the immutability rule.
    hostile = crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--type=merge",
                          "-p", json.dumps({"spec": {"output": {"uri": "local://../../etc"}}}), check=False)
    assert hostile.returncode != 0 and "spec is immutable" in hostile.stderr
    status = crd.kubectl("patch", "vj", "tiny-cpu", "-n", namespace, "--subresource=status", "--type=merge",
                         "-p", json.dumps({"status": {"phase": "Queued"}}), check=False)
    assert status.returncode == 0, status.stderr


def test_the_operator_lists_videojobs_in_pages_and_survives_an_expired_continue_token(crd, namespace):
    """The sweep and the rebuild read VideoJobs in pages (never one unbounded list); a
    continue token that expired (410, after a compaction) makes it list again from the start."""
    from kubernetes.client.rest import ApiException

    from videojob.controller.kube import VideoJobs

    doc = load(REPO / "examples" / "tiny-cpu.yaml")
    for i in range(7):
        doc["metadata"] = {"name": f"paged-{i}"}
        crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc))
    api = k8s_config.new_client_from_config(config_file=str(crd.kubeconfig))
    jobs = VideoJobs(api)
    calls: list[dict] = []
    real = jobs.api.list_namespaced_custom_object
    expire_once = {"armed": False}

    def counting(*args, **kwargs):
        calls.append(kwargs)
        if expire_once["armed"] and kwargs.get("_continue"):
            expire_once["armed"] = False
            raise ApiException(status=410, reason="Expired")
        return real(*args, **kwargs)

    jobs.api.list_namespaced_custom_object = counting
    names = sorted(o["metadata"]["name"] for o in jobs.list([namespace], page_size=2))
    assert names == [f"paged-{i}" for i in range(7)]
    assert len(calls) == 4 and all(c["limit"] == 2 for c in calls)  # 2+2+2+1, each page asked for
    calls.clear()
    expire_once["armed"] = True
    assert sorted(o["metadata"]["name"] for o in jobs.list([namespace], page_size=3)) == names
    assert [bool(c.get("_continue")) for c in calls] == [False, True, False, True, True]  # listed again
    # reduce: applied page by page (what the sweep and the rebuild keep), None dropped, and a
    # listing started again after a 410 keeps nothing of the first try (no job twice)
    seen_pages: list[int] = []

    def reduce(obj):
        seen_pages.append(len(calls))
        name = obj["metadata"]["name"]
        return None if name == "paged-3" else name

    calls.clear()
    expire_once["armed"] = True
    reduced = jobs.list([namespace], page_size=3, reduce=reduce)
    assert sorted(reduced) == [n for n in names if n != "paged-3"] and len(reduced) == 6
    assert seen_pages[:3] == [1, 1, 1]  # the first page reduced before the second was asked for
    api.close()



def test_a_status_write_reaches_only_the_object_it_was_read_from(crd, namespace):
    """Issue 36, 8: a deleted job's thread still holds its StatusBook; the job is made again under
    the same name. The API server ignores a uid in a merge patch, so the book writes a JSON patch
    that tests /metadata/uid first: its write to the new object is refused (Gone) and the new
    object's status stays as it was. Writes to the right object keep merge-patch semantics: the
    first one adds the status, a None removes a key, a dict merges into what was read."""
    from videojob.controller.kube import Gone, VideoJobs, api_client
    from videojob.controller.status import StatusBook

    doc = load(REPO / "examples" / "tiny-cpu.yaml")
    doc["metadata"] = {"name": "namesake", "namespace": namespace}
    crd.kubectl("create", "-f", "-", input=json.dumps(doc))
    configuration = k8s.Configuration()
    k8s_config.load_kube_config(config_file=str(crd.kubeconfig), client_configuration=configuration)
    api = api_client(timeout_s=30, configuration=configuration)
    try:
        jobs = VideoJobs(api)
        old = StatusBook(jobs, namespace, "namesake", uid=jobs.get(namespace, "namesake")["metadata"]["uid"])
        old.load()  # no status yet: the first write adds it whole
        assert old.update({"phase": "Queued", "message": "waiting", "progress": {"step": 0, "steps": 4}})
        assert old.update({"message": None, "progress": {"step": 2}})
        status = jobs.get(namespace, "namesake")["status"]
        assert status["phase"] == "Queued" and "message" not in status
        assert status["progress"] == {"step": 2, "steps": 4}

        crd.kubectl("delete", "videojob", "namesake", "-n", namespace, "--wait=true")
        crd.kubectl("create", "-f", "-", input=json.dumps(doc))
        new = StatusBook(jobs, namespace, "namesake", uid=jobs.get(namespace, "namesake")["metadata"]["uid"])
        new.load()
        assert new.update({"phase": "Pending", "message": "the new job's"})
        with pytest.raises(Gone, match="another object of that name now"):
            old.update({"phase": "Failed", "message": "the old thread's last word"})
        unbooked = StatusBook(jobs, namespace, "namesake", uid=old.uid)  # never read: each key added
        with pytest.raises(Gone, match="another object of that name now"):
            unbooked.update({"phase": "Failed"})
        status = jobs.get(namespace, "namesake")["status"]
        assert (status["phase"], status["message"]) == ("Pending", "the new job's")
    finally:
        api.close()
