"""Operator restart and deletion benchmark: 10,000 queued and 20,000 finished VideoJobs.

Goals (issue 22): a restarted operator has rebuilt its books and made its
first admission within 60 s of its start; then, while 10,000 jobs wait,
deleting 1,000 of the queued ones has every finalizer done within 60 s of the
first DELETE.

Setup, before the operator starts: the jobs as a stopped operator leaves them.
Every job has the operator's finalizer. ``--unfinished`` jobs (10,000) are
Queued with the plan the operator's own planner gives them (the plan a queued
job's status holds; ``JobLifecycle._plan_status``), ``--finished`` jobs (20,000)
Succeeded within the last day (inside the default ``ttlSecondsAfterFinished``,
so none expires here) with their one attempt. The jobs and the fleet are
operator_load.py's (``loadkit``): the loopback kube-apiserver, the CRD, the
operator as a subprocess authenticated as the chart's ServiceAccount, and Ray
replaced by ``InstantRay``, whose drivers here run for ``--delay-s`` (an hour):
the jobs admitted stay Running, so the rest stay queued.

Measured, from the operator's process start:
  healthySeconds         /healthz answers: ``Controller.start`` has rebuilt the books
                         (it serves /healthz only after the rebuild)
  firstAdmissionSeconds  a job's status shows Running (seen on a watch)
  resumedSeconds         every unfinished job is back in the books: admitted
                         (Running) or parked in the queue (the runner's gauge)
then the deletion: the ``--delete`` queued jobs with the lowest priority are
DELETEd (8 at once) and each is gone from the API server (seen on the watch):
  deleteSeconds          first DELETE to the last job gone
and afterwards the books against the API server: the operator's
``videojob_queue_length`` equals the Queued jobs that remain, and its
``videojob_jobs`` phase counts equal the jobs by phase.

Writes benchmarks/results/operator_restart.json (machine.write_result). Exit 1
when a step did not finish; a missed goal is a result (goalMet: false).

    python benchmarks/operator_restart.py [--unfinished 10000] [--finished 20000] [--delete 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_ray import proc_status  # noqa: E402
from loadkit import (INVENTORY, Cluster, Operator, Tracker, api_for,  # noqa: E402
                     cpu_seconds, create_all, delete_jobs, finish, log, manifests, prepare_namespace,
                     send_all, wait_until)
from machine import write_result  # noqa: E402

GOAL_RESTART_SECONDS = 60  # books rebuilt and the first admission, from the operator's start
GOAL_DELETE_SECONDS = 60  # the finalizers of the deleted queued jobs, from the first DELETE
FINALIZER = "videojob.io/finalizer"


def unfinished_names(docs: list[dict[str, Any]], unfinished: int) -> set[str]:
    """``unfinished`` names spread evenly over the jobs (in kopf's listing order, by name,
    queued and finished jobs come mixed, as they do in a real namespace)."""
    step = len(docs) / unfinished if unfinished else 0
    return {docs[int(k * step)]["metadata"]["name"] for k in range(unfinished)}


def stopped_operator_statuses(docs: list[dict[str, Any]], unfinished: set[str]) -> dict[str, dict[str, Any]]:
    """name -> the status a stopped operator left: the ``unfinished`` Queued with their
    plan, the others Succeeded (one attempt, finished in the last day)."""
    from videojob.api import parse_videojob
    from videojob.controller.lifecycle import JobLifecycle
    from videojob.inventory import parse_inventory
    from videojob.planner.classes import plan_classes

    inventory = parse_inventory(INVENTORY)
    plans: dict[str, dict[str, Any]] = {}  # the planner's answer depends only on the spec's shape
    now = datetime.now(timezone.utc)
    out: dict[str, dict[str, Any]] = {}
    place = 0
    for i, doc in enumerate(docs):
        name = doc["metadata"]["name"]
        spec = {k: v for k, v in doc["spec"].items() if k not in ("seed", "output")}
        spec["resources"] = {k: v for k, v in spec.get("resources", {}).items() if k != "priority"}
        shape = json.dumps(spec, sort_keys=True)  # what the plan depends on
        if shape not in plans:
            body = {**doc, "metadata": {**doc["metadata"], "namespace": "bench", "uid": "bench"}}
            choice = plan_classes(parse_videojob(body).spec, inventory)
            if choice.chosen is None:
                raise SystemExit(f"operator_restart: {name} does not fit the benchmark's fleet: {choice.reason}")
            plans[shape] = JobLifecycle._plan_status(choice)
        plan = plans[shape]
        planned = {"type": "Planned", "status": "True", "reason": "Planned", "message": plan["summary"],
                   "lastTransitionTime": (now - timedelta(hours=2)).isoformat()}
        if name in unfinished:
            place += 1
            out[name] = {"phase": "Queued", "plan": plan, "conditions": [planned], "queue": {"position": place},
                         "message": "waiting for GPUs (left by the benchmark's stopped operator)"}
            continue
        ended = now - timedelta(seconds=60 + (i * 37) % 86_000)
        started = ended - timedelta(seconds=plan["estimatedSeconds"])
        attempt = {"number": 1, "plan": plan, "result": "Succeeded", "reason": "Succeeded",
                   "startedAt": started.isoformat(), "finishedAt": ended.isoformat(),
                   "submissionId": f"vj-bench-{name}-a1"}
        out[name] = {"phase": "Succeeded", "plan": plan, "attempts": [attempt], "message": "succeeded",
                     "conditions": [planned, {"type": "Completed", "status": "True", "reason": "Succeeded",
                                              "lastTransitionTime": ended.isoformat()}],
                     "startTime": started.isoformat(), "completionTime": ended.isoformat()}
    return out


def patch_statuses(api, namespace: str, statuses: dict[str, dict[str, Any]], threads: int) -> None:
    """Write each job's status subresource (a merge patch), ``threads`` at once."""
    send_all(api, namespace, "PATCH", [(name, f"/{name}/status", {"status": status})
                                       for name, status in statuses.items()],
             threads, content_type="application/merge-patch+json", accept=(200,))


def operator_metrics(port: int) -> dict[str, float]:
    """The operator's videojob_jobs{phase} and videojob_queue_length, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("videojob_jobs{", "videojob_queue_length ")):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def memory_census(operator: Operator, workdir: Path) -> list[str]:
    """The operator's live objects by type (fake_ray.py's census, asked for with a file),
    the largest first: where a queued job's memory goes."""
    target = workdir / "census.txt"
    (workdir / "census.request").write_text("")
    if not wait_until("the operator's memory census", target.exists, time.monotonic() + 120, interval=0.5):
        return []
    return target.read_text().splitlines()[:30]


def run(args: argparse.Namespace) -> int:
    loadavg_before = os.getloadavg()
    cluster = Cluster()
    namespace = f"vj-restart-{secrets.token_hex(4)}"
    workdir = Path(tempfile.mkdtemp(prefix="vj-operator-restart-"))
    admin = api_for(cluster.kubeconfig, pool=32)
    operator: Operator | None = None
    tracker: Tracker | None = None
    result: dict[str, Any] = {}
    ok = False
    try:
        kubeconfig = prepare_namespace(cluster, namespace, workdir)
        docs = manifests(args.unfinished + args.finished)
        for doc in docs:
            doc["metadata"]["finalizers"] = [FINALIZER]
        unfinished = unfinished_names(docs, args.unfinished)
        statuses = stopped_operator_statuses(docs, unfinished)
        setup_start = time.monotonic()
        create_all(admin, namespace, docs, args.threads)
        patch_statuses(admin, namespace, statuses, args.threads)
        setup_seconds = time.monotonic() - setup_start
        log(f"{len(docs)} jobs created and given their statuses in {setup_seconds:.0f} s")
        tracker = Tracker(admin, namespace).start()
        if not tracker.listed.wait(300):
            raise RuntimeError(f"could not list the VideoJobs of {namespace}: {tracker.errors[-3:]}")
        if tracker.counts()["seen"] != len(docs):
            raise RuntimeError(f"listed {tracker.counts()['seen']} jobs, created {len(docs)}")

        timeline: list[dict[str, Any]] = []
        t0 = time.monotonic()
        operator = Operator(namespace, kubeconfig, workdir, args.delay_s, None, extra_args=(
            ["--memory-profile", args.memory_profile] if args.memory_profile else None))

        def sample() -> None:
            if timeline and time.monotonic() - t0 - timeline[-1]["t"] < 1.0:
                return
            status, stats = proc_status(operator.pid), operator.stats()
            timeline.append({"t": round(time.monotonic() - t0, 1), "running": len(tracker.running),
                             "parked": stats.get("parked"), "deleted": len(tracker.deleted),
                             "operatorRssMiB": round(status.get("VmRSS", 0) / 1024, 1),
                             "operatorThreads": status.get("Threads")})

        deadline = t0 + args.deadline_s
        healthy = wait_until("the operator's /healthz (the books rebuilt)", operator.healthy, deadline, sample,
                             interval=0.1)
        healthy_at = time.monotonic() if healthy else None
        admitted = wait_until("the first admission", lambda: bool(tracker.running), deadline, sample, 0.1)
        first_admission_at = min(tracker.running.values()) if admitted else None

        def resumed() -> bool:  # every unfinished job admitted or parked in the queue
            return len(tracker.running) + int(operator.stats().get("parked") or 0) >= len(unfinished)

        all_resumed = wait_until("every unfinished job back in the books", resumed, deadline, sample, 0.5)
        resumed_at = time.monotonic() if all_resumed else None
        op_cpu_resumed = cpu_seconds(operator.pid)
        stats_resumed = operator.stats()
        census = memory_census(operator, workdir)
        log(f"healthy {healthy_at and healthy_at - t0:.1f} s, first admission "
            f"{first_admission_at and first_admission_at - t0:.1f} s, resumed {resumed_at and resumed_at - t0:.1f} s")

        # The deletion: the lowest-priority queued jobs (the queue's tail: the jobs a user cancels).
        with tracker.lock:
            queued = [d for d in docs if d["metadata"]["name"] in unfinished
                      and tracker.phases.get(d["metadata"]["name"]) == "Queued"]
        queued.sort(key=lambda d: (d["spec"]["resources"]["priority"], d["metadata"]["name"]))
        doomed = [d["metadata"]["name"] for d in queued[:args.delete]]
        delete_start = time.monotonic()
        delete_jobs(admin, namespace, doomed, threads=8)
        requests_done = time.monotonic()
        gone = wait_until(f"the {len(doomed)} deleted jobs gone (their finalizers)",
                          lambda: all(n in tracker.deleted for n in doomed), delete_start + args.deadline_s,
                          sample, 0.25)
        delete_seconds = max(tracker.deleted[n] for n in doomed) - delete_start if gone else None

        # The books against the API server, once the operator has caught up (its status
        # writes and metrics follow the watch; a bounded wait, the last look recorded).
        def books() -> tuple[dict[str, float], dict[str, int]]:
            with tracker.lock:
                phases = Counter(p for n, p in tracker.phases.items() if n not in tracker.deleted)
            return operator_metrics(operator.port), dict(phases)

        def books_agree() -> bool:
            metrics, phases = books()
            return (metrics.get("videojob_queue_length") == phases.get("Queued", 0)
                    and all(metrics.get(f'videojob_jobs{{phase="{p}"}}', 0) == n for p, n in phases.items()))

        agree = wait_until("the operator's books to equal the API server's jobs", books_agree,
                           time.monotonic() + 60, sample, 1.0)
        metrics_end, phases_end = books()
        peak = proc_status(operator.pid)

        restart_seconds = (max(healthy_at, first_admission_at) - t0) if healthy_at and first_admission_at else None
        goals = {"restart": restart_seconds is not None and restart_seconds <= GOAL_RESTART_SECONDS,
                 "delete": delete_seconds is not None and delete_seconds <= GOAL_DELETE_SECONDS,
                 "booksAgree": agree}
        result = {
            "benchmark": "operator_restart",
            "goalRestartSeconds": GOAL_RESTART_SECONDS, "goalDeleteSeconds": GOAL_DELETE_SECONDS,
            "goalMet": all(goals.values()), "goalsMet": goals,
            "unfinishedJobs": args.unfinished, "finishedJobs": args.finished, "deletedJobs": len(doomed),
            "setupSeconds": round(setup_seconds, 1),
            "healthySeconds": round(healthy_at - t0, 2) if healthy_at else None,
            "firstAdmissionSeconds": round(first_admission_at - t0, 2) if first_admission_at else None,
            "restartSeconds": round(restart_seconds, 2) if restart_seconds is not None else None,
            "resumedSeconds": round(resumed_at - t0, 2) if resumed_at else None,
            "deleteSeconds": round(delete_seconds, 2) if delete_seconds is not None else None,
            "deleteRequestsSeconds": round(requests_done - delete_start, 2),
            "operatorMemoryCensusAfterResume": census,
            "books": {"agree": agree, "operatorMetrics": metrics_end, "apiServerPhases": phases_end},
            "operator": {
                "peakRssMiB": round(peak.get("VmHWM", 0) / 1024, 1),
                "peakThreads": max([row.get("operatorThreads") or 0 for row in timeline], default=None),
                "cpuSecondsUntilResumed": round(op_cpu_resumed, 1) if op_cpu_resumed is not None else None,
                "callsUntilResumed": stats_resumed.get("calls"),
                "statusWritesUntilResumed": stats_resumed.get("statusWrites"),
                "calls": operator.stats().get("calls"),
            },
            "settings": {"driverSeconds": args.delay_s, "inventory": INVENTORY, "deleteThreads": 8,
                         "setupThreads": args.threads,
                         "deleted": "the queued jobs of lowest priority",
                         "operator": stats_resumed.get("operatorSettings"),
                         "fakeRay": "InstantRay (benchmarks/fake_ray.py): drivers run --delay-s, then SUCCEEDED"},
            "machineLoad": {"loadavgBefore": [round(x, 2) for x in loadavg_before],
                            "loadavgAfter": [round(x, 2) for x in os.getloadavg()]},
            "trackerErrors": tracker.errors[:10],
            "timeline": timeline,
            "notes": "Seconds are from the operator's process start (restart) or the first DELETE (deletion), "
                     "milestones as seen on this script's watch of the namespace. The jobs' statuses were "
                     "written before the operator started, as a stopped operator leaves them; the Running "
                     "jobs of that operator are not modelled (InstantRay keeps no drivers across processes).",
        }
        ok = healthy and admitted and all_resumed and gone
        # Written before the clean-up: that deletes what is left, which may take long.
        out = write_result("operator_restart.json", result, Path(args.out) if args.out else None)
    finally:
        finish(cluster, admin, namespace, operator, tracker)
    if not result:
        return 1
    print(f"restart with {args.unfinished} queued + {args.finished} finished jobs: healthy in "
          f"{result['healthySeconds']} s, first admission in {result['firstAdmissionSeconds']} s, all resumed in "
          f"{result['resumedSeconds']} s; deleting {len(doomed)} queued: gone in {result['deleteSeconds']} s; "
          f"books agree: {agree}; goals {'met' if result['goalMet'] else 'NOT met'} {goals}; operator peak RSS "
          f"{result['operator']['peakRssMiB']} MiB, {result['operator']['peakThreads']} threads\nwrote {out}")
    if operator is not None and ok:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    elif operator is not None:
        log(f"kept the operator's log: {operator.log_path}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unfinished", type=int, default=10_000, help="queued jobs left by the stopped operator")
    parser.add_argument("--finished", type=int, default=20_000, help="succeeded jobs, kept (within their TTL)")
    parser.add_argument("--delete", type=int, default=1_000, help="queued jobs deleted after the restart")
    parser.add_argument("--delay-s", type=float, default=3600.0, help="seconds each fake driver runs")
    parser.add_argument("--threads", type=int, default=8, help="threads creating the jobs and their statuses")
    parser.add_argument("--deadline-s", type=float, default=900.0, help="give up on a step after this long")
    parser.add_argument("--out", help="result file (default: benchmarks/results/operator_restart.json)")
    parser.add_argument("--memory-profile", help="diagnosis only: the operator's top memory sites, to this file")
    args = parser.parse_args(argv)
    if args.delete > args.unfinished:
        parser.error("--delete must not exceed --unfinished")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
