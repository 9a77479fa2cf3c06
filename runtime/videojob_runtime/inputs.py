"""Conditioning inputs: the i2v image and ConsisID's face.

Input uris (validated by the API): ``local://path`` under VIDEOJOB_DATA_ROOT,
``pvc://claim/path`` under the claim's mount, ``https://`` fetched, or a plain
path (``videojob run``). ConsisID needs face embeddings from face models
(InsightFace, EVA-CLIP) that are not bundled: they are read precomputed from
``<faceImage>.npz`` (``id_cond`` [1, LFE_id_dim] and ``id_vit_hidden_<i>``, one
per LFE scale), so tests and CPU runs need no face models.
"""

from __future__ import annotations

import tempfile
import urllib.request
from pathlib import Path

from .errors import JobFailure
from .locations import local_path

DEFAULT_DATA_ROOT = "/var/lib/videojob/inputs"


def resolve_input(uri: str) -> Path:
    if uri.startswith(("https://", "http://")):
        target = Path(tempfile.mkdtemp(prefix="videojob-input-")) / Path(uri.split("?", 1)[0]).name
        try:
            urllib.request.urlretrieve(uri, target)  # noqa: S310 - the scheme is checked above
        except OSError as exc:
            raise JobFailure(f"could not fetch {uri}: {exc}", stage="inputs") from None
        return target
    return local_path(uri, "VIDEOJOB_DATA_ROOT", DEFAULT_DATA_ROOT)


def load_image(uri: str, width: int, height: int):
    from PIL import Image

    path = resolve_input(uri)
    if not path.exists():
        raise JobFailure(f"input image {uri} not found at {path}: check the uri and that the volume is mounted",
                         stage="inputs")
    return Image.open(path).convert("RGB").resize((width, height))


def load_face_embeddings(uri: str, dtype):
    """(id_cond, id_vit_hidden list) for ConsisID from ``<faceImage>.npz``."""
    import numpy as np
    import torch

    path = Path(str(resolve_input(uri)) + ".npz")
    if not path.exists():
        raise JobFailure(
            f"ConsisID needs precomputed face embeddings at {path} (id_cond, id_vit_hidden_0..N): "
            "the face models are not bundled; compute them next to the face image",
            stage="inputs",
        )
    data = np.load(path)
    id_cond = torch.from_numpy(data["id_cond"]).to(dtype)
    hidden = [torch.from_numpy(data[k]).to(dtype) for k in sorted(k for k in data.files if k.startswith("id_vit_hidden_"))]
    return id_cond, hidden
