"""The commands (up, down, status, release, restart-apiserver, token, kubeconfig-for) and their
argument parser; hack/cluster/localcluster.py calls main()."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal

from . import cluster
from .binaries import resolve_bin_dir
from .cluster import components, health, healthy, start_cluster, steps_of, stop_all
from .controlplane import restart_apiserver
from .common import ClusterError, Paths, cluster_dir, locked, log, read_state, write_state
from .nodes import FAKE_NODES
from .pods import RUNNER_NODES
from .procs import pid_alive, wait_until
from .tokens import cmd_kubeconfig_for, cmd_token, parse_duration


def cmd_up(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    if args.pod_runner:
        args.full = True
    # A long lock timeout: another `up` may be doing a cold build of the binaries.
    with locked(paths, "up", timeout=3600):
        state = read_state(paths)
        started = False
        if state and all(pid_alive(state.get("pids", {}).get(n, -1), state.get("exes", {}).get(n))
                         for n in components(state)) and not healthy(state, paths):
            # All processes run but something is not ready (e.g. a busy machine):
            # give it a moment before deciding to restart.
            with contextlib.suppress(ClusterError):
                wait_until("the running cluster to become healthy again",
                           lambda: healthy(state, paths), 30, interval=1)
        if state and healthy(state, paths) and args.full and not state.get("full"):
            # Never restart a cluster that others may be using; its apiserver
            # also lacks the full mode's admission plugin.
            raise ClusterError(
                f"a cluster without --full is running in {paths.root}; stop it first "
                f"(`localcluster.py --cluster-dir {paths.root} down`) or use another "
                f"--cluster-dir / VIDEOJOB_CLUSTER_DIR for the full cluster")
        if (state and healthy(state, paths) and args.full and state.get("full")
                and bool(state.get("pod_runner")) != bool(args.pod_runner)):
            have = "the pod runner" if state.get("pod_runner") else "KWOK's fake nodes"
            raise ClusterError(
                f"a full cluster with {have} is running in {paths.root}; `up` was asked for "
                f"{'the pod runner' if args.pod_runner else 'KWOK'}: stop it first or use another --cluster-dir")
        if state and healthy(state, paths):
            log(f"reusing the running {'full ' if state.get('full') else ''}cluster at {state['server']}")
            if not args.ephemeral and state.get("ephemeral"):
                state["ephemeral"] = False  # an explicit `up` keeps it
        else:
            if state:
                log("the recorded cluster is not healthy; restarting it")
                for name, (ok, detail) in health(state, paths).items():
                    if not ok:
                        log(f"  {name}: {detail[:300]}")
                stop_all(state)
                paths.state.unlink()
            bin_dir = resolve_bin_dir(args.bin_dir, build=not args.no_build)
            # Everything full mode needs is found (or built) before anything starts.
            full = (cluster.resolve(cluster.full_steps(args.pod_runner), bin_dir, args,
                                    build=not args.no_build)
                    if args.full else None)
            state = start_cluster(paths, bin_dir, args.timeout, full, pod_runner=args.pod_runner)
            state["ephemeral"] = bool(args.ephemeral)
            started = True
        if args.holder is not None:
            holders = [h for h in state.get("holders", []) if pid_alive(h)]
            if args.holder not in holders:
                holders.append(args.holder)
            state["holders"] = holders
        write_state(paths, state)
    if args.json:
        print(json.dumps({**state, "started": started}, indent=2, sort_keys=True))
    else:
        print(state["kubeconfig"])
    return 0


def do_down(paths: Paths, keep_data: bool) -> None:
    state = read_state(paths)
    if state:
        stop_all(state)
        paths.state.unlink()
    else:
        log("no cluster state; nothing to stop")
    if not keep_data and paths.etcd_data.exists():
        log(f"deleting etcd data {paths.etcd_data}")
        shutil.rmtree(paths.etcd_data)
    for f in (paths.kubeconfig, paths.kcm_kubeconfig, paths.scheduler_kubeconfig):
        with contextlib.suppress(FileNotFoundError):
            f.unlink()


def cmd_down(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    with locked(paths, "down"):
        do_down(paths, args.keep_data)
    log("down")
    return 0


def cmd_release(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    with locked(paths, "release"):
        state = read_state(paths)
        if not state:
            log("no cluster state; nothing to release")
            return 0
        holders = [h for h in state.get("holders", []) if h != args.holder and pid_alive(h)]
        state["holders"] = holders
        if state.get("ephemeral") and not holders:
            log("last holder of an ephemeral cluster released it; stopping the cluster")
            do_down(paths, keep_data=False)
        else:
            write_state(paths, state)
            why = (f"{len(holders)} other holder(s)" if holders
                   else "it was started by `up` without --ephemeral")
            log(f"released holder {args.holder}; cluster keeps running ({why})")
    return 0


def cmd_restart_apiserver(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    with locked(paths, "restart-apiserver"):
        state = read_state(paths)
        if not state or not healthy(state, paths):
            raise ClusterError(f"no healthy cluster in {paths.root} to restart the API server of")
        pid = restart_apiserver(paths, state, steps_of(state), args.timeout)
    print(json.dumps({"server": state["server"], "pid": pid}))
    return 0


def cmd_status(args) -> int:
    paths = cluster_dir(args.cluster_dir)
    state = read_state(paths)
    if not state:
        if args.json:
            print(json.dumps({"running": False}))
        else:
            print(f"not running (no {paths.state})")
        return 1
    h = health(state, paths)
    ok = all(v[0] for v in h.values())
    if args.json:
        print(json.dumps({**state, "running": ok,
                          "health": {k: {"ok": v[0], "detail": v[1]} for k, v in h.items()}},
                         indent=2, sort_keys=True))
    else:
        print(f"cluster:    {'healthy' if ok else 'UNHEALTHY'}")
        print(f"server:     {state['server']}")
        print(f"kubeconfig: {state['kubeconfig']}")
        print(f"bin dir:    {state['bin_dir']}")
        print(f"started:    {state.get('started_at')}  ephemeral={state.get('ephemeral')} "
              f"holders={state.get('holders')}")
        if state.get("full") and state.get("pod_runner"):
            pr = state["pod_runner"]
            print(f"full:       pod runner, pods {pr['pod_cidr']}, state {pr['state_dir']}")
            print(f"            kuberay {state['tool_bin_dirs']['kuberay']}")
        elif state.get("full"):
            print(f"full:       kwok {state['tool_bin_dirs']['kwok']}")
            print(f"            kuberay {state['tool_bin_dirs']['kuberay']}")
            print(f"            fake nodes {', '.join(state.get('fake_nodes', []))}")
        for name in reversed(components(state)):
            good, detail = h[name]
            first = detail.splitlines()[0] if detail else ""
            print(f"  {name:<24} pid {state['pids'].get(name)}  {'ok' if good else 'FAIL'}"
                  f"  {'' if good else first[:200]}")
            if not good:
                print(f"    log: {paths.log(name)}")
    return 0 if ok else 1


def parser(description: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster-dir", help="default: $VIDEOJOB_CLUSTER_DIR or <repo>/.cluster")
    sub = p.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start (or reuse) the cluster; prints the kubeconfig path")
    up.add_argument("--bin-dir", help="binaries dir (default: $VIDEOJOB_K8S_BIN_DIR or build-tools.sh)")
    up.add_argument("--no-build", action="store_true",
                    help="fail instead of building the binaries when they are missing")
    up.add_argument("--timeout", type=float,
                    default=float(os.environ.get("VIDEOJOB_CLUSTER_TIMEOUT", "180")),
                    help="seconds to wait for kube-apiserver /readyz (default 180)")
    up.add_argument("--ephemeral", action="store_true",
                    help="stop the cluster when its last --holder releases it")
    up.add_argument("--holder", type=int, help="register this pid as a user of the cluster")
    up.add_argument("--json", action="store_true", help="print the state as JSON (with `started`)")
    up.add_argument("--full", action="store_true",
                    help="also run kube-scheduler, KWOK with fake (GPU) nodes and the KubeRay "
                         "operator with its CRDs; builds tools/kwok and tools/kuberay if needed")
    up.add_argument("--fake-nodes", default=str(FAKE_NODES),
                    help="with --full: the Node manifests to create (default: %(default)s)")
    up.add_argument("--pod-runner", action="store_true",
                    help="full mode whose pods really run, as local processes: the pod runner "
                         "(hack/cluster/podrunner) instead of KWOK; needs root and the venv")
    up.add_argument("--runner-nodes", default=str(RUNNER_NODES),
                    help="with --pod-runner: the Nodes the runner registers (default: %(default)s)")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the cluster and delete its etcd data")
    down.add_argument("--keep-data", action="store_true", help="keep .cluster/etcd")
    down.set_defaults(func=cmd_down)

    st = sub.add_parser("status", help="show the cluster; exit 0 only when healthy")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    rel = sub.add_parser("release", help="unregister a holder (see up --holder)")
    rel.add_argument("--holder", type=int, required=True)
    rel.set_defaults(func=cmd_release)

    ra = sub.add_parser("restart-apiserver",
                        help="stop kube-apiserver and start it again, same port and flags (etcd keeps its data)")
    ra.add_argument("--timeout", type=float, default=180, help="seconds to wait for /readyz (default 180)")
    ra.set_defaults(func=cmd_restart_apiserver)

    for name, func, hlp in (("token", cmd_token, "print a ServiceAccount token"),
                            ("kubeconfig-for", cmd_kubeconfig_for,
                             "write a kubeconfig for a ServiceAccount token")):
        t = sub.add_parser(name, help=hlp)
        t.add_argument("--namespace", "-n", required=True)
        t.add_argument("--service-account", required=True)
        t.add_argument("--duration", type=parse_duration, default=parse_duration("1h"),
                       help="token lifetime, e.g. 1h, 30m, 3600s (min 10m; default 1h)")
        t.add_argument("--audience", action="append",
                       help="token audience (repeatable; default: the apiserver's)")
        if name == "kubeconfig-for":
            t.add_argument("--out", required=True, help="kubeconfig file to write")
        t.set_defaults(func=func)
    return p


def main(argv: list[str] | None = None, description: str | None = None) -> int:
    """Run one command; `description` is the --help text (localcluster.py's docstring)."""
    args = parser(description).parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `status | head` exits quietly
    try:
        return args.func(args)
    except ClusterError as exc:
        log(f"ERROR: {exc}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
