"""URI types for model sources, input images and output locations.

Schemes:
  pvc://CLAIM/sub/path   a PersistentVolumeClaim mounted into the actors
  local://sub/path       relative to the runtime's root (VIDEOJOB_DATA_ROOT
                         for inputs, VIDEOJOB_OUTPUT_ROOT for outputs)
  hf://ORG/NAME          a hub id resolved from an offline cache (sources only)
  https://...            fetched by the runtime (input images only)
Paths never climb out of their root: no ``..`` segments, no leading ``/``.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field

from .common import Cel

_DOTDOT = r"(^|/)[.][.](/|$)"
_ABSOLUTE = r"^[a-z]+:///"
_PVC = r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?$"
_HF = r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._-]+)?$"
_HAS_PATH = r"^[a-z]+://[^/].*$"


def _schemes_rule(schemes: tuple[str, ...]) -> Cel:
    prefixes = tuple(f"{s}://" for s in schemes)
    listed = ", ".join(prefixes)
    return Cel(
        rule=" || ".join(f"self.startsWith('{p}')" for p in prefixes),
        message=f"must start with one of: {listed}",
        check=lambda v: v.startswith(prefixes),
    )


_NO_DOTDOT = Cel(
    rule=f"!self.matches('{_DOTDOT}')",
    message="must not contain '..' path segments (paths stay inside their root)",
    check=lambda v: re.search(_DOTDOT, v) is None,
)
_NO_ABSOLUTE = Cel(
    rule=f"!self.matches('{_ABSOLUTE}')",
    message="must not be an absolute path: write scheme://name/path with no leading '/'",
    check=lambda v: re.search(_ABSOLUTE, v) is None,
)
_HAS_LOCATION = Cel(
    rule=f"self.matches('{_HAS_PATH}')",
    message="must name a location after the scheme, e.g. local://videos/my-job",
    check=lambda v: re.match(_HAS_PATH, v) is not None,
)
_PVC_NAME = Cel(
    rule=f"!self.startsWith('pvc://') || self.matches('{_PVC}')",
    message="pvc:// must be followed by a claim name (lower-case letters, digits, '-'), e.g. pvc://videos/my-job",
    check=lambda v: not v.startswith("pvc://") or re.match(_PVC, v) is not None,
)
_HF_ID = Cel(
    rule=f"!self.startsWith('hf://') || self.matches('{_HF}')",
    message="hf:// must be followed by ORG/NAME[@REVISION], e.g. hf://THUDM/CogVideoX-5b",
    check=lambda v: not v.startswith("hf://") or re.match(_HF, v) is not None,
)

_URI_FIELD = Field(min_length=1, max_length=1024)

OutputUri = Annotated[
    str,
    _URI_FIELD,
    _schemes_rule(("pvc", "local")),
    _HAS_LOCATION,
    _NO_ABSOLUTE,
    _NO_DOTDOT,
    _PVC_NAME,
]
InputUri = Annotated[
    str,
    _URI_FIELD,
    _schemes_rule(("pvc", "local", "https", "http")),
    _HAS_LOCATION,
    _NO_ABSOLUTE,
    _NO_DOTDOT,
    _PVC_NAME,
]
SourceUri = Annotated[
    str,
    _URI_FIELD,
    _schemes_rule(("hf", "pvc", "local")),
    _HAS_LOCATION,
    _NO_ABSOLUTE,
    _NO_DOTDOT,
    _PVC_NAME,
    _HF_ID,
]
