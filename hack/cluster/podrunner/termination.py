"""How a pod's containers stop, as the kubelet stops them: preStop hooks, SIGTERM to
every container's pid 1 at once, SIGKILL when the grace period runs out (a deletion
that shortens it is honoured), then the sandbox goes. A mixin of PodWorker."""
from __future__ import annotations

import signal
import threading
import time

from . import containers
from .probes import run_probe
from .util import info


def field_path(c) -> str:
    """The events' fieldPath of a container."""
    return f"spec.{'initContainers' if c.cs.init else 'containers'}{{{c.cs.name}}}"


class Termination:
    def _kill_all(self, grace: float, deadline_source=None) -> None:
        """preStop hooks, SIGTERM, then SIGKILL after grace; every container in parallel."""
        threads = []
        for c in self.init + self.main:
            if c.probes:
                c.probes.stop()
            if c.inst is not None and c.inst.alive():
                t = threading.Thread(target=self._kill_one, args=(c, grace, deadline_source), daemon=True)
                t.start()
                threads.append(t)
        for t in threads:
            t.join()
        for c in self.init + self.main:
            self._collect_exit(self.pod, c)

    def _kill_one(self, c, grace: float, deadline_source) -> None:
        start = time.monotonic()

        def remaining() -> float:
            g = deadline_source() if deadline_source else grace
            return max(0.0, g - (time.monotonic() - start))

        hook = ((c.spec.get("lifecycle") or {}).get("preStop"))
        if hook and c.target is not None and grace > 0:
            if "sleep" in hook:
                c.inst.wait(min(remaining(), float(hook["sleep"].get("seconds", 0))))
            else:
                ok, msg = run_probe(c.target, {**hook, "timeoutSeconds": max(1, int(remaining()))})
                if not ok:
                    self.runner.events.pod_event(self.pod, "Warning", "FailedPreStopHook",
                                                 f"PreStopHook failed: {msg}", field_path(c))
        c.inst.signal(signal.SIGTERM)
        while not c.inst.done.is_set() and remaining() > 0:
            c.inst.done.wait(min(0.2, remaining()))
        if not c.inst.done.is_set():
            containers.stop(c.inst, 0)

    def _terminate(self, pod: dict) -> None:
        """Graceful deletion: stop the containers within the grace period, tear the
        sandbox down, then delete the Pod object (grace 0, uid precondition)."""
        info("pod deleting", pod=self.key, grace=pod["metadata"].get("deletionGracePeriodSeconds"))
        for c in self.init + self.main:
            if c.inst is not None and c.inst.alive():
                self.runner.events.pod_event(pod, "Normal", "Killing", f"Stopping container {c.cs.name}", field_path(c))

        def grace() -> float:
            with self.cond:
                g = self.pod["metadata"].get("deletionGracePeriodSeconds")
            return float(g if g is not None else self.pod["spec"].get("terminationGracePeriodSeconds", 30))

        self._kill_all(grace(), grace)
        if not self.terminal:
            all_ok = all(c.cs.state == "terminated" and c.cs.exit_code == 0 for c in self.main)
            self._phase_override = ("Succeeded" if all_ok else "Failed", None, None)
            try:
                self._write_status(self.pod)
            except Exception:  # noqa: BLE001 - the delete below matters more
                pass
        self.sandbox.teardown()
        self.terminal = True
        self.runner.delete_pod(self.pod)
        info("pod deleted", pod=self.key)

    def _node_shutdown(self, reason: str) -> None:
        grace = min(float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)), self.runner.shutdown_grace)
        self._kill_all(grace)
        if not self.terminal and not self.pod["metadata"].get("deletionTimestamp"):
            self._phase_override = ("Failed", "Terminated", reason)
            try:
                self._write_status(self.pod)
            except Exception:  # noqa: BLE001 - the apiserver may be gone already
                pass
        self.sandbox.teardown()
