"""The faults the soak injects, each a real one done to a real process.

operator_kill      SIGKILL of the operator's process group, then a new operator
operator_stall     SIGSTOP, a few seconds (longer than its progress interval), SIGCONT
driver_kill        SIGKILL of a running driver (its pid from Ray's job table, driver_info)
rank_kill          SIGKILL of a rank actor's process (State API: vj-...-rank<i>, its pid)
delete_job         `kubectl delete` of a job while it runs
apiserver_restart  kube-apiserver stopped and started again (localcluster.py
                   restart-apiserver: same port, etcd keeps its data)
dashboard_outage   the Ray dashboard (Jobs and State APIs) frozen for a few seconds: see
                   DASHBOARD_OUTAGE for why it is frozen rather than killed
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

KINDS = ("operator_kill", "operator_stall", "driver_kill", "rank_kill", "delete_job", "apiserver_restart",
         "dashboard_outage")
# What a dashboard outage can be with a head started by `ray start --head --block`
# (read in ray/scripts/scripts.py and ray/_private/node.py, Ray 2.60): Ray never
# restarts its dashboard; `--block` polls its children every second and, when one
# exits with a code other than 0 or SIGTERM's (a SIGKILL), kills the whole head; a
# SIGTERM leaves the dashboard dead for good (no Jobs API until the head restarts).
DASHBOARD_OUTAGE = ("SIGSTOP/SIGCONT of the dashboard process (it stops answering, connections hang): Ray does not "
                    "restart a dead dashboard, and `ray start --block` tears the whole head down when one is "
                    "SIGKILLed, so a kill-and-come-back outage is not possible with Ray 2.60")
# Faults that cost the job an attempt: at most this many per job, so a job that
# fails has not simply run out of attempts (VIDEOJOB_MAX_ATTEMPTS is set well above).
MAX_HITS_PER_JOB = 2


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pgrp(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (OSError, IndexError, ValueError):
        return None


class Faults:
    def __init__(self, rng, operator, head, cluster, observer, ray, max_deletions: int):
        self.rng, self.operator, self.head, self.cluster = rng, operator, head, cluster
        self.observer, self.ray, self.max_deletions = observer, ray, max_deletions
        self.hits: dict[str, int] = {}   # uid (or group) -> attempt-costing faults
        self.deleted: dict[str, dict] = {}  # uid -> name, when

    def inject(self, kind: str) -> dict:
        """Do one fault of ``kind``; what was done ({"skipped": why} when there was no target)."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")
        return getattr(self, kind)()

    # -- the operator --------------------------------------------------------------

    def operator_kill(self) -> dict:
        pid = self.operator.process.pid
        self.operator.kill()
        pause = round(self.rng.uniform(0, 3), 1)
        time.sleep(pause)
        self.operator.start()
        return {"target": f"operator pid {pid}", "detail": f"down {pause}s, then start {self.operator.starts}"}

    def operator_stall(self) -> dict:
        pgid = os.getpgid(self.operator.process.pid)
        stall = round(self.rng.uniform(2, 6), 1)
        os.killpg(pgid, signal.SIGSTOP)
        try:
            time.sleep(stall)
        finally:
            os.killpg(pgid, signal.SIGCONT)
        return {"target": f"operator pgid {pgid}", "detail": f"stopped {stall}s"}

    # -- Ray -------------------------------------------------------------------------

    def driver_kill(self) -> dict:
        drivers = [d for d in self.observer.live_drivers()
                   if self.hits.get(d["uid"], 0) < MAX_HITS_PER_JOB and d["uid"] not in self.deleted
                   and "videojob_runtime.driver" in _cmdline(d["driverPid"])]
        if not drivers:
            return {"skipped": "no running driver (not yet hit twice) with a live pid"}
        victim = self.rng.choice(sorted(drivers, key=lambda d: d["sid"]))
        os.kill(victim["driverPid"], signal.SIGKILL)
        self.hits[victim["uid"]] = self.hits.get(victim["uid"], 0) + 1
        return {"target": victim["sid"], "detail": f"driver pid {victim['driverPid']} of {victim['name']}"}

    def rank_kill(self) -> dict:
        from videojob.controller.groups import group_of, owner_uid

        try:
            actors = self.ray.actors("vj-")
        except Exception as exc:  # noqa: BLE001 - the dashboard may be frozen by an earlier fault
            return {"skipped": f"State API: {exc}"}
        ranks = [a for a in actors if "-rank" in (a.get("name") or "") and a.get("pid")
                 and self.hits.get(group_of(a["name"]) or "", 0) < MAX_HITS_PER_JOB
                 and self.hits.get(owner_uid(group_of(a["name"]) or "") or "", 0) < MAX_HITS_PER_JOB]
        if not ranks:
            return {"skipped": "no live rank actor (not yet hit twice)"}
        victim = self.rng.choice(sorted(ranks, key=lambda a: a["name"]))
        pid = int(victim["pid"])
        if not _cmdline(pid):
            return {"skipped": f"rank {victim['name']} pid {pid} already gone"}
        os.kill(pid, signal.SIGKILL)
        group = group_of(victim["name"])
        # Count it against the group and against every job last seen running on it.
        self.hits[group] = self.hits.get(group, 0) + 1
        for uid, job in self.observer.snapshot()[1].items():
            if (job.get("phase") == "Running"
                    and group in {a.get("group") for a in (job.get("status") or {}).get("attempts") or []}):
                self.hits[uid] = self.hits.get(uid, 0) + 1
        return {"target": victim["name"], "detail": f"pid {pid}"}

    def dashboard_outage(self) -> dict:
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                and _pgrp(int(p.name)) == self.head.process.pid and "dashboard/dashboard.py" in _cmdline(int(p.name))]
        if not pids:
            return {"skipped": "the head's dashboard process was not found"}
        outage = round(self.rng.uniform(3, 8), 1)
        os.kill(pids[0], signal.SIGSTOP)
        try:
            time.sleep(outage)
        finally:
            os.kill(pids[0], signal.SIGCONT)
        return {"target": f"dashboard pid {pids[0]}", "detail": f"frozen {outage}s"}

    # -- Kubernetes ----------------------------------------------------------------

    def delete_job(self) -> dict:
        if len(self.deleted) >= self.max_deletions:
            return {"skipped": f"already deleted {len(self.deleted)} (the most this soak deletes)"}
        running = [j for j in self.observer.running() if j["uid"] not in self.deleted]
        if not running:
            return {"skipped": "no job seen Running"}
        victim = self.rng.choice(sorted(running, key=lambda j: j["name"]))
        # The sample may be stale (the API server was restarting): read the phase now.
        now = self.cluster.kubectl("get", "vj", victim["name"], "-n", self.observer.namespace,
                                   "-o", "jsonpath={.status.phase}", check=False)
        if now.returncode != 0 or now.stdout.strip() != "Running":
            return {"skipped": f"{victim['name']} is {now.stdout.strip() or now.stderr.strip()[:100]}, not Running"}
        # Recorded before the delete: a job whose delete fails half-way still counts as deleted.
        self.deleted[victim["uid"]] = {"name": victim["name"], "at": time.time()}
        self.cluster.kubectl("delete", "vj", victim["name"], "-n", self.observer.namespace, "--wait=false")
        return {"target": victim["name"], "detail": f"uid {victim['uid']}"}

    def apiserver_restart(self) -> dict:
        t0 = time.monotonic()
        new = self.cluster.restart_apiserver()
        return {"target": self.cluster.server, "detail": f"new pid {new['pid']}, down {time.monotonic() - t0:.1f}s"}
