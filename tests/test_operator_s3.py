"""The operator with a bucket (issue 23): `kubectl apply` VideoJobs whose image, weights
and video live in object storage, against a real S3 server.

What is real: the loopback kube-apiserver, a Ray head the test owns (its drivers inherit
the admin's S3 settings from its environment, as the chart's `runtime.s3` values put them
on the Ray containers), the operator as a subprocess, the tiny CPU models and rclone's
`serve s3` (hack/cluster/lc/s3.py). What is asserted is what a user sees: the status
(phase, object uris, the presigned URL and its expiry, the upload's seconds) and what a
reader of the bucket finds (the three objects, the mp4 decoded, nothing partial).
"""

from __future__ import annotations

import json
import sys
import urllib.request
import uuid

import pytest

from helpers import REPO, require_module

require_module("ray")
require_module("xfuser")
require_module("boto3")
require_module("av")

sys.path.insert(0, str(REPO / "hack" / "cluster"))

from helpers import RayHead  # noqa: E402
from lc.s3 import start_s3_server  # noqa: E402
from operator_harness import OperatorProcess, create, tiny_job, videojob, wait_phase, write_inventory  # noqa: E402

pytestmark = pytest.mark.cluster
PRESIGN_S = 900


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("s3")
    started = start_s3_server(root / "data", root / "rclone.log")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def bucket(server):
    """A fresh bucket and a client of the store with the admin's credentials (as a reader sees it)."""
    client = server.client()
    name = f"vj-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return client, name


@pytest.fixture(scope="module")
def ray_head(server, bucket, tmp_path_factory):
    """A Ray head whose drivers use the store: the chart sets the same VIDEOJOB_S3_* on Ray pods,
    the buckets tenants' jobs may name among them (one listed that does not exist: a case below)."""
    base = tmp_path_factory.mktemp("operator-s3")
    env = {**server.env(), "VIDEOJOB_OUTPUT_ROOT": str(base / "outputs"), "OMP_NUM_THREADS": "1",
           "VIDEOJOB_S3_BUCKETS": f"{bucket[1]},{bucket[1]}-gone",
           "VIDEOJOB_S3_CACHE_ROOT": str(base / "s3-cache"), "VIDEOJOB_S3_PRESIGN_EXPIRY_S": str(PRESIGN_S)}
    with RayHead(num_cpus=2, dashboard=True, env=env) as head:
        yield head


@pytest.fixture
def operator_env(ray_head, tmp_path):
    token = tmp_path / "ray-token"
    token.write_text(ray_head.token)
    return {"VIDEOJOB_RAY_MODE": "address", "VIDEOJOB_RAY_DASHBOARD_URL": ray_head.dashboard_url,
            "VIDEOJOB_RAY_TOKEN_FILE": str(token), "VIDEOJOB_DRIVER_PYTHON": sys.executable,
            # Room on paper for cogvideox-2b, whose weights here are a saved tiny model.
            "VIDEOJOB_INVENTORY_FILE": str(write_inventory(tmp_path / "inventory.yaml", gpu_memory="80Gi",
                                                           host_memory="512Gi")),
            "VIDEOJOB_WARM_GROUP_TTL_S": "0"}


def _keys(client, bucket: str, prefix: str = "") -> list[str]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed)


def _unfinished(client, bucket: str) -> list:
    try:
        return client.list_multipart_uploads(Bucket=bucket).get("Uploads") or []
    except client.exceptions.NoSuchUpload:  # rclone's answer when there are none
        return []


def _upload_tree(client, bucket: str, root, prefix: str) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root)}")


def _job(name: str, **spec_changes) -> dict:
    doc = tiny_job(name, steps=2, **spec_changes)
    doc["spec"] = {k: v for k, v in doc["spec"].items() if v is not None}
    return doc


def test_jobs_read_their_image_and_weights_from_a_bucket_and_write_their_videos_to_one(
        crd, namespace, bucket, operator_env, tmp_path):
    """Two jobs at once: one reads its image from the bucket, one loads a saved model from
    it; both write their videos there. The status names the objects under the namespace's
    folder of the tenants' prefix, a presigned URL that serves the mp4 and its expiry; the bucket holds exactly
    the three files of each, the result JSON agreeing with the status."""
    from PIL import Image

    from videojob_runtime.output import probe_mp4
    from videojob_runtime.pipelines import build_tiny_pipeline

    client, name = bucket
    image = tmp_path / "cat.png"
    Image.new("RGB", (64, 64), (200, 120, 40)).save(image)
    home = f"videojob-tenants/{namespace}"  # the namespace's folder of the bucket (S3Settings.tenant_prefix)
    client.upload_file(str(image), name, f"{home}/inputs/cat.png")
    saved = tmp_path / "saved"
    build_tiny_pipeline("tiny-cogvideox", "t2v", "float32", seed=3).save_pretrained(saved)
    _upload_tree(client, name, saved, f"{home}/models/cog")
    docs = [
        _job("from-image", model={"name": "tiny-cogvideox-i2v", "dtype": "float32"},
             image=f"s3://{name}/inputs/cat.png", output={"uri": f"s3://{name}/videos"}, parallel=None),
        _job("from-weights", model={"name": "cogvideox-2b", "dtype": "float32",
                                    "source": f"s3://{name}/models/cog"},
             output={"uri": f"s3://{name}/videos"}, parallel=None),
    ]
    with OperatorProcess(crd, namespace, tmp_path / "work", operator_env) as operator:
        for doc in docs:
            create(crd, namespace, doc)
        finished = {d["metadata"]["name"]: wait_phase(crd, namespace, d["metadata"]["name"],
                                                      {"Succeeded", "Failed"}, timeout=300) for d in docs}
        for job, obj in finished.items():
            status = obj["status"]
            assert status["phase"] == "Succeeded", (job, status.get("message"), operator.log()[-3000:])
            out = status["output"]
            prefix = f"s3://{name}/{home}/videos"
            assert out["uri"] == prefix and out["video"] == f"{prefix}/{job}.mp4", out
            assert out["result"] == f"{prefix}/{job}.json" and out["bytes"] > 0
            assert "X-Amz-Signature=" in out["videoUrl"] and out["videoUrlExpires"].endswith("Z"), out
            assert status["measured"]["uploadSeconds"] >= 0
            with urllib.request.urlopen(out["videoUrl"], timeout=30) as answer:  # noqa: S310 - loopback server
                served = answer.read()
            assert len(served) == out["bytes"]
            local = tmp_path / f"{job}.mp4"
            local.write_bytes(served)
            assert probe_mp4(local)["frames"] == 9
            record = json.loads(client.get_object(Bucket=name, Key=f"{home}/videos/{job}.json")["Body"].read())
            assert record["framesDigest"] == out["framesDigest"] and record["output"]["video"] == out["video"]
    assert _keys(client, name, f"{home}/videos/") == sorted(
        f"{home}/videos/{job}{suffix}" for job in finished for suffix in (".json", ".mp4", ".png"))
    assert _unfinished(client, name) == []


@pytest.mark.parametrize("case", ["missing bucket", "missing weights"])
def test_a_bucket_the_job_cannot_use_fails_it_naming_the_field_and_writes_nothing(
        crd, namespace, bucket, operator_env, tmp_path, case):
    """The driver asks the store before anything runs: the job fails with the field and
    the reason in its status, keeps its spec and attempts, and the bucket is as it was."""
    client, name = bucket
    before = _keys(client, name)
    if case == "missing bucket":
        doc = _job("no-bucket", output={"uri": f"s3://{name}-gone/videos"})
        field, says = "spec.output.uri", f"bucket {name}-gone does not exist"
    else:
        doc = _job("no-weights", model={"name": "cogvideox-2b", "dtype": "float32",
                                        "source": f"s3://{name}/models/none"},
                   output={"uri": f"s3://{name}/videos"}, parallel=None)
        field, says = "spec.model.source", "no objects under"
    job = doc["metadata"]["name"]
    with OperatorProcess(crd, namespace, tmp_path / "work", operator_env):
        create(crd, namespace, doc)
        obj = wait_phase(crd, namespace, job, {"Succeeded", "Failed"}, timeout=240)
    status = obj["status"]
    assert status["phase"] == "Failed", status
    assert field in status["message"] and says in status["message"], status["message"]
    assert status["attempts"] and status["attempts"][-1]["result"] == "Failed"
    assert videojob(crd, namespace, job)["spec"]["output"] == doc["spec"]["output"], "the spec is kept"
    assert _keys(client, name) == before, "nothing written to the bucket"
    assert _unfinished(client, name) == []
