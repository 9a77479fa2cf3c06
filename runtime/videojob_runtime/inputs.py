"""Conditioning inputs: the i2v image and ConsisID's face.

Input uris (validated by the API, checked again here): ``local://path`` under
VIDEOJOB_DATA_ROOT, ``pvc://claim/path`` under the claim's mount (both
contained by ``locations.resolve``), or ``https://``. ConsisID needs face
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
Fetching keeps TLS verification on, stops at a size limit while streaming,
and has a connect/read timeout and an overall deadline (``RunSettings``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

from videojob.api.uris import uri_problem
from videojob.settings import RunSettings

from .errors import JobFailure
from .locations import resolve
from .request import JobRequest
from .staging import StagingDir, missing_staged_file, staging_root

CHUNK = 64 * 1024
MAX_REDIRECTS = 5
# Spec field -> (request attribute, file name of the fetched copy).
INPUT_FIELDS = {"spec.image": ("image", "image"), "spec.faceImage": ("face_image", "face-image")}


def resolve_input(uri: str, field: str, local_dir: str | None = None) -> Path:
    """The local file behind an input uri, contained in its root (``locations.resolve``)."""
    if uri.startswith("https://"):
        raise JobFailure(f"{field}: {uri} was not fetched by the job's driver: a rank never downloads an input "
                         "itself (the driver stages https inputs once per job)", stage="inputs", field=field)
    return resolve(uri, "input", field, local_dir=local_dir)


def load_image(uri: str, width: int, height: int, field: str = "spec.image", local_dir: str | None = None):
    from PIL import Image

    path = resolve_input(uri, field, local_dir)
    if not path.is_file():
        raise JobFailure(missing_staged_file(field, path, local_dir)
                         or f"{field}: input image {uri} not found at {path}: check the uri and that the volume "
                            "is mounted", stage="inputs", field=field)
    return Image.open(path).convert("RGB").resize((width, height))


def load_face_embeddings(uri: str, dtype, field: str = "spec.faceImage", local_dir: str | None = None):
    """(id_cond, id_vit_hidden list) for ConsisID from ``<faceImage>.npz`` (contained like the image)."""
    import numpy as np
    import torch

    path = resolve_input(f"{uri}.npz", field, local_dir)
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


class _HttpsOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to a uri the API would accept as an https input
    (never down to http, never to credentials in the url), a few times at most."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, field: str, allow_private: bool = False):
        super().__init__()
        self.field, self.allow_private = field, allow_private

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        problem = uri_problem(newurl, "input") or (None if newurl.startswith("https://") else "is not https://")
        if problem is not None:
            raise JobFailure(f"{self.field}: {req.full_url} redirects to {newurl!r}, refused: it {problem}",
                             stage="inputs", field=self.field)
        if not self.allow_private:
            _refuse_private(newurl, self.field)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _refuse_private(uri: str, field: str) -> None:
    """Refuse a host that resolves to a non-public address (loopback, private,
    link-local such as 169.254.169.254, multicast, reserved): a hostile spec
    must not make the runtime read cluster services or cloud metadata."""
    import ipaddress
    import socket
    import urllib.parse

    parsed = urllib.parse.urlsplit(uri)
    try:
        infos = socket.getaddrinfo(parsed.hostname, parsed.port or 443, proto=socket.IPPROTO_TCP)
    except OSError as exc:
        raise JobFailure(f"{field}: {uri}: host {parsed.hostname} does not resolve ({exc})", stage="inputs",
                         field=field) from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%", 1)[0])
        if not address.is_global or address.is_multicast:
            raise JobFailure(
                f"{field}: {uri}: host {parsed.hostname} is at {address}, not a public address; inputs are "
                "fetched from public hosts only (VIDEOJOB_INPUT_ALLOW_PRIVATE_HOSTS=true allows others)",
                stage="inputs", field=field)


def _too_big(field: str, uri: str, limit: int) -> JobFailure:
    return JobFailure(f"{field}: {uri} is larger than {limit} bytes, the limit for an https input "
                      "(VIDEOJOB_INPUT_MAX_BYTES): use a smaller file or put it on a volume (pvc://)",
                      stage="inputs", field=field, limit=limit)


def fetch_https(uri: str, target: Path, field: str, settings: RunSettings) -> int:
    """Download ``uri`` to ``target`` (a new file); the bytes written. Refuses
    anything the API would, stops at ``settings.input_max_bytes`` while
    streaming, and turns every network failure into a JobFailure naming ``field``."""
    problem = uri_problem(uri, "input")
    if problem is None and not uri.startswith("https://"):
        problem = "is not https:// (only https inputs are fetched)"
    if problem is not None:
        raise JobFailure(f"{field}: {uri!r} {problem}", stage="inputs", field=field)
    if not settings.input_allow_private_hosts:
        _refuse_private(uri, field)
    limit = settings.input_max_bytes
    context = ssl.create_default_context(cafile=settings.input_ca_bundle)
    opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context),
                                         _HttpsOnlyRedirects(field, settings.input_allow_private_hosts))
    deadline = time.monotonic() + settings.input_fetch_deadline_s
    request = urllib.request.Request(uri, headers={"User-Agent": "videojob", "Accept-Encoding": "identity"})
    try:
        with opener.open(request, timeout=settings.input_fetch_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise _too_big(field, uri, limit)
            written = 0
            with open(target, "xb") as out:  # "x": a new file, never through something already there
                while chunk := response.read(CHUNK):
                    written += len(chunk)
                    if written > limit:
                        raise _too_big(field, uri, limit)
                    if time.monotonic() > deadline:
                        raise JobFailure(
                            f"{field}: {uri} took longer than {settings.input_fetch_deadline_s:g} s to download "
                            "(VIDEOJOB_INPUT_FETCH_DEADLINE_S)", stage="inputs", field=field)
                    out.write(chunk)
            return written
    except JobFailure:
        target.unlink(missing_ok=True)
        raise
    except urllib.error.HTTPError as exc:
        target.unlink(missing_ok=True)
        raise JobFailure(f"{field}: {uri} answered {exc.code} {exc.reason}: check the URL", stage="inputs",
                         field=field, status=exc.code) from None
    except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, TLS, a dropped connection
        target.unlink(missing_ok=True)
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError) or isinstance(exc, TimeoutError):
            text = (f"no answer within {settings.input_fetch_timeout_s:g} s (VIDEOJOB_INPUT_FETCH_TIMEOUT_S): "
                    "check that the host serves it")
        elif isinstance(reason, ssl.SSLCertVerificationError):
            text = (f"its certificate could not be verified ({reason.verify_message}): the server must present "
                    "a certificate a known authority signed (VIDEOJOB_INPUT_CA_BUNDLE names extra ones)")
        else:
            text = f"could not be fetched: {reason}"
        raise JobFailure(f"{field}: {uri} {text}", stage="inputs", field=field) from None


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
