"""One seeded soak: the parts up, jobs created and faults injected on a seeded
schedule, every job waited for, then the checks (checks.py). ``run`` returns
the figures; the CLI (__main__.py) and tests/test_chaos.py write them."""

from __future__ import annotations

import random
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import yaml

from . import checks
from .faults import DASHBOARD_OUTAGE, KINDS, Faults
from machine import REPO
from .world import DEFAULT_CLUSTER_DIR, Cluster, Observer, log, wait

sys.path.insert(0, str(REPO / "tests"))
from helpers import RayHead  # noqa: E402
from operator_harness import OperatorProcess, tiny_job  # noqa: E402

WARM_TTL_S, SWEEP_S = 20.0, 3.0
# Three pods' worth of CPU ranks: two 1-rank pods and one 2-rank pod (4 ranks, the
# Ray head offers 2 CPUs at 0.5 a rank): 1-rank and 2-rank jobs share and queue.
CLASSES = [{"name": "cpu1", "gpusPerPod": 1, "maxPods": 2}, {"name": "cpu2", "gpusPerPod": 2, "maxPods": 1}]
FAULT_EVERY_S = 12.0


def job_docs(rng: random.Random, count: int) -> list[dict]:
    """``count`` tiny jobs: half one rank, half two (ulysses 2); mixed priorities and steps."""
    docs = []
    for i in range(count):
        doc = tiny_job(f"chaos-{i:03d}", steps=rng.randint(3, 14))
        if rng.random() < 0.5:
            doc["spec"].pop("parallel", None)
            doc["spec"]["resources"] = {"maxGPUs": 1}
        doc["spec"]["resources"]["priority"] = rng.choice([-10, 0, 0, 5, 20])
        doc["spec"]["seed"] = rng.randint(0, 1000)
        docs.append(doc)
    return docs


def schedule(rng: random.Random, jobs: int, minutes: float) -> tuple[list[float], list[tuple[float, str]]]:
    """When each job is created (the first half of the soak) and the faults: (at, kind),
    from 5 s to three quarters of it; the first len(KINDS) are every kind once."""
    span = minutes * 60
    creates = sorted(rng.uniform(0, span * 0.5) for _ in range(jobs))
    count = max(len(KINDS), round(span * 0.75 / FAULT_EVERY_S))
    kinds = rng.sample(KINDS, len(KINDS)) + [rng.choice(KINDS) for _ in range(count - len(KINDS))]
    times = sorted(rng.uniform(5, span * 0.75) for _ in range(count))
    return creates, list(zip(times, kinds))


def operator_env(head: RayHead, workdir: Path) -> dict[str, str]:
    token = workdir / "ray-token"
    token.write_text(head.token)
    inventory = workdir / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"device": "cpu", "classes": [
        {"gpuMemory": "8Gi", "hostMemory": "16Gi", "gpuType": "generic", **c} for c in CLASSES]}))
    return {"VIDEOJOB_RAY_MODE": "address", "VIDEOJOB_RAY_DASHBOARD_URL": head.dashboard_url,
            "VIDEOJOB_RAY_TOKEN_FILE": str(token), "VIDEOJOB_DRIVER_PYTHON": sys.executable,
            "VIDEOJOB_INVENTORY_FILE": str(inventory), "VIDEOJOB_CPUS_PER_RANK": "0.5",
            "VIDEOJOB_WARM_GROUP_TTL_S": str(WARM_TTL_S), "VIDEOJOB_SWEEP_INTERVAL_S": str(SWEEP_S),
            "VIDEOJOB_RETRY_BACKOFF_S": "1", "VIDEOJOB_MAX_ATTEMPTS": "8"}


def run(seed: int, jobs: int, minutes: float, workdir: Path | None = None, cluster_dir: Path = DEFAULT_CLUSTER_DIR,
        cluster_state: dict | None = None, finish_grace_s: float | None = None) -> dict:
    """The soak; its figures and ``problems`` (empty when every check passed).
    ``cluster_state``: a cluster someone else holds (else one is started in ``cluster_dir``)."""
    if jobs < 1 or minutes <= 0:
        raise ValueError(f"--jobs must be >= 1 and --minutes > 0, got {jobs} and {minutes}")
    rng = random.Random(seed)
    docs = job_docs(rng, jobs)
    creates, faults_planned = schedule(rng, jobs, minutes)
    workdir = Path(workdir or tempfile.mkdtemp(prefix="vj-chaos-"))
    outputs = workdir / "outputs"
    outputs.mkdir(parents=True, exist_ok=True)
    log(f"seed {seed}: {jobs} jobs, {len(faults_planned)} faults over {minutes} min; logs in {workdir}")
    cluster = Cluster(cluster_dir, cluster_state)
    namespace = f"vj-chaos-{secrets.token_hex(3)}"
    result: dict = {"seed": seed, "jobs": jobs, "minutes": minutes, "workdir": str(workdir),
                    "dashboardOutage": DASHBOARD_OUTAGE}
    try:
        cluster.apply_crd()
        cluster.kubectl("create", "namespace", namespace)
        head_env = {"VIDEOJOB_OUTPUT_ROOT": str(outputs), "OMP_NUM_THREADS": "1"}
        with RayHead(num_cpus=2, dashboard=True, env=head_env) as head, \
                OperatorProcess(cluster, namespace, workdir, operator_env(head, workdir)) as operator:
            result["rayLogs"], result["operatorLog"] = str(workdir / "ray-logs"), str(operator.log_path)
            try:
                _soak(rng, docs, creates, faults_planned, minutes, cluster, namespace, head, operator, outputs,
                      result, finish_grace_s)
            finally:
                _keep_ray_logs(head, workdir / "ray-logs")
                _delete_jobs(cluster, namespace)
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        cluster.release()
    return result


def _delete_jobs(cluster: Cluster, namespace: str) -> None:
    """Delete the jobs while the operator still runs (its finalizer lets them go); any left
    after two minutes lose the finalizer, so the namespace does not stay Terminating for ever."""
    res = cluster.kubectl("delete", "vj", "--all", "-n", namespace, "--wait=true", "--timeout=120s",
                          check=False, timeout=180)
    if res.returncode != 0:
        log(f"jobs still there after 120 s ({res.stderr.strip()[-300:]}); removing their finalizers")
        names = cluster.kubectl("get", "vj", "-n", namespace, "-o", "name", check=False).stdout.split()
        for name in names:
            cluster.kubectl("patch", name, "-n", namespace, "--type=merge", "-p",
                            '{"metadata":{"finalizers":null}}', check=False)


def _keep_ray_logs(head: RayHead, keep: Path) -> None:
    """RayHead removes its temp dir on exit: keep the drivers', dashboard's, raylet's and GCS's logs."""
    logs = head.temp_dir / "session_latest" / "logs"
    keep.mkdir(parents=True, exist_ok=True)
    for pattern in ("job-driver-*.log", "dashboard*.log", "raylet.out", "gcs_server.out"):
        for path in logs.glob(pattern):
            shutil.copy2(path, keep / path.name)


def _soak(rng, docs, creates, faults_planned, minutes, cluster, namespace, head, operator, outputs, result,
          finish_grace_s) -> None:
    from videojob.raycluster.client import HttpRayClient

    ray = HttpRayClient(head.dashboard_url, token=head.token, timeout_s=10, retries=6)
    observer = Observer(head.dashboard_url, head.token, cluster, namespace).start()
    faults = Faults(rng, operator, head, cluster, observer, ray, max_deletions=max(1, len(docs) // 8))
    done: list[dict] = []
    problems: list[str] = []
    t0 = time.monotonic()
    pending_jobs, pending_faults = list(zip(creates, docs)), list(faults_planned)
    try:
        while pending_jobs or pending_faults:
            now = time.monotonic() - t0
            while pending_jobs and pending_jobs[0][0] <= now:
                _, doc = pending_jobs.pop(0)
                _create(cluster, namespace, doc)
            if pending_faults and pending_faults[0][0] <= now:
                at, kind = pending_faults.pop(0)
                done.append(_inject(faults, kind, t0))
            time.sleep(0.2)
        names = [d["metadata"]["name"] for d in docs]
        grace = finish_grace_s if finish_grace_s is not None else max(300.0, minutes * 60 * 0.5)
        deadline = t0 + minutes * 60 + grace
        log(f"faults done after {time.monotonic() - t0:.0f}s; waiting (until {deadline - t0:.0f}s) for every job")
        try:
            wait("every job to finish and every deleted job to be gone",
                 lambda: _all_finished(observer, names, faults.deleted), max(60.0, deadline - time.monotonic()),
                 interval=2)
        except TimeoutError as exc:
            problems.append(str(exc))
        result["wallSeconds"] = round(time.monotonic() - t0, 1)
        time.sleep(3)  # one more sample of each kind after the last change
        submissions, jobs = observer.snapshot()
        figures = {}
        # The runtime writes a job's local:// output inside its namespace's directory.
        for part in (checks.outcomes(jobs, names, faults.deleted, outputs / namespace),
                     checks.drivers(submissions, jobs, faults.deleted),
                     checks.books_match(operator, ray, timeout=120)):
            figures.update(part[0])
            problems += part[1]
        log("waiting for warm groups to expire")
        left = checks.nothing_left(operator, ray, timeout=WARM_TTL_S + 10 * SWEEP_S + 120)
        figures.update(left[0])
        problems += left[1]
    finally:
        observer.stop()
    result.update(_figures(done, jobs, submissions, faults, observer, operator))
    result.update(figures)
    result["problems"] = problems
    result["passed"] = not problems


def _create(cluster, namespace: str, doc: dict) -> None:
    import json

    def created() -> bool:
        # The API server may be restarting (a fault): try again; AlreadyExists means an earlier try landed.
        res = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
        return res.returncode == 0 or "AlreadyExists" in res.stderr

    wait(f"creating {doc['metadata']['name']}", created, 120, interval=2)


def _inject(faults: Faults, kind: str, t0: float) -> dict:
    """One fault; a fault without a target now is tried again for up to 30 s."""
    start = time.monotonic()
    while True:
        record = faults.inject(kind)
        if "skipped" not in record or time.monotonic() - start > 30:
            break
        time.sleep(2)
    record = {"kind": kind, "at": round(start - t0, 1), "wall": time.strftime("%H:%M:%S"),
              "took": round(time.monotonic() - start, 1), **record}
    log(f"fault {record}")
    return record


def _all_finished(observer: Observer, names: list[str], deleted: dict) -> bool:
    _, jobs = observer.snapshot()
    by_name = {j["name"]: j for j in jobs.values()}
    for name in names:
        job = by_name.get(name)
        if any(d["name"] == name for d in deleted.values()):
            if job is not None and "goneAt" not in job:
                return False
        elif job is None or job.get("phase") not in ("Succeeded", "Failed"):
            return False
    return True


def _figures(done, jobs, submissions, faults, observer, operator) -> dict:
    injected = Counter(f["kind"] for f in done if "skipped" not in f)
    skipped = Counter(f["kind"] for f in done if "skipped" in f)
    attempts = [a for j in jobs.values() for a in (j.get("status") or {}).get("attempts") or []]
    results = Counter(f"{a.get('result')}/{a.get('reason')}" for a in attempts)
    return {
        "faultsByKind": {k: injected.get(k, 0) for k in KINDS},
        "faultsSkippedByKind": {k: n for k, n in skipped.items()},
        "faults": done,
        "deleted": sorted(d["name"] for d in faults.deleted.values()),
        "attempts": len(attempts),
        "retries": sum(max(0, len((j.get("status") or {}).get("attempts") or []) - 1) for j in jobs.values()),
        "attemptResults": dict(sorted(results.items())),
        "raySubmissionsSeen": sum(1 for s in submissions.values() if s.get("uid")),
        "teardownDriversSeen": sum(1 for s in submissions.values() if s.get("teardown")),
        "samples": dict(observer.samples),
        "operatorStarts": operator.starts,
    }
