"""Where a ``local://`` or ``pvc://`` uri lives on this machine.

``local://path`` is relative to a root set per kind of data (models, inputs,
outputs); ``pvc://claim/path`` is under the claim's mount in the actor pod,
VIDEOJOB_VOLUMES_ROOT/claim. Anything without a scheme is a plain path.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_VOLUMES_ROOT = "/mnt/videojob"


def local_path(uri: str, root_env: str, default_root: str) -> Path:
    if uri.startswith("local://"):
        return Path(os.environ.get(root_env, default_root)) / uri.removeprefix("local://")
    if uri.startswith("pvc://"):
        claim, _, sub = uri.removeprefix("pvc://").partition("/")
        return Path(os.environ.get("VIDEOJOB_VOLUMES_ROOT", DEFAULT_VOLUMES_ROOT)) / claim / sub
    if "://" in uri:
        raise ValueError(f"{uri!r}: unsupported scheme here; use local:// or pvc://")
    return Path(uri)
