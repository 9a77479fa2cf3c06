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

Tenants (``namespace``: an operator job's namespace, which the driver puts
in every rank's request): a job's locations resolve inside its namespace's
own directory, ``<kind root>/<namespace>/path`` for ``local://path`` and
``VIDEOJOB_VOLUMES_ROOT/claim/<namespace>/path`` for ``pvc://claim/path``, so
``local://B/x`` from namespace A is A's ``<root>/A/B/x``; links are followed
and the result must still be inside that directory (a link from A's tree to
B's is refused, so is a namespace directory that is itself a link). A
namespace directory that would hold another root (a namespace named like the
chart's ``outputs/``, the staging or hub cache directory, a shared model
location) is refused, as the admin's layout would otherwise let it reach
other tenants. The one exception is read-only: ``spec.model.source`` inside
a location the admin lists in VIDEOJOB_SHARED_MODEL_ROOTS (comma-separated
``pvc://claim[/path]`` or ``local://path``) resolves there for every
namespace; no other field resolves into one. ``videojob run`` passes no
namespace: one user on one machine, the roots as they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from videojob.api.uris import namespace_problem, uri_problem
from videojob.redaction import redact_url

from .errors import JobFailure

Kind = Literal["output", "input", "source"]
DEFAULT_VOLUMES_ROOT = "/mnt/videojob"
SHARED_MODEL_ROOTS = "VIDEOJOB_SHARED_MODEL_ROOTS"
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
        raise JobFailure(f"{field}: {redact_url(uri)!r} {problem}", stage=ROOTS[kind][2], field=field)
    return uri


def resolve(uri: str, kind: Kind, field: str, *, root: str | Path | None = None,
            local_dir: str | Path | None = None, namespace: str | None = None) -> Path:
    """The absolute, symlink-free path behind ``uri``, inside its root (``resolve_in_root``)."""
    return resolve_in_root(uri, kind, field, root=root, local_dir=local_dir, namespace=namespace)[0]


def resolve_in_root(uri: str, kind: Kind, field: str, *, root: str | Path | None = None,
                    local_dir: str | Path | None = None, namespace: str | None = None) -> tuple[Path, Path]:
    """(the absolute, symlink-free path behind ``uri``, the root it was contained in: the admin's
    directory a writer opens it again from without following links, ``beneath``).

    ``field``: the spec field the uri came from (every refusal names it).
    ``root``: the local:// root when the caller has its own setting (default:
    the kind's environment variable). ``local_dir``: only for callers that
    pass plain paths on purpose (module docstring); without it a uri with no
    scheme is refused. ``namespace``: the job's tenant (module docstring);
    None (`videojob run`): the roots themselves."""
    stage = ROOTS[kind][2]
    if "://" not in uri:
        if local_dir is None:
            raise JobFailure(f"{field}: {uri!r} has no scheme: write pvc://CLAIM/path or local://path",
                             stage=stage, field=field)
        return _contained(Path(local_dir), uri, uri, field, stage)
    check_uri(uri, kind, field)
    if not uri.startswith(("local://", "pvc://")):
        scheme = uri.split("://", 1)[0]
        raise JobFailure(f"{field}: {uri!r} is not a file on this machine ({scheme}:// is resolved elsewhere: "
                         "hf:// from the hub cache, https:// fetched by the job's driver, s3:// downloaded into the pod's "
                         "cache or uploaded from its staging directory)", stage=stage, field=field)
    if namespace is None:
        return _contained(*_base(uri, kind, root), uri, field, stage)
    problem = namespace_problem(namespace)
    if problem is not None:
        raise JobFailure(f"{field}: {uri!r}: the job's namespace {problem}", stage=stage, field=field)
    shared = _shared_root(uri) if kind == "source" else None
    if shared is not None:
        return _contained(_contained(*_base(shared, kind, root), shared, SHARED_MODEL_ROOTS, stage)[0],
                          uri[len(shared):].lstrip("/"), uri, field, stage)
    base, sub = _base(uri, kind, root)
    return _in_namespace(base, namespace, sub, uri, field, stage, kind, root)


def _base(uri: str, kind: Kind, root: str | Path | None) -> tuple[Path, str]:
    """(the directory a local:// or pvc:// uri is relative to, the rest of its path), no namespace."""
    if uri.startswith("local://"):
        return Path(root) if root is not None else local_root(kind), uri.removeprefix("local://")
    claim, _, sub = uri.removeprefix("pvc://").partition("/")
    return volumes_root() / claim, sub


def shared_model_roots() -> list[str]:
    """The admin's shared read-only model locations (VIDEOJOB_SHARED_MODEL_ROOTS), without a trailing '/'."""
    found = []
    for item in (os.environ.get(SHARED_MODEL_ROOTS) or "").split(","):
        item = item.strip()
        problem = uri_problem(item, "source") if item else None
        if problem is None and item and not item.startswith(("pvc://", "local://")):
            problem = "is not a pvc:// or local:// location"
        if problem is not None:
            raise JobFailure(f"{SHARED_MODEL_ROOTS}: {item!r} {problem}: list pvc://CLAIM[/path] or local://path "
                             "locations, comma-separated (the chart's runtime environment sets it)", stage="load",
                             field=SHARED_MODEL_ROOTS)
        if item:
            found.append(item.rstrip("/"))
    return found


def _shared_root(uri: str) -> str | None:
    """The shared model location ``uri`` is in (whole path segments), or None."""
    for shared in shared_model_roots():
        if uri == shared or uri.startswith(shared + "/"):
            return shared
    return None


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))


def _other_roots(kind: Kind, root: str | Path | None) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """(roots that hold namespaces' directories, directories no tenant may write into), resolved, each with
    the setting that names it: what a namespace's own directory must not contain (the second: nor lie in)."""
    tenants = [(_resolved(Path(root) if root is not None and k == kind else local_root(k)), env)
               for k, (env, _, _) in ROOTS.items()]
    tenants.append((_resolved(volumes_root()), "VIDEOJOB_VOLUMES_ROOT"))
    closed = [(_resolved(_base(s, "source", None)[0] / _base(s, "source", None)[1]), f"{SHARED_MODEL_ROOTS} {s}")
              for s in shared_model_roots()]
    if os.environ.get("VIDEOJOB_INPUT_STAGING_ROOT"):
        closed.append((_resolved(Path(os.environ["VIDEOJOB_INPUT_STAGING_ROOT"])), "VIDEOJOB_INPUT_STAGING_ROOT"))
    # The pod's S3 download cache and upload staging (every job's): a namespace named like their
    # directory (s3-cache, s3-staging, outputs) must not resolve into them (issue 36).
    from videojob.settings import S3Settings

    from . import s3store

    s3 = S3Settings()
    cache = s3store.cache_root(s3)
    closed.append((_resolved(cache), "VIDEOJOB_S3_CACHE_ROOT"))
    closed.append((_resolved(Path(s3.staging_root) if s3.staging_root else cache / "outputs"),
                   "VIDEOJOB_S3_STAGING_ROOT"))
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME"):  # the hub cache every job's hf:// reads
        hub = os.environ.get("HF_HUB_CACHE") or str(Path(os.environ["HF_HOME"]) / "hub")
        closed.append((_resolved(Path(hub)), "HF_HUB_CACHE" if os.environ.get("HF_HUB_CACHE") else "HF_HOME/hub"))
    return tenants, closed


def _in_namespace(base: Path, namespace: str, sub: str, uri: str, field: str, stage: str, kind: Kind,
                  root: str | Path | None) -> tuple[Path, Path]:
    """``base/<namespace>/sub`` with links followed, refused unless still under ``base/<namespace>``
    (that directory itself must not be a link) and unless that directory is clear of other roots."""
    try:
        top = base.resolve()
        home = top / namespace
        target = (home / sub).resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symbolic link loop
        raise JobFailure(f"{field}: {uri!r} cannot be resolved ({exc}): check the links under {base}/{namespace}",
                         stage=stage, field=field) from None
    fix = "ask the cluster admin to move that root out of the namespaces' directories"
    tenants, closed = _other_roots(kind, root)
    if uri.startswith("local://") and top == tenants[-1][0]:
        raise JobFailure(f"{field}: {uri!r}: the local:// root {top} is VIDEOJOB_VOLUMES_ROOT, so namespace "
                         f"{namespace}'s directory would be the claim {namespace}'s mount: {fix}",
                         stage=stage, field=field, root=str(top))
    for other, setting in tenants + closed:
        if other.is_relative_to(home) or ((other, setting) in closed and home.is_relative_to(other)):
            what = "is the cluster's shared read-only model location" if setting.startswith(SHARED_MODEL_ROOTS) \
                else "holds another root"
            raise JobFailure(
                f"{field}: {uri!r}: namespace {namespace}'s directory {home} {what} ({setting}: {other}); no job "
                f"writes or reads there through it: "
                + ("name it in spec.model.source only" if setting.startswith(SHARED_MODEL_ROOTS) else fix),
                stage=stage, field=field, root=str(home))
    if not target.is_relative_to(home):
        raise JobFailure(
            f"{field}: {uri!r} resolves to {target}, outside namespace {namespace}'s directory {home}: a symbolic "
            "link on the way points out of it (another namespace's files are never reachable); put the file "
            "itself under that directory", stage=stage, field=field, resolved=str(target), root=str(home))
    return target, top


def _contained(base: Path, sub: str | Path, uri: str, field: str, stage: str) -> tuple[Path, Path]:
    """(``base/sub`` with links followed, refused unless it is still under ``base`` (links followed
    too); ``base`` resolved)."""
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
    return target, top
