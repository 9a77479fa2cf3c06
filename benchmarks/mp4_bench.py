"""mp4 writer: are the bytes a function of the frames, and what does that cost?

Encodes the same frames several times per setting, with a tiny RankWorker
job before each encode (a worker encodes right after its job ran, with
whatever its heap then holds), and reports the median seconds and how many
distinct outputs came out. Two videos: 49 x 720x480 (a smooth gradient with
noise, the size of a CogVideoX video) and 9 x 64x64 (a tiny test video).
Settings: in the worker's process with x264's default or one thread; in a
child process with MALLOC_PERTURB_ (what output.py does) with 4 threads,
with one, with x264's default; and x264's C paths (``asm=0``) in a child.
Writes benchmarks/results/mp4.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from machine import write_result  # noqa: E402
from videojob_runtime.mp4encode import X264_THREADS, encode_frames, encode_in_child  # noqa: E402
from videojob_runtime.worker import JobRequest, RankWorker  # noqa: E402

RUNS = 5
JOB = JobRequest(job_id="mp4-bench", model_id="tiny-cogvideox", task="t2v", prompt="a tiny video", width=64,
                 height=64, frames=9, fps=8, steps=2, guidance=6.0, seed=1, track_memory=False)


def videos() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    base = np.linspace(0, 255, 480 * 720 * 3).reshape(480, 720, 3)
    large = np.stack([((base + 7 * i + rng.normal(0, 20, base.shape)) % 256).astype("uint8") for i in range(49)])
    small = (rng.random((9, 64, 64, 3)) * 255).astype("uint8")
    return {"49x720x480": large, "9x64x64": small}


def main() -> int:
    worker = RankWorker(0, 1)
    settings = [
        ("in the worker process, x264 default threads", lambda v, p: encode_frames(v, p, 8, 18, None)),
        ("in the worker process, 1 thread", lambda v, p: encode_frames(v, p, 8, 18, 1)),
        (f"child process + MALLOC_PERTURB_, {X264_THREADS} threads (output.py)",
         lambda v, p: encode_in_child(v, p, 8, 18, X264_THREADS)),
        ("child process + MALLOC_PERTURB_, 1 thread", lambda v, p: encode_in_child(v, p, 8, 18, 1)),
        ("child process + MALLOC_PERTURB_, asm=0, 4 threads",
         lambda v, p: encode_in_child(v, p, 8, 18, 4, x264_params="asm=0")),
    ]
    rows = []
    outputs: dict[str, set] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size, video in videos().items():
            for label, encode in settings:
                seconds, digests = [], []
                for i in range(RUNS):
                    assert worker.run(JOB)["ok"]  # a job first, as in a worker
                    path = Path(tmp) / f"{i}.mp4"
                    start = time.perf_counter()
                    encode(video, path)
                    seconds.append(time.perf_counter() - start)
                    digests.append(hashlib.sha256(path.read_bytes()).hexdigest())
                outputs.setdefault(size, set()).update(digests)
                rows.append({"video": size, "setting": label, "medianSeconds": round(statistics.median(seconds), 3),
                             "distinctOutputs": len(set(digests)), "runs": RUNS, "firstDigest": digests[0][:16]})
                print(json.dumps(rows[-1]), flush=True)
    result = {"benchmark": "mp4", "rows": rows,
              "notes": "distinctOutputs 1 means the bytes were a function of the frames over the runs; the "
                       "worker job before each encode leaves a different heap each time."}
    print(f"wrote {write_result('mp4.json', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
