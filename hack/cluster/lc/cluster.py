"""The cluster as an ordered list of steps: start it, check it, stop it.

CONTROL_PLANE runs in every cluster; FULL is added by `up --full`, started
after the control plane is up, in this order. To add a component, write a
module with a Step (or Process) subclass and add its instance to the list
where it must start (see steps.py for what a step does); `status`, the health
check that decides whether `up` reuses a cluster, `down` (reverse order) and
the failed-`up` clean-up all follow the lists.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from . import controlplane, kuberay, nodes, pods
from .common import Paths, log, write_state
from .pki import make_pki
from .procs import free_ports, pid_alive
from .steps import Run, Step

CONTROL_PLANE: tuple[Step, ...] = (
    controlplane.ETCD,
    controlplane.APISERVER,
    controlplane.CONTROLLER_MANAGER,
)
FULL: tuple[Step, ...] = (
    controlplane.SCHEDULER,
    kuberay.CRDS,           # applied and Established before kwok starts
    nodes.KWOK,
    nodes.FAKE_NODES_STEP,  # waits until kwok has made every node Ready
    kuberay.OPERATOR,
    # A new full-mode component goes here, or wherever it must start: one
    # module with a Step/Process subclass + one entry.
)
# `up --full --pod-runner`: the pod runner's nodes instead of KWOK's fake ones
# (pods really run, as processes; see pods.py).
PODS: tuple[Step, ...] = (
    controlplane.SCHEDULER,
    kuberay.CRDS,
    kuberay.OPERATOR,
    pods.POD_RUNNER,
)
# Every step any mode may have started, in start order (stop_all stops them all).
ALL: tuple[Step, ...] = CONTROL_PLANE + tuple(dict.fromkeys(FULL + PODS))


def _names(steps: tuple[Step, ...]) -> tuple[str, ...]:
    """Process names in stop order (the reverse of the start order)."""
    return tuple(s.name for s in reversed(steps) if s.process)


# Stop order; start order is the reverse.
COMPONENTS = _names(CONTROL_PLANE)
# `up --full` only; stopped before COMPONENTS, started after them.
FULL_COMPONENTS = _names(FULL)


def full_steps(pod_runner: bool) -> tuple[Step, ...]:
    """What `up --full` adds: KWOK's fake nodes, or (--pod-runner) the pod runner's nodes."""
    return PODS if pod_runner else FULL


def steps_of(state: dict | None) -> tuple[Step, ...]:
    """The steps of this cluster, in start order."""
    if not state or not state.get("full"):
        return CONTROL_PLANE
    return CONTROL_PLANE + full_steps(bool(state.get("pod_runner")))


def components(state: dict | None) -> tuple[str, ...]:
    """The components of this cluster, in stop order."""
    return _names(steps_of(state))


def health(state: dict, paths: Paths) -> dict[str, tuple[bool, str]]:
    """Health of each component: {name: (ok, detail)}."""
    out: dict[str, tuple[bool, str]] = {}
    pids = state.get("pids", {})
    exes = state.get("exes", {})
    steps = [s for s in steps_of(state) if s.process]
    for s in steps:
        if not pid_alive(pids.get(s.name, -1), exes.get(s.name)):
            out[s.name] = (False, f"process {pids.get(s.name)} is not running")
    for s in steps:
        if s.name not in out:
            out[s.name] = s.check(state, paths)
    return out


def healthy(state: dict | None, paths: Paths) -> bool:
    return bool(state) and all(ok for ok, _ in health(state, paths).values())


def stop_all(state: dict) -> None:
    for step in reversed(ALL):  # whatever was started, in any mode
        if step.process:
            step.stop(state)


def resolve(steps: tuple[Step, ...], bin_dir: Path, args, build: bool) -> dict[str, Any]:
    """Everything the steps need, found (or built) before anything starts:
    every step's cheap checks first, then the builds."""
    for step in steps:
        step.preflight(bin_dir, args)
    return {step.name: step.resolve(bin_dir, args, build) for step in steps}


def start_steps(run: Run, steps: tuple[Step, ...]) -> None:
    """One phase: pick the ports of all its steps, record them, start each in order."""
    keys = [key for step in steps for key in step.ports]
    run.state["ports"].update(zip(keys, free_ports(len(keys))))
    for step in steps:
        step.record(run)
    run.t0 = time.monotonic()
    for step in steps:
        proc = step.start(run)
        if proc is not None:
            run.procs[step.name] = proc


def start_cluster(paths: Paths, bin_dir: Path, timeout: float,
                  full: dict[str, Any] | None = None, pod_runner: bool = False) -> dict:
    """Start the control plane and, when `full` (resolve(full_steps(pod_runner), ...)'s
    result) is given, the full mode's steps; the state. On failure everything
    started is stopped and state.json removed."""
    extra = full_steps(pod_runner) if full is not None else ()
    paths.root.mkdir(parents=True, exist_ok=True)
    make_pki(paths.pki)
    state: dict = {
        "bin_dir": str(bin_dir),
        "cluster_dir": str(paths.root),
        "kubeconfig": str(paths.kubeconfig),
        "kubectl": str(bin_dir / "kubectl"),
        "ports": {},
        "pids": {},
        "exes": {},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ephemeral": False,
        "holders": [],
    }
    run = Run(paths=paths, state=state, bin_dir=bin_dir, timeout=timeout,
              steps=CONTROL_PLANE + extra, tools=dict(full or {}))
    t0 = time.monotonic()
    try:
        start_steps(run, CONTROL_PLANE)  # also sets state["server"]
        if full is not None:
            state["full"] = True
            state["pod_runner"] = pod_runner
            start_steps(run, extra)
            parts = [p for p in (s.summary(run) for s in extra) if p]
            log(f"full mode ({', '.join(parts)}) up after {time.monotonic() - run.t0:.1f}s")
    except BaseException:
        stop_all(state)
        with contextlib.suppress(FileNotFoundError):
            paths.state.unlink()
        raise
    write_state(paths, state)
    log(f"cluster up in {time.monotonic() - t0:.1f}s: {state['server']} (kubeconfig {paths.kubeconfig})")
    return state
