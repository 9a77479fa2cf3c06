"""Conditioning inputs: the i2v image and ConsisID's face.

Input uris (validated by the API, checked again here): ``local://path`` under
VIDEOJOB_DATA_ROOT, ``pvc://claim/path`` under the claim's mount (both
contained by ``locations.resolve``, in the job's namespace's directory for
an operator job), or ``https://``. ConsisID needs face
embeddings from face models (InsightFace, EVA-CLIP) that are not bundled:
they are read precomputed from ``<faceImage>.npz`` (``id_cond`` [1,
LFE_id_dim] and ``id_vit_hidden_<i>``, one per LFE scale), so tests and CPU
runs need no face models.

https inputs are fetched by the job's driver, once per attempt and never by
a rank (``staged_inputs``): n ranks would be n downloads of a file that could
differ between them. The copies go into the attempt's own directory under
VIDEOJOB_INPUT_STAGING_ROOT (``staging``: on the volume every Ray pod shares),
removed when the attempt ends, however it ends; the request the ranks get
names the copies as plain paths inside that directory (``local_inputs_dir``),
and a rank that cannot see them says which setting is wrong.
Fetching (``fetch``) keeps TLS verification on, connects only to addresses
that passed the public-address check, stops at a size limit while streaming,
and has a connect/read timeout and an overall deadline that a server
dripping bytes cannot stretch (``RunSettings``); messages show input uris
without their query (``redact_url``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Iterator

from videojob.redaction import redact_url
from videojob.settings import RunSettings

from .errors import JobFailure
from .fetch import fetch_https  # noqa: F401 - where callers have always found it
from .locations import resolve
from .request import JobRequest
from .staging import StagingDir, missing_staged_file, staging_root

# Spec field -> (request attribute, file name of the fetched copy).
INPUT_FIELDS = {"spec.image": ("image", "image"), "spec.faceImage": ("face_image", "face-image")}


def resolve_input(uri: str, field: str, local_dir: str | None = None, namespace: str | None = None) -> Path:
    """The local file behind an input uri, contained in its root, and in the job's namespace's
    directory there when it has one (``locations.resolve``)."""
    if uri.startswith("s3://"):  # the pod's cached copy, downloaded once (s3store.download)
        return s3_input(uri, field, namespace)
    if uri.startswith("https://"):
        raise JobFailure(f"{field}: {redact_url(uri)} was not fetched by the job's driver: a rank never downloads "
                         "an input itself (the driver stages https inputs once per job)", stage="inputs", field=field)
    return resolve(uri, "input", field, local_dir=local_dir, namespace=namespace)


def s3_input(uri: str, field: str, namespace: str | None = None) -> Path:
    """An s3:// input's copy in the pod's cache: one download per pod (ranks wait on a lock), its size
    bounded like an https input's (VIDEOJOB_INPUT_MAX_BYTES), its bytes checked against the ETag."""
    from videojob.settings import S3Settings

    from . import s3store

    settings = S3Settings()
    where = s3store.locate(uri, "input", field, namespace, settings)
    return s3store.download(s3store.client(settings), where, settings, RunSettings().input_max_bytes,
                            "VIDEOJOB_INPUT_MAX_BYTES", name=uri.rsplit("/", 1)[-1] or "object")


def load_image(uri: str, width: int, height: int, field: str = "spec.image", local_dir: str | None = None,
               namespace: str | None = None):
    from PIL import Image

    path = resolve_input(uri, field, local_dir, namespace)
    if not path.is_file():
        raise JobFailure(missing_staged_file(field, path, local_dir)
                         or f"{field}: input image {uri} not found at {path}: check the uri and that the volume "
                            "is mounted", stage="inputs", field=field)
    return Image.open(path).convert("RGB").resize((width, height))


def load_face_embeddings(uri: str, dtype, field: str = "spec.faceImage", local_dir: str | None = None,
                         namespace: str | None = None):
    """(id_cond, id_vit_hidden list) for ConsisID from ``<faceImage>.npz`` (contained like the image)."""
    import numpy as np
    import torch

    path = resolve_input(f"{uri}.npz", field, local_dir, namespace)
    if not path.is_file():
        raise JobFailure(
            missing_staged_file(field, path, local_dir) or
            f"{field}: ConsisID needs precomputed face embeddings at {path} (id_cond, id_vit_hidden_0..N): "
            "the face models are not bundled; compute them next to the face image",
            stage="inputs", field=field,
        )
    _check_npz_size(path, field)
    data = np.load(path)  # allow_pickle stays False: an .npz from a user holds arrays only
    id_cond = torch.from_numpy(data["id_cond"]).to(dtype)
    hidden = [torch.from_numpy(data[k]).to(dtype) for k in sorted(k for k in data.files if k.startswith("id_vit_hidden_"))]
    return id_cond, hidden


# Face embeddings are a few KiB (id_cond [1, 1280], a few hidden states);
# anything that decompresses past this is not one (an .npz is a zip).
MAX_EMBEDDING_BYTES = 256 * 2**20


def _check_npz_size(path: Path, field: str) -> None:
    """Refuse an .npz whose arrays would decompress past MAX_EMBEDDING_BYTES (a zip bomb)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            total = sum(info.file_size for info in archive.infolist())
    except zipfile.BadZipFile:
        raise JobFailure(f"{field}: {path.name} is not an .npz archive of the face embeddings", stage="inputs",
                         field=field) from None
    if total > MAX_EMBEDDING_BYTES:
        raise JobFailure(f"{field}: {path.name} would unpack to {total} bytes, more than face embeddings "
                         f"take (limit {MAX_EMBEDDING_BYTES})", stage="inputs", field=field)


def _https_inputs(request: JobRequest) -> list[tuple[str, str, str, str]]:
    """(field, attribute, uri, copy name) of every https input the request names."""
    found = []
    for field, (attribute, name) in INPUT_FIELDS.items():
        uri = getattr(request, attribute)
        if uri and uri.startswith("https://"):
            found.append((field, attribute, uri, name))
    return found


@contextlib.contextmanager
def staged_inputs(request: JobRequest, settings: RunSettings | None = None, tag: str | None = None,
                  on_directory: Callable[[str | None], None] | None = None) -> Iterator[JobRequest]:
    """The request the ranks get: its https inputs fetched once, into this
    attempt's own directory under the staging root (``staging.StagingDir``,
    named after ``tag``), removed on the way out (success or not), and named
    there as local copies. ``on_directory`` hears the directory (then None),
    for a stop that cannot run this function's ``finally``. A request without
    https inputs passes as it is."""
    remote = _https_inputs(request)
    if not remote:
        yield request
        return
    settings = settings or RunSettings()
    staging = StagingDir(staging_root(settings.input_staging_root), tag or request.job_id,
                         settings.input_staging_stale_s)
    with staging as directory:
        if on_directory is not None:
            on_directory(str(directory))
        try:
            copies: dict[str, str] = {}
            for field, attribute, uri, name in remote:
                target = directory / name
                fetch_https(uri, target, field, settings)
                if attribute == "face_image":  # ConsisID's embeddings live beside the face: <faceImage>.npz
                    base, sep, query = uri.partition("?")
                    fetch_https(f"{base}.npz{sep}{query}", directory / f"{name}.npz", field, settings)
                copies[attribute] = str(target)
            yield dataclasses.replace(request, local_inputs_dir=str(directory), **copies)
        finally:
            if on_directory is not None:
                on_directory(None)
