"""What a component of the cluster is: a Step, and Process for the common case.

`up` starts an ordered list of steps (cluster.py: CONTROL_PLANE, then FULL with
--full) in phases. Per phase, before anything of it starts:

1. preflight(bin_dir, args)     cheap checks (files, flags), for every step of
                                `up` before any build; raise ClusterError.
2. resolve(bin_dir, args, build)  find or build what it runs (may take minutes);
                                the result is run.tools[step.name].
   (1 and 2 run in cli.py's `up` for every step before the first one starts.)
3. the phase's ports are picked: every step's `ports` (keys of state["ports"]),
   all at once, in step order.
4. record(run)                  put its exes (and any other facts) in the state.

Then, step by step, start(run): start the process, record its pid in the state
(written at once, so `down` can stop it even if the wait fails), wait until it
is healthy. A step that starts no process (process = False: applying CRDs,
creating Nodes) just does its work and waits for it.

Afterwards the process steps are what `status` checks (check(state, paths)),
what `up` requires alive and healthy to reuse a cluster, and what `down` stops
(stop(state), in reverse order).
"""
from __future__ import annotations

import dataclasses
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

from .client import http_ok
from .common import Paths, write_state
from .procs import start_process, stop_pid, wait_until


@dataclasses.dataclass
class Run:
    """One `up`'s start-up, shared by its steps."""
    paths: Paths
    state: dict                  # becomes state.json
    bin_dir: Path                # build-tools.sh's bin dir
    timeout: float               # `up --timeout`: how long kube-apiserver may take
    steps: tuple                 # every Step this `up` starts (control plane + full)
    tools: dict[str, Any]        # what each step's resolve() returned, by step name
    procs: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)
    t0: float = dataclasses.field(default_factory=time.monotonic)  # start of the phase


def start_and_wait(run: Run, name: str, argv: list[str], health_url: str,
                   ctx: ssl.SSLContext | None = None, timeout: float = 60, *,
                   ready=None, what: str | None = None,
                   interval: float = 0.25) -> subprocess.Popen:
    """Start one component, record its pid in the state (so `down` stops it even
    if the wait fails), and wait until ``health_url`` answers ok (or ``ready()``
    is true, when given)."""
    proc = start_process(name, argv, run.paths.log(name))
    run.state["pids"][name] = proc.pid
    write_state(run.paths, run.state)
    wait_until(what or f"{name} {health_url} to return ok",
               ready or (lambda: http_ok(health_url, ctx)[0]),
               timeout, proc, run.paths.log(name), interval=interval)
    return proc


class Step:
    """One component of the start-up. Override what applies."""
    name: str = ""                # pids/exes key and <name>.log for a process
    process: bool = True          # False: nothing runs afterwards (nothing to check or stop)
    ports: tuple[str, ...] = ()   # keys of state["ports"] this step listens on
    # kube-apiserver --enable-admission-plugins this step needs (added in full mode)
    admission_plugins: tuple[str, ...] = ()

    def preflight(self, bin_dir: Path, args) -> None:
        """Cheap checks before anything is built or started."""

    def resolve(self, bin_dir: Path, args, build: bool) -> Any:
        """Find (or, when build is true, build) what this step runs."""
        return None

    def record(self, run: Run) -> None:
        """Put this step's exes and facts in run.state, before anything starts."""

    def start(self, run: Run) -> subprocess.Popen | None:
        """Start, record the pid, wait for health; the process, or None."""
        raise NotImplementedError

    def check(self, state: dict, paths: Paths) -> tuple[bool, str]:
        """Health of the running process (called only when its pid is alive)."""
        return True, ""

    def summary(self, run: Run) -> str | None:
        """Its part of the "full mode (...) up" log line, if any."""
        return None

    def stop(self, state: dict) -> None:
        pids, exes = state.get("pids", {}), state.get("exes", {})
        if self.name in pids:
            stop_pid(pids[self.name], exes.get(self.name), self.name)


class Process(Step):
    """A process with an HTTP(S) health endpoint: define argv() and health_url()."""
    interval = 0.25

    def argv(self, run: Run) -> list[str]:
        raise NotImplementedError

    def health_url(self, state: dict, paths: Paths) -> tuple[str, ssl.SSLContext | None]:
        raise NotImplementedError

    def timeout(self, run: Run) -> float:
        """Seconds start() waits for health."""
        return 60

    def start(self, run: Run) -> subprocess.Popen:
        url, ctx = self.health_url(run.state, run.paths)
        return start_and_wait(run, self.name, self.argv(run), url, ctx, self.timeout(run),
                              interval=self.interval)

    def check(self, state: dict, paths: Paths) -> tuple[bool, str]:
        url, ctx = self.health_url(state, paths)
        ok, body = http_ok(url, ctx)
        return ok, body.strip()[:2000]
