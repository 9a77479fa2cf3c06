"""H.264 encoding in a child process, so the same frames always give the same mp4.

Measured (``benchmarks/mp4_bench.py``): libx264 (or FFmpeg's wrapper around
it) reads memory it never wrote, so in a long-lived worker the same frames
came out as different bytes from one encode to the next, depending on what
the heap held. A child process started with ``MALLOC_PERTURB_`` gets every
allocation filled with one fixed byte, so what is read is always the same;
the thread count is pinned because x264's output depends on it (its default
follows the machine's cores). The child costs a Python start and an import
of PyAV, well under a second.

    python -m videojob_runtime.mp4encode OUT.mp4 T H W FPS CRF THREADS [X264_PARAMS] < raw rgb24 bytes
"""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np

# Fixed fill byte for the child's allocations (any constant works; it must not change).
MALLOC_PERTURB = "165"
# Pinned: x264's bytes depend on its thread count.
X264_THREADS = 4


def encode_frames(frames: np.ndarray, path: Path, fps: int, crf: int, threads: int | None,
                  x264_params: str = "") -> None:
    """Encode in this process (the child's side; benchmarks also call it in-process)."""
    import av

    _, height, width, _ = frames.shape
    with av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(crf), "preset": "medium", **({"x264-params": x264_params} if x264_params else {})}
        if threads is not None:
            stream.codec_context.thread_count = threads
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def encode_in_child(frames: np.ndarray, path: Path | None, fps: int, crf: int = 18, threads: int = X264_THREADS,
                    x264_params: str = "", timeout_s: float = 900.0, out_fd: int | None = None) -> None:
    """Encode ``frames`` (uint8 [T, H, W, 3], even H and W) to ``path`` in a child process, or into
    the open file ``out_fd`` (passed to the child, which opens its own /proc/self/fd/N: the same
    file, whatever its name or its directory's path have become since)."""
    if (path is None) == (out_fd is None):
        raise ValueError("encode_in_child: give path or out_fd, not both")
    frames = np.ascontiguousarray(frames, dtype=np.uint8)
    t, h, w, _ = frames.shape
    target = str(path) if out_fd is None else f"/proc/self/fd/{out_fd}"
    argv = [sys.executable, "-m", "videojob_runtime.mp4encode", target, str(t), str(h), str(w), str(fps),
            str(crf), str(threads), x264_params]
    env = {**os.environ, "MALLOC_PERTURB_": MALLOC_PERTURB}
    result = subprocess.run(argv, input=frames.tobytes(), capture_output=True, env=env, timeout=timeout_s,
                            pass_fds=() if out_fd is None else (out_fd,))
    if result.returncode != 0:
        tail = result.stderr.decode(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"mp4 encoder exited with {result.returncode}: {' | '.join(tail)}")


def main(argv: list[str]) -> int:
    out, t, h, w, fps, crf, threads, *rest = argv
    shape = (int(t), int(h), int(w), 3)
    data = sys.stdin.buffer.read()
    if len(data) != int(np.prod(shape)):
        print(f"expected {int(np.prod(shape))} bytes of rgb24 frames {shape}, got {len(data)}", file=sys.stderr)
        return 2
    frames = np.frombuffer(data, dtype=np.uint8).reshape(shape)
    encode_frames(frames, Path(out), int(fps), int(crf), int(threads), rest[0] if rest else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
