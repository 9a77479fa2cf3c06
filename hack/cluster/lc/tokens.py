"""ServiceAccount tokens from the TokenRequest API (`token`, `kubeconfig-for`):
the namespace and ServiceAccount are created when missing."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from .client import api
from .common import ClusterError, Paths, cluster_dir, read_state
from .pki import write_kubeconfig

DURATION_RE = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s?)?$")


def parse_duration(text: str) -> int:
    m = DURATION_RE.match(text.strip())
    if not text.strip() or not m or not any(m.groups()):
        raise argparse.ArgumentTypeError(f"bad duration {text!r} (use e.g. 1h, 30m, 3600s, 3600)")
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    secs = h * 3600 + mi * 60 + s
    if secs < 600:
        raise argparse.ArgumentTypeError("the TokenRequest API needs a duration of at least 10m")
    return secs


def running_state(paths: Paths) -> dict:
    state = read_state(paths)
    if not state:
        raise ClusterError(f"no cluster is running (no {paths.state}); run `localcluster.py up`")
    return state


def ensure(state: dict, paths: Paths, path: str, body: dict, what: str) -> None:
    status, resp = api(state, paths, "POST", path, body)
    if status in (200, 201, 409):
        return
    raise ClusterError(f"creating {what}: HTTP {status}: {resp}")


def request_token(state: dict, paths: Paths, namespace: str, sa: str, seconds: int,
                  audiences: list[str] | None = None) -> str:
    ensure(state, paths, "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
           f"namespace {namespace}")
    ensure(state, paths, f"/api/v1/namespaces/{namespace}/serviceaccounts",
           {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": sa, "namespace": namespace}},
           f"serviceaccount {namespace}/{sa}")
    spec: dict = {"expirationSeconds": seconds}
    if audiences:
        spec["audiences"] = audiences
    status, resp = api(state, paths, "POST",
                       f"/api/v1/namespaces/{namespace}/serviceaccounts/{sa}/token",
                       {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                        "spec": spec})
    if status not in (200, 201) or not isinstance(resp, dict):
        raise ClusterError(f"TokenRequest for {namespace}/{sa}: HTTP {status}: {resp}")
    return resp["status"]["token"]


def cmd_token(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    state = running_state(paths)
    print(request_token(state, paths, args.namespace, args.service_account, args.duration,
                        args.audience))
    return 0


def cmd_kubeconfig_for(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    state = running_state(paths)
    token = request_token(state, paths, args.namespace, args.service_account, args.duration,
                          args.audience)
    out = Path(args.out)
    write_kubeconfig(out, state["server"], paths.pki / "ca.crt", {"token": token},
                     f"{args.namespace}-{args.service_account}", namespace=args.namespace)
    print(out)
    return 0
