"""Talking to the cluster, stdlib only: HTTP(S) health checks, the apiserver's
REST API as the admin (client certificate), and kubectl with the admin
kubeconfig (for what needs YAML parsing or server-side apply)."""
from __future__ import annotations

import json
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from .common import ClusterError, Paths


def admin_ssl_context(pki: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return ctx


def insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def api(state: dict, paths: Paths, method: str, path: str, body: dict | None = None,
        timeout: float = 10.0, content_type: str = "application/json") -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(state["server"] + path, data=data, method=method)
    req.add_header("Accept", "application/json")
    if data is not None:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, context=admin_ssl_context(paths.pki), timeout=timeout) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw = exc.read().decode(errors="replace")
        status = exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def http_ok(url: str, ctx: ssl.SSLContext | None, timeout: float = 3.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=timeout) as r:
            body = r.read().decode(errors="replace")
            return r.status == 200, body
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}: {exc.read().decode(errors='replace')[-2000:]}"
    except (OSError, ssl.SSLError) as exc:
        return False, str(exc)


def kubectl(state: dict, *args: str, input: str | None = None, timeout: float = 120) -> str:
    """Run kubectl with the admin kubeconfig; return stdout, raise ClusterError on failure."""
    argv = [state["kubectl"], f"--kubeconfig={state['kubeconfig']}", *args]
    try:
        res = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`kubectl {' '.join(args)}` did not finish in {timeout:.0f}s") from None
    if res.returncode != 0:
        raise ClusterError(f"`kubectl {' '.join(args)}` exited with {res.returncode}:\n"
                           f"{res.stderr.strip()[-3000:]}")
    return res.stdout
