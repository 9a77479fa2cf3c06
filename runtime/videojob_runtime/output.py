"""Writing a finished job: H.264 mp4, a poster PNG (contact sheet), a result JSON.

Frames arrive as a uint8 array [T, H, W, 3]. libx264 with yuv420p needs even
sizes, so an odd edge is cropped by one pixel (and said so in the result).
Locations: a plain directory (``videojob run --out DIR``), ``local://path``
under VIDEOJOB_OUTPUT_ROOT, or ``pvc://claim/path`` under the claim's mount
(VIDEOJOB_VOLUMES_ROOT/claim).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from .locations import local_path

DEFAULT_OUTPUT_ROOT = "/var/lib/videojob/outputs"


@dataclass(frozen=True)
class WrittenOutput:
    video: Path
    poster: Path
    result: Path
    video_bytes: int


def resolve_location(uri: str) -> Path:
    """The local directory behind an output uri (already validated by the API)."""
    return local_path(uri, "VIDEOJOB_OUTPUT_ROOT", DEFAULT_OUTPUT_ROOT)


def even_crop(frames: np.ndarray) -> np.ndarray:
    _, h, w, _ = frames.shape
    return np.ascontiguousarray(frames[:, : h - h % 2, : w - w % 2])


def encode_mp4(frames: np.ndarray, path: Path, fps: int, crf: int = 18) -> None:
    import av

    frames = even_crop(frames)
    _, height, width, _ = frames.shape
    with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf), "preset": "medium"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def probe_mp4(path: Path) -> dict[str, Any]:
    """Codec, size, fps and decoded frame count of an mp4 (used by tests and the summary)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        decoded = sum(1 for _ in container.decode(stream))
        return {
            "codec": stream.codec_context.name,
            "width": stream.codec_context.width,
            "height": stream.codec_context.height,
            "fps": float(stream.average_rate),
            "frames": decoded,
        }


def contact_sheet(frames: np.ndarray, columns: int = 4, max_tiles: int = 16) -> np.ndarray:
    """Up to ``max_tiles`` evenly spaced frames in a grid, as one RGB image."""
    count = min(len(frames), max_tiles)
    picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
    columns = min(columns, count)
    rows = math.ceil(count / columns)
    _, h, w, c = frames.shape
    sheet = np.zeros((rows * h, columns * w, c), dtype=np.uint8)
    for i, index in enumerate(picks):
        r, col = divmod(i, columns)
        sheet[r * h:(r + 1) * h, col * w:(col + 1) * w] = frames[index]
    return sheet


def write_outputs(frames: np.ndarray, directory: Path, name: str, fps: int, result: dict[str, Any]) -> WrittenOutput:
    """Write NAME.mp4, NAME.png and NAME.json into ``directory``; the JSON gains the file facts."""
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    video, poster, result_path = directory / f"{name}.mp4", directory / f"{name}.png", directory / f"{name}.json"
    tmp_video = video.with_suffix(".mp4.partial")
    encode_mp4(frames, tmp_video, fps)
    tmp_video.replace(video)  # never leave a half-written mp4 under the final name
    Image.fromarray(contact_sheet(frames)).save(poster)
    cropped = frames.shape[1] % 2 or frames.shape[2] % 2
    result = {
        **result,
        "output": {
            "video": str(video),
            "poster": str(poster),
            "bytes": video.stat().st_size,
            "frames": int(frames.shape[0]),
            "width": int(frames.shape[2] - frames.shape[2] % 2),
            "height": int(frames.shape[1] - frames.shape[1] % 2),
            "fps": fps,
            "croppedToEvenSize": bool(cropped),
        },
    }
    result_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return WrittenOutput(video, poster, result_path, video.stat().st_size)
