"""Pod status as the kubelet writes it, from the runner's view of the pod (pure functions)."""
from __future__ import annotations

from dataclasses import dataclass

from .util import now_rfc3339


@dataclass
class CState:
    """What the runner knows about one container (its current instance and the last one)."""
    name: str
    image: str
    init: bool = False
    restart_count: int = 0
    state: str = "waiting"                 # waiting | running | terminated
    reason: str = "ContainerCreating"      # waiting reason
    message: str = ""                      # waiting message
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    term_reason: str | None = None         # Completed | Error | StartError | ContainerStatusUnknown
    term_message: str = ""
    container_id: str | None = None
    last_terminated: dict | None = None    # lastState.terminated as written
    ready: bool = False
    started: bool = False                  # startup probe passed (or none)
    image_id: str = ""

    def terminated_dict(self) -> dict:
        t = {"exitCode": self.exit_code if self.exit_code is not None else 137,
             "reason": self.term_reason or ("Completed" if self.exit_code == 0 else "Error"),
             "startedAt": now_rfc3339(self.started_at) if self.started_at else None,
             "finishedAt": now_rfc3339(self.finished_at) if self.finished_at else None}
        if self.term_message:
            t["message"] = self.term_message
        if self.container_id:
            t["containerID"] = self.container_id
        if self.exit_code is not None and self.exit_code > 128:
            t["signal"] = self.exit_code - 128
        return t

    @property
    def succeeded(self) -> bool:
        return self.state == "terminated" and self.exit_code == 0


def container_status(c: CState) -> dict:
    if c.state == "running":
        state = {"running": {"startedAt": now_rfc3339(c.started_at)}}
    elif c.state == "terminated":
        state = {"terminated": c.terminated_dict()}
    else:
        w = {"reason": c.reason}
        if c.message:
            w["message"] = c.message
        state = {"waiting": w}
    out = {"name": c.name, "image": c.image, "imageID": c.image_id, "state": state,
           "lastState": {"terminated": c.last_terminated} if c.last_terminated else {},
           "ready": bool(c.ready and c.state == "running"), "restartCount": c.restart_count,
           "started": bool(c.started and c.state == "running")}
    if c.container_id and c.state != "waiting":
        out["containerID"] = c.container_id
    elif c.last_terminated and c.last_terminated.get("containerID"):
        out["containerID"] = c.last_terminated["containerID"]
    return out


def phase(restart_policy: str, init: list[CState], main: list[CState]) -> str:
    """kubelet getPhase: Pending until the init containers succeeded (Failed when one
    failed under restartPolicy Never), then from the regular containers."""
    for c in init:
        if c.succeeded:
            continue
        if restart_policy == "Never" and c.state == "terminated":
            return "Failed"
        return "Pending"
    running = waiting = stopped = succeeded = 0
    for c in main:
        if c.state == "running":
            running += 1
        elif c.state == "terminated":
            stopped += 1
            succeeded += c.exit_code == 0
        elif c.last_terminated:
            stopped += 1   # waiting to restart: counts as stopped
            succeeded += c.last_terminated.get("exitCode") == 0
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if restart_policy == "Always":
        return "Running"
    if stopped == succeeded:
        return "Succeeded"
    if restart_policy == "Never":
        return "Failed"
    return "Running"


def _condition(ctype: str, ok: bool, prev: dict[str, dict], now: str, reason: str = "",
               message: str = "") -> dict:
    status = "True" if ok else "False"
    old = prev.get(ctype)
    cond = {"type": ctype, "status": status, "lastProbeTime": None,
            "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == status
            and old.get("lastTransitionTime") else now}
    if not ok and reason:
        cond["reason"] = reason
        if message:
            cond["message"] = message
    return cond


def pod_status(pod: dict, init: list[CState], main: list[CState], *, pod_ip: str | None,
               host_ip: str | None, start_time: float, sandbox_ready: bool,
               phase_override: str | None = None, reason: str | None = None,
               message: str | None = None) -> dict:
    """The status subresource body (conditions merge by type with ones we do not own)."""
    spec = pod.get("spec", {})
    old = pod.get("status", {}) or {}
    prev = {c["type"]: c for c in old.get("conditions") or []}
    now = now_rfc3339()
    ph = phase_override or phase(spec.get("restartPolicy", "Always"), init, main)
    terminal = ph in ("Succeeded", "Failed")
    incomplete = [c.name for c in init if not c.succeeded]
    unready = [c.name for c in main if not (c.ready and c.state == "running")]
    gates = [g["conditionType"] for g in spec.get("readinessGates") or []
             if prev.get(g["conditionType"], {}).get("status") != "True"]
    conds = [_condition("PodReadyToStartContainers", sandbox_ready and not terminal, prev, now)]
    conds.append(_condition("Initialized", not incomplete, prev, now, "ContainersNotInitialized",
                            f"containers with incomplete status: [{' '.join(incomplete)}]"))
    if terminal:
        conds.append(_condition("ContainersReady", False, prev, now, "PodCompleted"))
        conds.append(_condition("Ready", False, prev, now, "PodCompleted"))
    else:
        msg = f"containers with unready status: [{' '.join(unready)}]"
        conds.append(_condition("ContainersReady", not unready, prev, now, "ContainersNotReady", msg))
        if unready:
            conds.append(_condition("Ready", False, prev, now, "ContainersNotReady", msg))
        else:
            conds.append(_condition("Ready", not gates, prev, now, "ReadinessGatesNotReady",
                                    f"corresponding condition of pod readiness gate \"{' '.join(gates)}\" "
                                    f"does not exist."))
    status: dict = {"phase": ph, "conditions": conds, "startTime": now_rfc3339(start_time),
                    "containerStatuses": [container_status(c) for c in main]}
    if init:
        status["initContainerStatuses"] = [container_status(c) for c in init]
    if host_ip:
        status["hostIP"] = host_ip
        status["hostIPs"] = [{"ip": host_ip}]
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    return status


def comparable(status: dict) -> dict:
    """A status without the condition timestamps that alone would not justify a write."""
    out = dict(status)
    out["conditions"] = [{k: v for k, v in c.items() if k not in ("lastTransitionTime", "lastProbeTime")}
                         for c in status.get("conditions", [])]
    return out


def owned(status: dict, ours: dict) -> tuple:
    """The phase and the status of each condition type ``ours`` sets, as ``status`` has
    them: what others may overwrite and the kubelet must put back."""
    types = sorted(c["type"] for c in ours.get("conditions", []))
    held = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return status.get("phase"), tuple((t, held.get(t)) for t in types)
