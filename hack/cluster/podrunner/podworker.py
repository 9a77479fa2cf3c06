"""One thread per pod doing what the kubelet's pod worker does: sandbox, init containers
in order, the containers, probes, restarts with back-off, status, termination."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import containers
from .env import ConfigError
from .launch import prepare
from .termination import Termination, field_path as _field
from .kube import ApiError
from .network import NetworkError
from .probes import ProbeSet, Target
from .status import CState, comparable, owned, pod_status
from .util import debug, error, info, parse_rfc3339, short_uid, warn
from .volumes import VolumeError

if TYPE_CHECKING:
    from .runner import Runner
    from .sandbox import Sandbox


@dataclass
class Ctr:
    spec: dict
    cs: CState
    log_path: Path
    dir: Path
    inst: containers.Instance | None = None
    probes: ProbeSet | None = None
    exit_handled: bool = True
    backoff: float | None = None          # the next CrashLoopBackOff delay
    last_start: float = 0.0
    force_restart: bool = False           # killed by its liveness/startup probe
    resumed: bool = False                 # ran under a previous runner: its next start is a restart
    target: Target | None = field(default=None, repr=False)


class PodWorker(Termination, threading.Thread):
    def __init__(self, runner: "Runner", pod: dict, adopt: dict | None = None):
        meta = pod["metadata"]
        super().__init__(name=f"pod {meta['namespace']}/{meta['name']}", daemon=True)
        from .sandbox import Sandbox

        self.runner = runner
        self.pod = pod
        self.uid = meta["uid"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.cond = threading.Condition()
        self.gone = False            # the Pod object was deleted (force delete)
        self.shutdown_reason: str | None = None
        self.sandbox: Sandbox = Sandbox(runner, pod)
        self.adopt = adopt
        self.terminal = False
        self.start_time = time.time()
        old = pod.get("status") or {}
        if old.get("startTime"):
            self.start_time = parse_rfc3339(old["startTime"])
        spec = pod["spec"]
        self.init = [self._ctr(c, True) for c in spec.get("initContainers") or []]
        self.main = [self._ctr(c, False) for c in spec["containers"]]
        self._last_status: dict | None = None
        self._status_retry = False   # the last status write failed: the next pass comes soon
        self._next_volume_sync = 0.0
        self._sandbox_error: str | None = None
        self._phase_override: tuple[str, str, str] | None = None
        self.done = threading.Event()
        if adopt is None:
            self._resume(pod)

    def _ctr(self, c: dict, init: bool) -> Ctr:
        cs = CState(name=c["name"], image=c.get("image", ""), init=init,
                    reason="PodInitializing" if (init or self.pod["spec"].get("initContainers")) else "ContainerCreating")
        d = self.sandbox.dir / "containers" / c["name"]
        return Ctr(spec=c, cs=cs, log_path=self.sandbox.logs / f"{c['name']}.log", dir=d)

    def _resume(self, pod: dict) -> None:
        """A pod whose containers ran before, under a runner that is gone (a node reboot, to
        the kubelet): they start again in a new sandbox, counted as restarts; under
        restartPolicy Never a lost running container ends as ContainerStatusUnknown."""
        status = pod.get("status") or {}
        old = {(s["name"], init): s for init, key in ((True, "initContainerStatuses"), (False, "containerStatuses"))
               for s in status.get(key) or []}
        never = pod["spec"].get("restartPolicy", "Always") == "Never"
        for c in self.init + self.main:
            st = old.get((c.cs.name, c.cs.init))
            if not st or not ({"running", "terminated"} & set(st.get("state") or {})):
                continue
            c.cs.restart_count = st.get("restartCount", 0)
            term = (st.get("state") or {}).get("terminated")
            if never and (not c.cs.init or term):
                if term is None:
                    term = {"exitCode": 137, "reason": "ContainerStatusUnknown",
                            "message": "The container could not be located when the pod was terminated"}
                c.cs.state, c.cs.exit_code = "terminated", term.get("exitCode")
                c.cs.term_reason, c.cs.term_message = term.get("reason"), term.get("message", "")
                c.cs.finished_at = time.time()
                continue
            c.cs.last_terminated = term or {"exitCode": 137, "reason": "ContainerStatusUnknown",
                                            "message": "The container could not be located when the pod was deleted"}
            c.resumed = True

    # ---- events from other threads
    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def update(self, pod: dict) -> None:
        with self.cond:
            self.pod = pod
            self.cond.notify_all()

    def object_deleted(self) -> None:
        with self.cond:
            self.gone = True
            self.cond.notify_all()

    def stop(self, reason: str) -> None:
        with self.cond:
            self.shutdown_reason = reason
            self.cond.notify_all()

    # ---- the loop
    def run(self) -> None:
        try:
            self._run()
        except Exception:  # noqa: BLE001 - keep the runner alive, report loudly
            error("pod worker crashed", exc_info=True, pod=self.key)
            self._kill_all(0)
            self.sandbox.teardown()
        finally:
            self.done.set()
            self.runner.worker_done(self)

    def _run(self) -> None:
        wait = 0.0
        while True:
            with self.cond:
                if wait > 0:
                    self.cond.wait(wait)
                pod, gone, shutdown = self.pod, self.gone, self.shutdown_reason
            if shutdown:
                self._node_shutdown(shutdown)
                return
            if gone:
                self._kill_all(0)
                self.sandbox.teardown()
                info("pod removed (object deleted)", pod=self.key)
                return
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(pod)
                return
            wait = self._sync(pod)

    def _sync(self, pod: dict) -> float:
        """One pass; returns seconds until the next pass is needed at the latest."""
        now = time.time()
        if self.terminal:
            self._write_status(pod)   # a failed final write, or someone else's change, is put right
            return 2.0 if self._status_retry else 60.0
        if not self.sandbox.ready:
            try:
                self._create_sandbox(pod)
            except (NetworkError, OSError) as exc:
                self._sandbox_error = str(exc)
                warn("sandbox creation failed; retrying", pod=self.key, error=str(exc))
                self.runner.events.pod_event(pod, "Warning", "FailedCreatePodSandBox", str(exc))
                self._write_status(pod)
                return 5.0
        if now >= self._next_volume_sync:
            try:
                vols = self.sandbox.volumes
                due = vols.setup() if len(vols.mounts) < len(pod["spec"].get("volumes") or []) else vols.resync(pod)
                self._next_volume_sync = now + due
            except (VolumeError, ConfigError, ApiError, OSError) as exc:
                msg = f"MountVolume.SetUp failed: {exc}"
                if self._sandbox_error != msg:
                    self.runner.events.pod_event(pod, "Warning", "FailedMount", msg)
                self._sandbox_error = msg
                self._write_status(pod)
                return 2.0
        self._sandbox_error = None
        deadline = pod["spec"].get("activeDeadlineSeconds")
        if deadline is not None and now - self.start_time > deadline:
            self._phase_override = ("Failed", "DeadlineExceeded",
                                    f"Pod was active on the node longer than the specified deadline")
            self._kill_all(float(pod["spec"].get("terminationGracePeriodSeconds", 30)))
        wait = min(30.0, max(0.5, self._next_volume_sync - now))
        for c in self.init + self.main:
            self._collect_exit(pod, c)
        if self._phase_override is None:
            wait = min(wait, self._drive(pod))
        status = self._write_status(pod)
        if self._status_retry:
            wait = min(wait, 2.0)
        if status["phase"] in ("Succeeded", "Failed"):
            self._finish(status["phase"])
        elif deadline is not None:
            wait = min(wait, max(0.5, self.start_time + deadline - time.time()))
        return wait

    def _drive(self, pod: dict) -> float:
        policy = pod["spec"].get("restartPolicy", "Always")
        wait = 30.0
        for c in self.init:
            if c.cs.succeeded:
                continue
            if c.inst is not None and c.inst.alive():
                return wait
            if c.resumed:
                self._start(pod, c, restart=True)
                return 1.0
            if c.cs.state == "terminated" or c.cs.last_terminated:
                if policy == "Never":
                    return wait   # phase() says Failed
                return min(wait, self._restart(pod, c))
            self._start(pod, c)
            return 1.0
        for c in self.main:
            if c.inst is not None and c.inst.alive():
                continue
            if c.inst is None and c.cs.state == "waiting" and (c.resumed or not c.cs.last_terminated):
                started = self._start(pod, c, restart=c.resumed)
                wait = min(wait, 2.0 if started or c.cs.reason != "ErrImagePull" else 10.0)
                continue
            exit_code = c.cs.exit_code if c.cs.state == "terminated" else (c.cs.last_terminated or {}).get("exitCode")
            if c.force_restart or policy == "Always" or (policy == "OnFailure" and exit_code != 0):
                wait = min(wait, self._restart(pod, c))
        return wait

    # ---- containers
    def _collect_exit(self, pod: dict, c: Ctr) -> None:
        if c.inst is None or c.exit_handled or c.inst.alive():
            return
        c.exit_handled = True
        if c.probes:
            c.probes.stop()
        try:
            err = c.inst.error_file.read_text().strip()
        except OSError:
            err = ""
        code = c.inst.exit_code
        cs = c.cs
        cs.state, cs.exit_code, cs.finished_at, cs.ready, cs.started = "terminated", code, time.time(), False, False
        cs.term_reason = "StartError" if err else ("Completed" if code == 0 else "Error")
        cs.term_message = err
        if not err and code != 0 and c.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            cs.term_message = _log_tail(c.log_path)
        debug("container exited", pod=self.key, container=cs.name, exitCode=code, reason=cs.term_reason)
        if err:
            self.runner.events.pod_event(pod, "Warning", "Failed", f"Error: {err}", _field(c))
        self.runner.save_state()

    def _restart(self, pod: dict, c: Ctr) -> float:
        """Restart an exited container now or after its back-off; seconds to wait."""
        cs = c.cs
        if cs.state == "terminated":
            cs.last_terminated = cs.terminated_dict()
        now = time.time()
        base, cap = self.runner.backoff_base, self.runner.backoff_max
        finished = cs.finished_at or now
        if c.backoff is not None and now - c.last_start > 2 * cap:
            c.backoff = None      # ran long enough: back-off forgotten
        if c.backoff is None:
            c.backoff = base
        elif now < finished + c.backoff:
            if cs.state != "waiting" or cs.reason != "CrashLoopBackOff":
                cs.state, cs.reason = "waiting", "CrashLoopBackOff"
                cs.message = (f"back-off {c.backoff:g}s restarting failed container={cs.name} "
                              f"pod={pod['metadata']['name']}_{pod['metadata']['namespace']}({self.uid})")
                self.runner.events.pod_event(pod, "Warning", "BackOff",
                                             f"Back-off restarting failed container {cs.name} in pod "
                                             f"{pod['metadata']['name']}_{pod['metadata']['namespace']}({self.uid})",
                                             _field(c))
            return max(0.05, finished + c.backoff - now)
        else:
            c.backoff = min(c.backoff * 2, cap)
        if self._start(pod, c, restart=True):
            c.force_restart = False
        return 1.0

    def _prepare(self, pod: dict, c: Ctr) -> tuple[dict, Target] | None:
        return prepare(self.runner, self.sandbox, pod, c.spec, c.cs, c.dir)

    def _start(self, pod: dict, c: Ctr, restart: bool = False) -> bool:
        cs = c.cs
        prepared = self._prepare(pod, c)
        if prepared is None:
            self.runner.events.pod_event(pod, "Warning", "Failed", f"Error: {cs.message}", _field(c))
            return False
        spec, target = prepared
        if restart:
            cs.restart_count += 1
        c.resumed = False
        c.inst = containers.start(self.sandbox.netns, spec, c.dir, c.log_path, on_exit=self.wake)
        c.exit_handled = False
        c.last_start = time.time()
        cs.state, cs.started_at, cs.exit_code, cs.term_reason, cs.term_message = "running", c.inst.started_at, None, None, ""
        cs.reason = cs.message = ""
        cs.container_id = f"podrunner://{short_uid(self.uid)}-{cs.name}-{cs.restart_count}"
        self._start_probes(c, target)
        info("container started", pod=self.key, container=cs.name, pid=c.inst.pid1, restarts=cs.restart_count)
        self.runner.events.pod_event(pod, "Normal", "Started", f"Started container {cs.name}", _field(c))
        self.runner.save_state()
        return True

    def _start_probes(self, c: Ctr, target: Target) -> None:
        target.pid1 = c.inst.pid1 or 0
        target.started_at = c.inst.started_at
        c.target = target
        c.probes = None
        if not c.cs.init:
            c.probes = ProbeSet(target, lambda kind, msg, c=c, inst=c.inst: self._probe_event(c, inst, kind, msg))
            c.probes.start()
        self._probe_view(c)

    def _probe_view(self, c: Ctr) -> None:
        """started/ready of a running container, as its probes see them (no probe: True)."""
        running = c.cs.state == "running" and c.probes is not None
        c.cs.started = running and c.probes.started.is_set()
        c.cs.ready = c.cs.started and c.probes.ready

    def _probe_event(self, c: Ctr, inst, kind: str, message: str) -> None:
        """From a probe thread: 'changed' (started/ready flipped), 'unhealthy' (a failed
        probe), 'liveness'/'startup' (failed past its threshold: restart the container)."""
        if c.inst is not inst:
            return
        pod = self.pod
        if kind == "unhealthy":
            self.runner.events.pod_event(pod, "Warning", "Unhealthy", message, _field(c))
        elif kind in ("liveness", "startup"):
            self.runner.events.pod_event(pod, "Warning", "Unhealthy", f"{kind.title()} probe failed: {message}", _field(c))
            self.runner.events.pod_event(pod, "Normal", "Killing",
                                         f"Container {c.cs.name} failed {kind} probe, will be restarted", _field(c))
            probe = c.spec.get(f"{kind}Probe") or {}
            grace = probe.get("terminationGracePeriodSeconds", pod["spec"].get("terminationGracePeriodSeconds", 30))
            c.force_restart = pod["spec"].get("restartPolicy", "Always") != "Never"
            threading.Thread(target=containers.stop, args=(inst, float(grace)), daemon=True).start()
        self.wake()

    # ---- sandbox
    def _create_sandbox(self, pod: dict) -> None:
        adopt = self.adopt
        self.sandbox.create(pod, want_ip=(adopt or {}).get("podIP"), reuse=adopt is not None)
        if adopt:
            self._adopt(pod, adopt)
            self.adopt = None
        self.runner.save_state()

    def _adopt(self, pod: dict, record: dict) -> None:
        """Take over the containers a previous runner started (their pid 1 still running)."""
        status = pod.get("status") or {}
        old = {s["name"]: s for s in [*(status.get("initContainerStatuses") or []),
                                      *(status.get("containerStatuses") or [])]}
        for rec in record.get("containers", []):
            c = next((x for x in self.init + self.main if x.cs.name == rec["name"]), None)
            if c is None or not rec.get("pid") or containers.proc_start_time(rec["pid"]) != rec.get("pidStart"):
                continue
            st = old.get(rec["name"], {})
            c.cs.restart_count = st.get("restartCount", 0)
            c.cs.last_terminated = (st.get("lastState") or {}).get("terminated")
            c.inst = containers.adopt(rec["pid"], rec["pidStart"], c.dir, rec.get("startedAt", time.time()), self.wake)
            c.exit_handled = False
            c.cs.state, c.cs.started_at = "running", rec.get("startedAt", time.time())
            c.cs.container_id = rec.get("containerID")
            c.last_start = c.cs.started_at
            try:
                self.sandbox.volumes.setup()
                prepared = self._prepare(pod, c)
            except (VolumeError, ConfigError, ApiError, OSError) as exc:
                prepared = None
                warn("adopted container runs without probes", pod=self.key, container=c.cs.name, error=str(exc))
            c.cs.state, c.cs.reason, c.cs.message = "running", "", ""
            if prepared:
                self._start_probes(c, prepared[1])
            info("container adopted", pod=self.key, container=c.cs.name, pid=rec["pid"])
        for c in self.init:   # init containers of a running pod are done
            if record.get("initialized") and c.inst is None:
                c.cs.state, c.cs.exit_code, c.cs.term_reason = "terminated", 0, "Completed"
                c.exit_handled = True

    # ---- status
    def _write_status(self, pod: dict) -> dict:
        override = self._phase_override
        for c in self.init + self.main:
            self._probe_view(c)
            if self._sandbox_error and c.cs.state == "waiting" and c.inst is None:
                c.cs.reason, c.cs.message = "ContainerCreating", self._sandbox_error
        status = pod_status(pod, [c.cs for c in self.init], [c.cs for c in self.main],
                            pod_ip=self.sandbox.ip if self.sandbox.ready or self.terminal else None,
                            host_ip=self.runner.network.gateway, start_time=self.start_time,
                            sandbox_ready=self.sandbox.ready,
                            phase_override=override[0] if override else None,
                            reason=override[1] if override else None,
                            message=override[2] if override else None)
        server = pod.get("status") or {}
        if self._last_status is None:
            self._last_status = comparable(server)
        # Like the kubelet's status manager: write what changed, write again what did not
        # reach the API server, and put back what someone else changed in the part the
        # kubelet owns (the node lifecycle controller sets Ready=False on a node it thinks
        # is gone and never sets it back; CI once saw a head pod stay unready that way).
        if comparable(status) != self._last_status or owned(server, status) != owned(status, status):
            if self.runner.patch_status(pod, status):
                self._last_status = comparable(status)
                self._status_retry = False
            else:
                self._last_status = {}
                self._status_retry = True
        return status

    # ---- endings
    def _finish(self, phase: str) -> None:
        """A terminal pod: nothing more runs; the sandbox goes, the status stays."""
        self._kill_all(0)
        self.terminal = True
        self.sandbox.teardown()
        info("pod finished", pod=self.key, phase=phase)
        self.runner.save_state()

    # ---- state file
    def record(self) -> dict:
        sb = self.sandbox
        return {"namespace": self.pod["metadata"]["namespace"], "name": self.pod["metadata"]["name"],
                "uid": self.uid, "node": self.pod["spec"].get("nodeName"), "netns": sb.netns,
                "podIP": sb.ip if sb.ready else None, "veth": sb.veth, "terminal": self.terminal,
                "logDir": str(sb.logs), "initialized": all(c.cs.succeeded for c in self.init),
                "containers": [{"name": c.cs.name, "init": c.cs.init, "state": c.cs.state,
                                "pid": c.inst.pid1 if c.inst and c.inst.alive() else None,
                                "pidStart": c.inst.pid1_start if c.inst and c.inst.alive() else None,
                                "startedAt": c.cs.started_at, "restartCount": c.cs.restart_count,
                                "containerID": c.cs.container_id, "log": str(c.log_path)}
                               for c in self.init + self.main]}


def _log_tail(path: Path, lines: int = 80, limit: int = 2048) -> str:
    try:
        data = path.read_bytes()[-limit * 4:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])[-limit:]
