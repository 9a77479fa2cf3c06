"""The Ray head's memory with 1 and with 8 concurrent jobs, drivers on the head vs off it.

Issue 17: every job's driver and Ray JobSupervisor used to run on the head pod
(8Gi limit, no GCS fault tolerance), so enough concurrent jobs would OOM the
head and lose the cluster. The chart now runs them on a `drivers` worker group
(Ray resource vj-driver; VIDEOJOB_DRIVER_RESOURCES on the operator). This
measures both placements side by side in one run, for real:

- the cluster whose pods run (`localcluster.py up --full --pod-runner`, as
  tests/conftest.py's e2e_cluster: started or reused, released at the end);
- per placement, `helm install -f charts/videojob/ci/kuberay-cpu.yaml` in a fresh
  namespace with one bench class of 8 CPU ranks (so 8 one-rank jobs run at once),
  and, for "head", the operator told to ask no driver resources
  (VIDEOJOB_DRIVER_RESOURCES={}: what the chart did before);
- the head pod's resident memory (every process of its containers: the GCS,
  raylet, dashboard, its agent, the autoscaler sidecar and whatever runs there),
  sampled every 0.5 s from /proc through the pod runner's records: idle, the
  peak while 1 tiny job runs, the peak while 8 run at once; the same for the
  drivers' pod.

Writes benchmarks/results/head_memory.json (machine.write_result). Minutes on
2 cores (8 drivers and 8 ranks import torch). Needs root, like the e2e test.

    python benchmarks/head_memory.py [--jobs 8] [--placements drivers-group,head]
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

from machine import write_result  # noqa: E402

LOCALCLUSTER = REPO / "hack" / "cluster" / "localcluster.py"
E2E_DIR = Path(os.environ.get("VIDEOJOB_E2E_CLUSTER_DIR") or REPO / ".cluster-e2e")
MIB = 2**20


def cluster_up() -> dict:
    out = subprocess.run([sys.executable, str(LOCALCLUSTER), "--cluster-dir", str(E2E_DIR), "up", "--full",
                          "--pod-runner", "--ephemeral", "--holder", str(os.getpid()), "--json"],
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"head_memory: the cluster did not start:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def cluster_release(state: dict) -> None:
    subprocess.run([sys.executable, str(LOCALCLUSTER), "--cluster-dir", state["cluster_dir"], "release",
                    "--holder", str(os.getpid())], timeout=300, check=False)


class Sampler:
    """Peak RSS of a pod's processes (all containers), sampled in a thread."""

    def __init__(self, release, pod_name: str, interval: float = 0.5):
        from e2e_support import rss_bytes
        self.release, self.pod_name, self.interval, self.rss_bytes = release, pod_name, interval, rss_bytes
        self.peak, self.samples = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        pids = [c["pid"] for r in self.release.runner_pods() if r["name"] == self.pod_name
                for c in r.get("containers", []) if c.get("pid") and not c.get("init")]
        return self.rss_bytes(pids)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=10)


def run_jobs(release, names: list[str], timeout: float) -> dict:
    from e2e_support import JobWatch, tiny_job
    docs = [tiny_job(n, parallel={"ulysses": 1}, resources={"maxGPUs": 1, "gpuClass": "bench"}) for n in names]
    t0 = time.monotonic()
    with JobWatch(release, names) as watch:
        for doc in docs:
            release.apply_job(doc)
        done = watch.wait_finished(timeout)
    phases = {n: (o.get("status") or {}).get("phase") for n, o in done.items()}
    bad = {n: (done[n].get("status") or {}).get("message") for n, p in phases.items() if p != "Succeeded"}
    if bad:
        raise RuntimeError(f"jobs did not succeed: {bad}")
    return {"seconds": round(time.monotonic() - t0, 1)}


def measure(cluster, placement: str, jobs: int, workdir: Path) -> dict:
    from e2e_support import (CLAIM, INSTANCE, RAYCLUSTER, TOKEN_SECRET, Release, make_data_dir)
    namespace = f"vj-bench-{secrets.token_hex(3)}"
    cluster.kubectl("create", "namespace", namespace)
    token = secrets.token_hex(24)
    cluster.kubectl("create", "secret", "generic", TOKEN_SECRET, "-n", namespace, f"--from-literal=token={token}")
    data = make_data_dir(workdir / namespace / "data")
    pv = f"{namespace}-data"
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(data)},
                 "claimRef": {"namespace": namespace, "name": CLAIM}}}))
    release = Release(cluster, namespace, data, token, workdir / namespace / "helm")
    bench_class = [{"name": "bench", "gpuMemory": "2Gi", "gpusPerPod": jobs, "maxPods": 1, "hostMemory": "64Gi",
                    "gpuType": "generic", "nodeSelector": {"videojob.io/e2e-pool": "a"},
                    "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
                    "rayStartParams": {"object-store-memory": "100000000"}}]
    release.extra_args = ["--set-json", f"gpuClasses={json.dumps(bench_class)}",
                          "--set", "operator.settings.warmGroupTtlS=0",
                          "--set", "operator.settings.placementTimeoutS=600"]
    if placement == "head":
        release.extra_args += ["--set-json", 'operator.extraEnv=[{"name":"VIDEOJOB_DRIVER_RESOURCES","value":"{}"}]']
    result: dict = {"placement": placement}
    try:
        release.install()
        release.wait_ready(f"{INSTANCE},app.kubernetes.io/component=operator", timeout=600)
        head = release.wait_ready(f"ray.io/cluster={RAYCLUSTER},ray.io/node-type=head", timeout=600)[0]
        (drivers,) = release.wait_ready(f"ray.io/cluster={RAYCLUSTER},ray.io/group=drivers", timeout=600)
        head_name, drivers_name = head["metadata"]["name"], drivers["metadata"]["name"]
        time.sleep(10)  # bounded settle: let the head finish its start-up work before the idle sample
        idle = Sampler(release, head_name)
        result["headIdleMiB"] = round(idle.now() / MIB)
        # warm-up job: the class's worker scales up from zero (not measured)
        run_jobs(release, ["warmup"], timeout=1200)
        for count in (1, jobs):
            names = [f"j{count}-{i}" for i in range(count)]
            with Sampler(release, head_name) as on_head, Sampler(release, drivers_name) as on_drivers:
                timing = run_jobs(release, names, timeout=2400)
            result[f"jobs{count}"] = {"headPeakMiB": round(on_head.peak / MIB),
                                      "driversPodPeakMiB": round(on_drivers.peak / MIB),
                                      "samples": on_head.samples, **timing}
            print(f"head_memory: {placement}: {count} job(s): head peak {result[f'jobs{count}']['headPeakMiB']} "
                  f"MiB, drivers pod peak {result[f'jobs{count}']['driversPodPeakMiB']} MiB", flush=True)
    finally:
        # the VideoJobs first: their finalizer needs the operator (README, "Helm chart")
        cluster.kubectl("delete", "videojobs", "--all", "-n", namespace, "--wait=true", "--timeout=180s",
                        check=False, timeout=240)
        release.helm("uninstall", "videojob", "--namespace", namespace, "--ignore-not-found", "--wait",
                     "--timeout=180s", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=true", "--timeout=180s",
                        check=False, timeout=240)
        cluster.kubectl("delete", "pv", pv, "--ignore-not-found", check=False)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=8, help="concurrent jobs in the second measurement (default 8)")
    p.add_argument("--placements", default="drivers-group,head",
                   help="comma-separated: drivers-group (the chart's default), head (drivers on the head)")
    p.add_argument("--out", type=Path, default=None, help="result file (default benchmarks/results/head_memory.json)")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("head_memory: needs root (the pod runner makes network namespaces)")
    from conftest import E2ECluster
    state = cluster_up()
    try:
        cluster = E2ECluster(state)
        with tempfile.TemporaryDirectory(prefix="vj-head-memory-") as tmp:
            runs = [measure(cluster, placement, args.jobs, Path(tmp)) for placement in args.placements.split(",")]
    finally:
        cluster_release(state)
    by = {r["placement"]: r for r in runs}
    summary = {}
    if "head" in by and "drivers-group" in by:
        summary = {f"headPeakMiBWith{args.jobs}Jobs": {k: by[k][f"jobs{args.jobs}"]["headPeakMiB"] for k in by},
                   "headGrowthMiBFrom1To%dJobs" % args.jobs: {
                       k: by[k][f"jobs{args.jobs}"]["headPeakMiB"] - by[k]["jobs1"]["headPeakMiB"] for k in by}}
    out = write_result("head_memory.json", {"benchmark": "head_memory", "jobs": args.jobs, "runs": runs,
                                            "summary": summary,
                                            "method": "RSS of every process of the head pod's containers "
                                                      "(/proc, through the pod runner's records), peak of 0.5 s "
                                                      "samples; tiny CogVideoX jobs on one CPU rank each"},
                       args.out)
    print(f"head_memory: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
