"""s3:// locations: where a uri's objects are, and moving bytes to and from them.

- ``locate``: the bucket and key behind an ``s3://BUCKET/key`` uri, checked
  again with the API's rules; an operator job's key is under its namespace's
  folder inside the admin's fixed tenant prefix
  (``BUCKET/<VIDEOJOB_S3_TENANT_PREFIX>/<namespace>/key``: the same tenant
  rule as local locations, and no namespace named like a folder the admin
  keeps in the bucket reaches it); ``videojob run`` (no namespace) uses the
  key as written. A bucket outside the admin's list (VIDEOJOB_S3_BUCKETS) is
  refused. Credentials never come from a spec: boto3's chain reads them.
- ``upload``: one file, streamed from disk; a file larger than a part goes up
  as a multipart upload, and any failure (or a stop: BaseException) aborts it,
  so no partial object and no orphaned parts are left.
- ``download``: one object into the pod's cache, once: ranks of one pod take
  a file lock, the first downloads (bounded in size, checked against its
  size and, for a single-part ETag, its MD5) and renames into place, the
  rest find it. The cached copy is keyed by the object's ETag, so a changed
  object is fetched again. ``download_prefix``: every object under a prefix
  (a model directory) the same way. A copy found in the cache is used only
  if its bytes match the object's size and ETag (``etags.verified``: the MD5, or
  a multipart ETag for the usual part sizes; each file hashed once per
  process unless it changes), else it is fetched again.

Every failure is a JobFailure naming the spec field, with the fix: wrong
credentials, a missing bucket or object, a store that does not answer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from videojob.api.uris import namespace_problem, uri_problem
from videojob.settings import S3Settings

from .errors import JobFailure
from .etags import verified

CHUNK = 1024 * 1024
STAGES = {"output": "write", "input": "inputs", "source": "load"}
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken",
               "AuthorizationHeaderMalformed", "Forbidden", "403", "401"}
_MISSING_BUCKET = {"NoSuchBucket"}
_MISSING_KEY = {"NoSuchKey", "404", "NotFound"}


@dataclass(frozen=True)
class S3Object:
    """A bucket and a key (for outputs and model sources, a key prefix), and the uri it came from."""

    bucket: str
    key: str
    uri: str
    field: str
    stage: str

    def child(self, name: str) -> "S3Object":
        key = f"{self.key.rstrip('/')}/{name}" if self.key.strip("/") else name
        return S3Object(self.bucket, key, self.uri, self.field, self.stage)

    @property
    def object_uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def locate(uri: str, kind: str, field: str, namespace: str | None = None,
           settings: S3Settings | None = None) -> S3Object:
    """The bucket and key behind ``uri`` (module docstring); a JobFailure naming ``field`` if refused."""
    stage = STAGES[kind]
    problem = uri_problem(uri, kind)  # type: ignore[arg-type]
    if problem is None and not uri.startswith("s3://"):
        problem = "is not an s3:// uri"
    if problem is not None:
        raise JobFailure(f"{field}: {uri!r} {problem}", stage=stage, field=field)
    settings = settings or S3Settings()
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if namespace is not None and not settings.listed_buckets():
        # An operator job is one tenant's; with no list, every namespace could write and
        # delete its keys in every bucket the admin's credentials reach (issue 36).
        raise JobFailure(f"{field}: {uri!r}: s3:// is refused until the cluster admin lists the buckets jobs "
                         "may use (VIDEOJOB_S3_BUCKETS; the chart's runtime.s3.buckets): ask them to, or use "
                         "pvc:// or local://", stage=stage, field=field, bucket=bucket)
    if not settings.bucket_allowed(bucket):
        raise JobFailure(f"{field}: {uri!r}: bucket {bucket} is not one this cluster lets jobs use "
                         f"(VIDEOJOB_S3_BUCKETS: {settings.buckets}): name one of those", stage=stage, field=field,
                         bucket=bucket)
    if namespace is not None:
        problem = namespace_problem(namespace)
        if problem is not None:
            raise JobFailure(f"{field}: {uri!r}: the job's namespace {problem}", stage=stage, field=field)
        # Beside every other namespace inside the admin's fixed prefix (plain names: S3Settings checks it).
        key = f"{settings.tenant_prefix}/{namespace}/{key}"
    return S3Object(bucket, key, uri, field, stage)


def client(settings: S3Settings | None = None):
    """A boto3 S3 client for the admin's store (endpoint, region, addressing), bounded timeouts, few retries."""
    import boto3
    from botocore.config import Config

    settings = settings or S3Settings()
    config = Config(region_name=settings.region, signature_version="s3v4",
                    s3={"addressing_style": settings.addressing_style},
                    connect_timeout=settings.timeout_s, read_timeout=settings.timeout_s,
                    retries={"max_attempts": 3, "mode": "standard"})
    return boto3.session.Session().client("s3", endpoint_url=settings.endpoint_url, config=config)


def failure(exc: BaseException, where: S3Object, doing: str, of_bucket: bool = False) -> JobFailure:
    """A boto3 error as a JobFailure naming the field, saying which fix applies. ``of_bucket``: the call
    asked for the bucket itself (HeadBucket), whose bare 404 means the bucket is missing."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    shown = f"{where.field}: {where.uri}"
    if isinstance(exc, NoCredentialsError):
        text = ("no S3 credentials: the cluster admin sets them (the chart's s3.credentialsSecret, or workload "
                "identity); a spec never carries them")
        return JobFailure(f"{shown}: {doing} failed: {text}", stage=where.stage, field=where.field)
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in _AUTH_CODES:
            text = (f"the store refused the credentials ({code}): the cluster admin's S3 credentials are wrong "
                    f"or may not use bucket {where.bucket}")
        elif code in _MISSING_BUCKET or (of_bucket and code in _MISSING_KEY):
            text = f"bucket {where.bucket} does not exist: create it, or name an existing one"
        elif code in _MISSING_KEY:
            text = f"no object {where.key} in bucket {where.bucket}: check the uri"
        else:
            text = f"the store answered {code}: {error.get('Message') or exc}"
        return JobFailure(f"{shown}: {doing} failed: {text}", stage=where.stage, field=where.field, code=code)
    if isinstance(exc, BotoCoreError):
        return JobFailure(f"{shown}: {doing} failed: the store did not answer ({exc}): check "
                          "VIDEOJOB_S3_ENDPOINT_URL", stage=where.stage, field=where.field)
    return JobFailure(f"{shown}: {doing} failed: {exc}", stage=where.stage, field=where.field)


def store_errors():
    """What boto3 raises for a store's refusal or silence (imported late: boto3 is the runtime's)."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (BotoCoreError, ClientError)


def upload(s3, path: Path, target: S3Object, settings: S3Settings, content_type: str = "application/octet-stream",
           between_parts: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Put ``path`` at ``target`` (module docstring): one PUT up to a part, else multipart, aborted on
    any failure. ``between_parts``: called with each part's number after it is sent (a test hook)."""
    size = path.stat().st_size
    try:
        if size <= settings.part_bytes:
            with open(path, "rb") as body:
                answer = s3.put_object(Bucket=target.bucket, Key=target.key, Body=body, ContentType=content_type)
            return {"uri": target.object_uri, "bytes": size, "etag": answer.get("ETag", "").strip('"'), "parts": 1}
        upload_id = s3.create_multipart_upload(Bucket=target.bucket, Key=target.key,
                                               ContentType=content_type)["UploadId"]
    except store_errors() as exc:
        raise failure(exc, target, "uploading " + target.key.rsplit("/", 1)[-1]) from None
    parts = []
    try:
        with open(path, "rb") as body:
            number = 1
            while True:
                chunk = body.read(settings.part_bytes)
                if not chunk:
                    break
                answer = s3.upload_part(Bucket=target.bucket, Key=target.key, UploadId=upload_id,
                                        PartNumber=number, Body=chunk)
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})
                if between_parts is not None:
                    between_parts(number)
                number += 1
        answer = s3.complete_multipart_upload(Bucket=target.bucket, Key=target.key, UploadId=upload_id,
                                              MultipartUpload={"Parts": parts})
    except BaseException as exc:
        with contextlib.suppress(Exception):
            s3.abort_multipart_upload(Bucket=target.bucket, Key=target.key, UploadId=upload_id)
        if isinstance(exc, store_errors()):
            raise failure(exc, target, "uploading " + target.key.rsplit("/", 1)[-1]) from None
        raise
    return {"uri": target.object_uri, "bytes": size, "etag": answer.get("ETag", "").strip('"'), "parts": len(parts)}


def delete(s3, target: S3Object) -> None:
    """Remove one object, if there (a failed job's earlier files); errors are the caller's to ignore."""
    s3.delete_object(Bucket=target.bucket, Key=target.key)


def cache_root(settings: S3Settings) -> Path:
    """The pod's download cache (VIDEOJOB_S3_CACHE_ROOT; else beside the input staging; else temp)."""
    if settings.cache_root:
        return Path(settings.cache_root)
    staging = os.environ.get("VIDEOJOB_INPUT_STAGING_ROOT")
    return Path(staging) / "s3-cache" if staging else Path(tempfile.gettempdir()) / "videojob-s3-cache"


def _cache_dir(settings: S3Settings, where: S3Object, etag: str) -> Path:
    """One directory per (store, bucket, key, ETag): a name nobody else's object shares."""
    ident = "\0".join((settings.endpoint_url or "aws", settings.region, where.bucket, where.key, etag))
    return cache_root(settings) / hashlib.sha256(ident.encode()).hexdigest()[:32]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (a file beside the cached copy), held by one process of the pod at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def checked_head(s3, where: S3Object, limit: int, limit_setting: str) -> tuple[int, str]:
    """(size, ETag) of one object, refused naming the field when it is missing or larger than ``limit``."""
    try:
        head = s3.head_object(Bucket=where.bucket, Key=where.key)
    except store_errors() as exc:
        raise failure(exc, where, "reading") from None
    size, etag = int(head.get("ContentLength", 0)), str(head.get("ETag", "")).strip('"')
    if size > limit:
        raise JobFailure(f"{where.field}: {where.uri} is {size} bytes, larger than {limit} ({limit_setting}): use "
                         "a smaller file", stage=where.stage, field=where.field, limit=limit)
    return size, etag


def download(s3, where: S3Object, settings: S3Settings, limit: int, limit_setting: str,
             name: str = "object") -> Path:
    """The pod's cached copy of one object (module docstring), fetched by at most one process; a copy
    already there is used only if its bytes are the object's (``etags.verified``)."""
    size, etag = checked_head(s3, where, limit, limit_setting)
    directory = _cache_dir(settings, where, etag)
    target = directory / name
    with _locked(directory.with_suffix(".lock")):
        if verified(target, size, etag, settings.part_bytes, lambda: _store_part_size(s3, where)):
            return target
        directory.mkdir(parents=True, exist_ok=True)
        _fetch(s3, where, directory, target, size, etag, limit, limit_setting)
    return target


def _store_part_size(s3, where: S3Object) -> int | None:
    """Part 1's size as the store tells it (HEAD with partNumber=1), or None where it does not."""
    try:
        head = s3.head_object(Bucket=where.bucket, Key=where.key, PartNumber=1)
    except store_errors():
        return None
    if not head.get("PartsCount"):
        return None  # a store that ignores partNumber answers for the whole object
    return int(head.get("ContentLength") or 0) or None


def _fetch(s3, where: S3Object, directory: Path, target: Path, size: int, etag: str, limit: int,
           limit_setting: str) -> None:
    fd, partial = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".partial")
    digest, written = hashlib.md5(usedforsecurity=False), 0
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                body = s3.get_object(Bucket=where.bucket, Key=where.key, IfMatch=f'"{etag}"')["Body"]
                for chunk in body.iter_chunks(CHUNK):
                    written += len(chunk)
                    if written > limit:
                        raise JobFailure(f"{where.field}: {where.uri} grew past {limit} bytes while downloading "
                                         f"({limit_setting})", stage=where.stage, field=where.field, limit=limit)
                    digest.update(chunk)
                    out.write(chunk)
            except store_errors() as exc:
                raise failure(exc, where, "downloading") from None
        if written != size:
            raise JobFailure(f"{where.field}: {where.uri}: the download ended after {written} of {size} bytes",
                             stage=where.stage, field=where.field)
        if etag and "-" not in etag and len(etag) == 32 and digest.hexdigest() != etag.lower():
            raise JobFailure(f"{where.field}: {where.uri}: the bytes downloaded do not match the object's ETag "
                             f"({etag}): the object changed or was damaged on the way; run the job again",
                             stage=where.stage, field=where.field)
        os.replace(partial, target)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def download_prefix(s3, where: S3Object, settings: S3Settings) -> Path:
    """The pod's cached copy of every object under a key prefix (a model directory), fetched once:
    the listing's keys and ETags name the copy, a marker says it was made whole, and each file's
    bytes are checked against the listing's ETag before use (``etags.verified``); one that fails is
    fetched again."""
    prefix = where.key.rstrip("/") + "/" if where.key.strip("/") else ""
    listing: list[tuple[str, int, str]] = []
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                listing.append((item["Key"][len(prefix):], int(item["Size"]), str(item["ETag"]).strip('"')))
    except store_errors() as exc:
        raise failure(exc, where, "listing") from None
    if not listing:
        raise JobFailure(f"{where.field}: {where.uri}: no objects under {where.bucket}/{prefix}: upload the model "
                         "directory there (model_index.json and its folders)", stage=where.stage, field=where.field)
    total = sum(size for _, size, _ in listing)
    if total > settings.model_max_bytes:
        raise JobFailure(f"{where.field}: {where.uri} holds {total} bytes, more than {settings.model_max_bytes} "
                         "(VIDEOJOB_S3_MODEL_MAX_BYTES)", stage=where.stage, field=where.field)
    for relative, _, _ in listing:
        if uri_problem(f"local://{relative}", "source") is not None or relative.endswith("/"):
            raise JobFailure(f"{where.field}: {where.uri}: object {prefix}{relative} has a name that is not a "
                             "plain relative path; keep the model's files under plain names", stage=where.stage,
                             field=where.field)
    fingerprint = hashlib.sha256(repr(sorted(listing)).encode()).hexdigest()
    directory = _cache_dir(settings, where, fingerprint)
    complete = directory / ".complete"
    lock = directory.with_suffix(".lock")

    def whole() -> bool:  # a hit: the marker, every listed file's bytes the object's (etags.verified), nothing else
        return complete.is_file() and not _unlisted(directory, listing, in_flight=True) and all(
            verified(directory / rel, size, etag, settings.part_bytes,
                     lambda rel=rel: _store_part_size(s3, where.child(rel)))
            for rel, size, etag in listing)

    # Checked outside the lock, so the ranks of a pod hash at once; a file that fails is fetched
    # again under it. A rank that waited while another fetched checks outside the lock too.
    was_complete = complete.is_file()
    if was_complete and whole():
        return directory
    with _locked(lock):
        fetched_meanwhile = not was_complete and complete.is_file()
        if not fetched_meanwhile:
            _fill(s3, where, settings, directory, listing, fingerprint)
            return directory
    if whole():
        return directory
    with _locked(lock):
        _fill(s3, where, settings, directory, listing, fingerprint)
    return directory


def _unlisted(directory: Path, listing: list[tuple[str, int, str]], in_flight: bool) -> list[Path]:
    """Files and links in a model's cache directory that are not in its listing (planted, or left by a
    killed download), links to directories included; ``in_flight``: not another process's download."""
    listed = {relative for relative, _, _ in listing} | {".complete"}
    found = []
    for root, folders, files in os.walk(directory):  # links to folders are listed, never entered
        for name in [*files, *(f for f in folders if os.path.islink(os.path.join(root, f)))]:
            path = Path(root) / name
            if str(path.relative_to(directory)) in listed and not path.is_symlink():
                continue
            if in_flight and name.startswith(".") and name.endswith(".partial"):
                continue
            found.append(path)
    return found


def _fill(s3, where: S3Object, settings: S3Settings, directory: Path, listing: list[tuple[str, int, str]],
          fingerprint: str) -> None:
    """Fetch every listed file whose cached copy is not the object's, then mark the directory whole
    (the caller holds the lock)."""
    complete = directory / ".complete"
    complete.unlink(missing_ok=True)
    for extra in _unlisted(directory, listing, in_flight=False):  # the loader must find only the listing
        extra.unlink()
    for relative, size, etag in listing:
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        child = where.child(relative)
        if verified(target, size, etag, settings.part_bytes, lambda child=child: _store_part_size(s3, child)):
            continue
        _fetch(s3, child, target.parent, target, size, etag, settings.model_max_bytes,
               "VIDEOJOB_S3_MODEL_MAX_BYTES")
    complete.write_text(fingerprint + "\n")
