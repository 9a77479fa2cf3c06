"""Writing a finished job: H.264 mp4, a poster PNG (contact sheet), a result JSON.

Frames arrive as a uint8 array [T, H, W, 3]. libx264 with yuv420p needs even
sizes, so an odd edge is cropped by one pixel (and said so in the result).
Locations: a plain directory (``videojob run --out DIR``), ``local://path``
under VIDEOJOB_OUTPUT_ROOT, or ``pvc://claim/path`` under the claim's mount
(VIDEOJOB_VOLUMES_ROOT/claim); an operator job's in its namespace's directory
there (``locations``: ``<root>/<namespace>/path``).

Atomic: every file is written under a temporary name in the same directory
and renamed into place, the result JSON last (it is the "done" marker); on
any failure the temporary files and any already renamed file of this job
are removed, so a reader never sees a partial job.

Reproducibility: the result JSON records ``framesDigest``, a SHA-256 of the
8-bit frames and their shape, so two runs compare exactly without decoding.
The mp4 bytes are deterministic too, for the same frames on the same x264
build and CPU family: libx264 reads memory it never wrote, so in a worker
the same frames came out as different bytes from one encode to the next;
``mp4encode.py`` encodes in a child process whose allocations are filled
with a fixed byte, with x264's thread count pinned (its output depends on
it). ``asm=0`` (x264's C paths, which could also match across CPU families)
took more than twice as long, gave other bytes than the SIMD paths and was
not repeatable with threads, so it stays off: across machines, compare
``framesDigest``. Each setting is measured by ``benchmarks/mp4_bench.py``
(``benchmarks/results/mp4.json``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from videojob.api.uris import name_problem

from .beneath import Beneath
from .errors import JobFailure
from .locations import ROOTS, resolve

DEFAULT_OUTPUT_ROOT = ROOTS["output"][1]


@dataclass(frozen=True)
class WrittenOutput:
    video: Path
    poster: Path
    result: Path
    video_bytes: int


def resolve_location(uri: str, field: str = "spec.output.uri", namespace: str | None = None) -> Path:
    """The local directory behind an output uri, contained in its root, and in the job's
    namespace's directory there when it has one (checked again here: the API's check may
    have been skipped)."""
    return resolve(uri, "output", field, namespace=namespace)


def _checked_name(name: str) -> str:
    """The job's name, refused unless it is a DNS-1123 subdomain: it becomes NAME.mp4 and friends."""
    problem = name_problem(name)
    if problem is not None:
        raise JobFailure(f"metadata.name {problem}", stage="write", field="metadata.name")
    return name


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float frames in [0, 1] to 8-bit (uint8 frames pass through)."""
    if frames.dtype == np.uint8:
        return frames
    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def frames_digest(frames: np.ndarray) -> str:
    """SHA-256 of 8-bit frames and their shape: equal digests, equal videos."""
    video = np.ascontiguousarray(to_uint8(frames))
    h = hashlib.sha256()
    h.update(("x".join(str(d) for d in video.shape) + ":").encode())
    h.update(video.tobytes())
    return "sha256:" + h.hexdigest()


def even_crop(frames: np.ndarray) -> np.ndarray:
    _, h, w, _ = frames.shape
    return np.ascontiguousarray(frames[:, : h - h % 2, : w - w % 2])


def encode_mp4(frames: np.ndarray, path: Path | None, fps: int, crf: int = 18, *, fd: int | None = None) -> None:
    """H.264, yuv420p, in a child process so the bytes depend only on the frames (docstring);
    into ``path``, or into the open file ``fd`` (a file made beneath a checked directory)."""
    from .mp4encode import encode_in_child

    encode_in_child(even_crop(frames), path, fps, crf, out_fd=fd)


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


def write_outputs(frames: np.ndarray, directory: Path, name: str, fps: int, result: dict[str, Any],
                  between_files=None, root: str | Path | None = None) -> WrittenOutput:
    """Write NAME.mp4, NAME.png and NAME.json into ``directory`` atomically (module
    docstring); the JSON gains the file facts. ``root``: the checked directory ``directory``
    lies in (its namespace's), from which it is opened again now without following links
    (``beneath``); None: ``directory`` is the caller's own. ``between_files``: called after
    the video's temporary file is written (a test hook for faults mid-write)."""
    from PIL import Image

    name = _checked_name(name)
    directory = Path(directory)
    finals = (f"{name}.mp4", f"{name}.png", f"{name}.json")
    video, poster, result_path = (directory / f for f in finals)
    with Beneath.at(directory, root, create=True) as where:
        partials: list[str] = []
        placed: list[str] = []
        try:
            tmp_video, fd = where.new_file(finals[0])
            partials.append(tmp_video)
            try:
                encode_mp4(frames, None, fps, fd=fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if between_files is not None:
                between_files()
            tmp_poster, fd = where.new_file(finals[1])
            partials.append(tmp_poster)
            with os.fdopen(fd, "wb") as f:
                Image.fromarray(contact_sheet(frames)).save(f, format="PNG")
            cropped = frames.shape[1] % 2 or frames.shape[2] % 2
            document = {
                **result,
                "output": {
                    "video": str(video),
                    "poster": str(poster),
                    "bytes": size,
                    "frames": int(frames.shape[0]),
                    "width": int(frames.shape[2] - frames.shape[2] % 2),
                    "height": int(frames.shape[1] - frames.shape[1] % 2),
                    "fps": fps,
                    "croppedToEvenSize": bool(cropped),
                },
            }
            partials.append(where.write_new(finals[2], (json.dumps(document, indent=2, default=str) + "\n").encode()))
            for tmp, final in zip(partials, finals):
                where.replace(tmp, final)
                placed.append(final)
        except BaseException:
            for leftover in (*partials, *placed):
                where.unlink(leftover)
            raise
    return WrittenOutput(video, poster, result_path, size)


def write_failure(directory: Path, name: str, result: dict[str, Any], root: str | Path | None = None) -> Path:
    """The result JSON of a job that failed (no video): written atomically, and
    any earlier output of the same name is removed so nothing stale passes for it.
    ``root``: as for ``write_outputs``."""
    name = _checked_name(name)
    directory = Path(directory)
    with Beneath.at(directory, root, create=True) as where:
        for suffix in (".mp4", ".png"):
            where.unlink(f"{name}{suffix}")
        where.replace(where.write_new(f"{name}.json", (json.dumps(result, indent=2, default=str) + "\n").encode()),
                      f"{name}.json")
    return directory / f"{name}.json"
