"""Symbolic memory profiling of full-size models (no GPU, no allocation).

``memtrack``  LiveBytes: a TorchDispatchMode counting live storage bytes.
``stages``    profile_encode / profile_denoise / profile_decode / component_stats:
              the real diffusers module at full size under FakeTensorMode.
``calibrate`` write_calibration: the table the planner reads.

CLI: ``python -m videojob_runtime.profiling --out operator/videojob/planner/calibration.json``
"""

from .calibrate import write_calibration
from .memtrack import LiveBytes
from .stages import (
    component_stats,
    profile_decode,
    profile_denoise,
    profile_encode,
    profile_image_encode,
    profile_vae_encode,
)

__all__ = [
    "LiveBytes",
    "component_stats",
    "profile_decode",
    "profile_denoise",
    "profile_encode",
    "profile_image_encode",
    "profile_vae_encode",
    "write_calibration",
]
