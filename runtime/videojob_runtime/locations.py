"""Where a ``local://`` or ``pvc://`` uri lives on this machine, contained.

``local://path`` is relative to a root set per kind of data (outputs, inputs,
model sources); ``pvc://claim/path`` is under the claim's mount in the actor
pod, VIDEOJOB_VOLUMES_ROOT/claim.

A spec is written by someone the runtime must not trust, and a request may
reach a rank without passing the API server, so ``resolve`` checks the uri
again with the API's own rules (``videojob.api.uris.uri_problem``), then
follows symbolic links (``Path.resolve``: a missing tail is fine, outputs are
created later) and refuses a result outside the root: a link inside a volume
that points out of it is as hostile as ``..``. Every refusal is a JobFailure
naming the spec field.

A plain path (no scheme) is never a spec's: specs cannot carry one. It is
accepted only from a caller that names the local directory it must lie in
(``local_dir``: `videojob run`'s own files, the driver's copies of fetched
inputs, a test's files), and it is contained there the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from videojob.api.uris import uri_problem

from .errors import JobFailure

Kind = Literal["output", "input", "source"]
DEFAULT_VOLUMES_ROOT = "/mnt/videojob"
# Per kind: the environment variable naming the local:// root, its default,
# and the job stage a refusal is reported in.
ROOTS: dict[str, tuple[str, str, str]] = {
    "output": ("VIDEOJOB_OUTPUT_ROOT", "/var/lib/videojob/outputs", "write"),
    "input": ("VIDEOJOB_DATA_ROOT", "/var/lib/videojob/inputs", "inputs"),
    "source": ("VIDEOJOB_MODEL_ROOT", "/var/lib/videojob/models", "load"),
}


def local_root(kind: Kind) -> Path:
    """The directory local:// uris of this kind resolve under (its env var, else the default)."""
    env, default, _ = ROOTS[kind]
    return Path(os.environ.get(env) or default)


def volumes_root() -> Path:
    return Path(os.environ.get("VIDEOJOB_VOLUMES_ROOT") or DEFAULT_VOLUMES_ROOT)


def check_uri(uri: str, kind: Kind, field: str) -> str:
    """``uri`` if the API's rules accept it as a ``kind`` uri, else a JobFailure naming ``field``
    (for the schemes that never become a path here, hf:// and https://, this is their whole check)."""
    problem = uri_problem(uri, kind)
    if problem is not None:
        raise JobFailure(f"{field}: {uri!r} {problem}", stage=ROOTS[kind][2], field=field)
    return uri


def resolve(uri: str, kind: Kind, field: str, *, root: str | Path | None = None,
            local_dir: str | Path | None = None) -> Path:
    """The absolute, symlink-free path behind ``uri``, inside its root.

    ``field``: the spec field the uri came from (every refusal names it).
    ``root``: the local:// root when the caller has its own setting (default:
    the kind's environment variable). ``local_dir``: only for callers that
    pass plain paths on purpose (module docstring); without it a uri with no
    scheme is refused."""
    stage = ROOTS[kind][2]
    if "://" not in uri:
        if local_dir is None:
            raise JobFailure(f"{field}: {uri!r} has no scheme: write pvc://CLAIM/path or local://path",
                             stage=stage, field=field)
        return _contained(Path(local_dir), uri, uri, field, stage)
    check_uri(uri, kind, field)
    if uri.startswith("local://"):
        return _contained(Path(root) if root is not None else local_root(kind), uri.removeprefix("local://"),
                          uri, field, stage)
    if uri.startswith("pvc://"):
        claim, _, sub = uri.removeprefix("pvc://").partition("/")
        return _contained(volumes_root() / claim, sub, uri, field, stage)
    scheme = uri.split("://", 1)[0]
    raise JobFailure(f"{field}: {uri!r} is not a file on this machine ({scheme}:// is resolved elsewhere: "
                     "hf:// from the hub cache, https:// fetched by the job's driver)", stage=stage, field=field)


def _contained(base: Path, sub: str | Path, uri: str, field: str, stage: str) -> Path:
    """``base/sub`` with links followed, refused unless it is still under ``base`` (links followed too)."""
    try:
        top = base.resolve()
        target = (top / sub).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symbolic link loop
        raise JobFailure(f"{field}: {uri!r} cannot be resolved ({exc}): check the links under {base}",
                         stage=stage, field=field) from None
    if target != top and not target.is_relative_to(top):
        raise JobFailure(
            f"{field}: {uri!r} resolves to {target}, outside its root {top}: a symbolic link on the way points "
            "out of it; put the file itself under the root (or link only to places inside it)",
            stage=stage, field=field, resolved=str(target), root=str(top))
    return target
