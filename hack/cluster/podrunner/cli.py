"""Command line: `run` (the default) and `cleanup`."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from .cleanup import CleanupError, cleanup
from .images import ImageMapError
from .kube import ApiError
from .network import NetworkError
from .nodes import NodeError
from .runner import Config, Runner, RunnerError
from .util import error, info, setup_logging

USAGE_ERRORS = (RunnerError, NetworkError, NodeError, ImageMapError, CleanupError)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="podrunner", description="A kubelet that runs containers as local "
                                "processes (network namespaces, bind mounts) for a test cluster's nodes.")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command")
    run = sub.add_parser("run", help="run the pods bound to the nodes (the default command)")
    for a in (p, run):
        a.add_argument("--kubeconfig", type=Path, help="kubeconfig with rights over nodes, pods, leases, tokens")
        a.add_argument("--state-dir", type=Path, help="the runner's own dir (logs, volumes, runner.json); "
                       "also names everything it creates")
        a.add_argument("--nodes", type=Path, help="YAML manifest of the Node objects to be the kubelet of")
        a.add_argument("--pod-cidr", help="pod addresses, e.g. 10.123.0.0/24 (the first one is the bridge's)")
        a.add_argument("--image-map", type=Path, help="YAML: image repository -> local install (see images.py)")
        a.add_argument("--health-port", type=int, help="serve /healthz (and /state) on 127.0.0.1:PORT")
        a.add_argument("--backoff-base", type=float, default=10.0, help="first CrashLoopBackOff delay, s (10)")
        a.add_argument("--backoff-max", type=float, default=300.0, help="longest CrashLoopBackOff delay, s (300)")
        a.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="on runner stop: most seconds a container gets between SIGTERM and SIGKILL (30)")
        a.add_argument("--token-refresh-fraction", type=float, default=0.8,
                       help="renew projected ServiceAccount tokens after this fraction of their life (0.8; "
                            "tests use less to see a renewal)")
        a.add_argument("--keep-nodes", action="store_true",
                       help="on stop, keep the Node objects the runner created (default: delete them)")
    clean = sub.add_parser("cleanup", help="remove what a crashed runner with this state dir left")
    clean.add_argument("--state-dir", type=Path, required=True, dest="cleanup_state_dir")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging(args.log_level)
    if args.command == "cleanup":
        try:
            removed = cleanup(args.cleanup_state_dir)
        except CleanupError as exc:
            error(str(exc))
            return 2
        for what in removed:
            print(f"removed {what}")
        return 0
    missing = [f"--{n.replace('_', '-')}" for n in ("kubeconfig", "state_dir", "nodes", "pod_cidr", "image_map")
               if getattr(args, n) is None]
    if missing:
        error(f"missing required options: {' '.join(missing)}")
        return 2
    cfg = Config(kubeconfig=args.kubeconfig, state_dir=args.state_dir, nodes=args.nodes, pod_cidr=args.pod_cidr,
                 image_map=args.image_map, health_port=args.health_port, backoff_base=args.backoff_base,
                 backoff_max=args.backoff_max, shutdown_grace=args.shutdown_grace, keep_nodes=args.keep_nodes,
                 token_refresh_fraction=args.token_refresh_fraction)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    runner = Runner(cfg)
    try:
        runner.start()
    except USAGE_ERRORS + (ApiError, OSError) as exc:
        error(f"pod runner failed to start: {exc}")
        runner.stop()
        return 1
    while not stop.wait(1.0):
        pass
    info("signal received")
    runner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
