"""A job's files in object storage: NAME.mp4, NAME.png, then NAME.json.

An s3:// output is written first as a local job would be (``output``:
atomically, into a staging directory on the pod's volume, checkpoints
beside it), then uploaded: the mp4 and the poster, then the result JSON
last, the "done" marker, so a reader that waits for NAME.json never sees a
half-written video. An earlier NAME.json of the same name is removed before
anything is sent. If any upload fails or the job is stopped, every object
this upload put is deleted and any multipart upload is aborted
(``s3store.upload``): nothing partial is left. The result JSON names the
objects (``s3://BUCKET/key``) and, when the admin turns it on
(VIDEOJOB_S3_PRESIGN_EXPIRY_S), a presigned URL of the video and when it
expires.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from videojob.settings import S3Settings

from . import s3store
from .output import WrittenOutput

FIELD = "spec.output.uri"
TYPES = {".mp4": "video/mp4", ".png": "image/png", ".json": "application/json"}


def staging_dir(uri: str, namespace: str | None, name: str, settings: S3Settings | None = None) -> Path:
    """The local directory an s3:// output's files (and checkpoints) are written to before upload:
    one per (namespace, uri, job name), so a resumed attempt finds its checkpoints."""
    settings = settings or S3Settings()
    root = Path(settings.staging_root) if settings.staging_root else s3store.cache_root(settings) / "outputs"
    ident = hashlib.sha256("\0".join((namespace or "", uri, name)).encode()).hexdigest()[:24]
    return root / ident


def check_bucket(uri: str, namespace: str | None, settings: S3Settings | None = None, s3=None) -> s3store.S3Object:
    """The output's location, after asking the store for the bucket: wrong credentials or a missing
    bucket fail here, before anything runs, naming spec.output.uri."""
    settings = settings or S3Settings()
    where = s3store.locate(uri, "output", FIELD, namespace, settings)
    s3 = s3 or s3store.client(settings)
    try:
        s3.head_bucket(Bucket=where.bucket)
    except s3store.store_errors() as exc:
        raise s3store.failure(exc, where, "checking the bucket", of_bucket=True) from None
    return where


def upload_outputs(written: WrittenOutput, uri: str, namespace: str | None, settings: S3Settings | None = None,
                   s3=None, between: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Upload a job's three files (module docstring); the output facts with object uris.
    ``between``: called with each file's name after it is uploaded (a test hook for faults)."""
    settings = settings or S3Settings()
    where = s3store.locate(uri, "output", FIELD, namespace, settings)
    s3 = s3 or s3store.client(settings)
    video, poster, result = (where.child(p.name) for p in (written.video, written.poster, written.result))
    document = json.loads(written.result.read_text())
    facts = dict(document.get("output") or {})
    facts.update(video=video.object_uri, poster=poster.object_uri, result=result.object_uri)
    if settings.presign_expiry_s:
        facts["videoUrl"] = s3.generate_presigned_url("get_object", Params={"Bucket": video.bucket,
                                                                           "Key": video.key},
                                                      ExpiresIn=settings.presign_expiry_s)
        facts["videoUrlExpires"] = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                 time.gmtime(time.time() + settings.presign_expiry_s))
    document["output"] = facts
    written.result.write_text(json.dumps(document, indent=2, default=str) + "\n")
    put: list[s3store.S3Object] = []
    start = time.perf_counter()
    try:
        _remove(s3, result)  # an older NAME.json would otherwise mark a half-sent video done
        for path, target in ((written.video, video), (written.poster, poster), (written.result, result)):
            put.append(target)
            s3store.upload(s3, path, target, settings, TYPES.get(path.suffix, "application/octet-stream"))
            if between is not None:
                between(path.name)
    except BaseException:
        for target in reversed(put):
            with contextlib.suppress(Exception):
                s3store.delete(s3, target)
        raise
    seconds = time.perf_counter() - start
    if _only_outputs(written):  # the staged copies are not kept once the bucket has them
        shutil.rmtree(written.video.parent, ignore_errors=True)
    return {**facts, "bytes": written.video_bytes, "uploadSeconds": round(seconds, 3)}


def _only_outputs(written: WrittenOutput) -> bool:
    """Whether the staging directory holds nothing but this job's files (checkpoints stay otherwise)."""
    names = {p.name for p in written.video.parent.iterdir()}
    return names <= {written.video.name, written.poster.name, written.result.name}


def _remove(s3, target: s3store.S3Object) -> None:
    try:
        s3store.delete(s3, target)
    except s3store.store_errors() as exc:
        raise s3store.failure(exc, target, "removing an earlier result") from None


def upload_failure(uri: str, namespace: str | None, name: str, document: dict[str, Any],
                   settings: S3Settings | None = None, s3=None) -> str:
    """A failed job's NAME.json in the bucket (earlier NAME.mp4 and NAME.png removed first, so nothing
    stale passes for this job's video); the object's uri."""
    settings = settings or S3Settings()
    where = s3store.locate(uri, "output", FIELD, namespace, settings)
    s3 = s3 or s3store.client(settings)
    for suffix in (".mp4", ".png"):
        _remove(s3, where.child(f"{name}{suffix}"))
    target = where.child(f"{name}.json")
    body = (json.dumps(document, indent=2, default=str) + "\n").encode()
    try:
        s3.put_object(Bucket=target.bucket, Key=target.key, Body=body, ContentType="application/json")
    except s3store.store_errors() as exc:
        raise s3store.failure(exc, target, "uploading the failure record") from None
    return target.object_uri
