"""Kueue mode under load: 1,000 VideoJobs from four teams through real Kueue.

What runs: the loopback kube-apiserver (as benchmarks/operator_load.py starts
it), Kueue v0.17's real controller manager with its webhooks
(hack/cluster/lc/kueue.py), and the operator as a subprocess
(benchmarks/fake_ray.py: the real controller and kopf handlers) with
``VIDEOJOB_ADMISSION=kueue``, authenticated as a ServiceAccount bound to the
chart's RBAC files (the base rules and kueue mode's, namespaced and cluster).
Ray is ``InstantRay``: each driver ends SUCCEEDED ``--delay-s`` after its
submission, so an admitted attempt holds its quota that long. That is the only
fake.

The fleet is operator_load.py's: three GPU classes, 48 GPUs, a ResourceFlavor
per class. Four teams (namespaces), a ClusterQueue each in one cohort, nominal
quotas per flavor in the ratio 3:3:1:1; 250 jobs each, created at once.

Measured (from Kueue's own records, each Workload's Admitted condition, whole
seconds):
  jobsPerSecondAdmitted   Workloads admitted / (last admission - first create)
  shares                  per team, over the window in which every team still
                          had jobs waiting: its share of the GPUs admitted, its
                          share of the nominal quota
Then every job is deleted (the finalizer deletes its Workloads): none may be left.

Writes benchmarks/results/kueue_load.json (machine.write_result).

    python benchmarks/kueue_load.py [--jobs-per-team 250] [--delay-s 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import REPO, write_result  # noqa: E402
from fake_ray import proc_status  # noqa: E402
from loadkit import (CRD_FILE, INVENTORY, RBAC_RULES, SERVICE_ACCOUNT, Cluster, Operator,  # noqa: E402
                           api_for, create_all, manifests)

sys.path.insert(0, str(REPO / "hack" / "cluster"))
from lc import kueue as lc_kueue  # noqa: E402

KUEUE_RULES = REPO / "charts" / "videojob" / "files" / "operator-rbac-rules-kueue.yaml"
KUEUE_CLUSTER_RULES = REPO / "charts" / "videojob" / "files" / "operator-rbac-rules-kueue-cluster.yaml"
GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"
TEAMS = {"team-a": 3, "team-b": 3, "team-c": 1, "team-d": 1}  # quota weights
COHORT = "vj-bench-fleet"


def log(message: str) -> None:
    print(f"kueue_load: {message}", file=sys.stderr, flush=True)


def quotas() -> dict[str, dict[str, int]]:
    """{team: {class: GPUs}}: each class's GPUs split in the teams' ratio (whole GPUs)."""
    total = sum(TEAMS.values())
    out: dict[str, dict[str, int]] = {t: {} for t in TEAMS}
    for c in INVENTORY["classes"]:
        gpus = c["gpusPerPod"] * c["maxPods"]
        for team, weight in TEAMS.items():
            out[team][c["name"]] = gpus * weight // total
    return out


def kueue_objects(run_id: str, teams: dict[str, str]) -> list[dict[str, Any]]:
    """Flavors per class, a ClusterQueue per team in one cohort, a LocalQueue `default` per namespace."""
    api = f"{GROUP}/{VERSION}"
    objects: list[dict[str, Any]] = [{"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": c["name"]},
                                      "spec": {}} for c in INVENTORY["classes"]]
    for team, namespace in teams.items():
        flavors = [{"name": klass, "resources": [
            {"name": "nvidia.com/gpu", "nominalQuota": str(gpus)}, {"name": "cpu", "nominalQuota": "100000"},
            {"name": "memory", "nominalQuota": "1000Ti"}]} for klass, gpus in quotas()[team].items()]
        objects.append({"apiVersion": api, "kind": "ClusterQueue", "metadata": {"name": f"{team}-{run_id}"},
                        "spec": {"namespaceSelector": {}, "cohortName": f"{COHORT}-{run_id}",
                                 "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"},
                                 "resourceGroups": [{"coveredResources": ["nvidia.com/gpu", "cpu", "memory"],
                                                     "flavors": flavors}]}})
        objects.append({"apiVersion": api, "kind": "LocalQueue", "metadata": {"name": "default",
                                                                               "namespace": namespace},
                        "spec": {"clusterQueue": f"{team}-{run_id}"}})
    return objects


def grant(cluster: Cluster, namespaces: list[str], run_id: str) -> None:
    """The chart's rules: base + kueue in a Role per namespace, kueue's cluster rules in a ClusterRole."""
    rules = yaml.safe_load(RBAC_RULES.read_text()) + yaml.safe_load(KUEUE_RULES.read_text())
    home = namespaces[0]
    objects: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "ServiceAccount",
                                      "metadata": {"name": SERVICE_ACCOUNT, "namespace": home}}]
    subject = [{"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": home}]
    for ns in namespaces:
        objects += [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                     "metadata": {"name": "videojob-operator", "namespace": ns}, "rules": rules},
                    {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                     "metadata": {"name": "videojob-operator", "namespace": ns},
                     "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                 "name": "videojob-operator"}, "subjects": subject}]
    objects += [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                 "metadata": {"name": f"videojob-bench-kueue-{run_id}"},
                 "rules": yaml.safe_load(KUEUE_CLUSTER_RULES.read_text())},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                 "metadata": {"name": f"videojob-bench-kueue-{run_id}"},
                 "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                             "name": f"videojob-bench-kueue-{run_id}"}, "subjects": subject}]
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objects))


def _epoch(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()


def workloads(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return json.loads(cluster.kubectl("get", f"workloads.{GROUP}", "-n", namespace, "-o", "json",
                                      timeout=300).stdout)["items"]


def admissions(cluster: Cluster, teams: dict[str, str]) -> list[tuple[float, str, int]]:
    """(admitted at, team, GPUs) of every Workload Kueue admitted."""
    out = []
    for team, namespace in teams.items():
        for wl in workloads(cluster, namespace):
            conds = {c["type"]: c for c in (wl.get("status") or {}).get("conditions") or []}
            admitted = conds.get("Admitted") or {}
            if admitted.get("status") != "True" and "Finished" not in conds:
                continue
            stamp = admitted.get("lastTransitionTime") or (conds.get("QuotaReserved") or {}).get("lastTransitionTime")
            if not stamp:
                continue
            usage = 0
            for assignment in ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []:
                usage += int(str((assignment.get("resourceUsage") or {}).get("nvidia.com/gpu", "0")))
            out.append((_epoch(stamp), team, usage))
    return sorted(out)


def shares(admitted: list[tuple[float, str, int]], created_at: float) -> dict[str, Any]:
    """Each team's share of admitted GPUs while every team still had jobs waiting
    (until the first team's last admission), beside its share of the nominal quota."""
    last = defaultdict(float)
    for at, team, _ in admitted:
        last[team] = max(last[team], at)
    window_end = min(last.values())
    gpus: Counter[str] = Counter()
    for at, team, n in admitted:
        if at < window_end:
            gpus[team] += n
    nominal = {t: sum(q.values()) for t, q in quotas().items()}
    total, total_nominal = sum(gpus.values()) or 1, sum(nominal.values())
    return {"windowSeconds": round(window_end - created_at, 1),
            "teams": {t: {"admittedGPUShare": round(gpus[t] / total, 3),
                          "nominalQuotaShare": round(nominal[t] / total_nominal, 3),
                          "nominalGPUs": nominal[t], "admittedGPUsInWindow": gpus[t]} for t in TEAMS}}


def run(args: argparse.Namespace) -> int:
    loadavg_before = os.getloadavg()
    cluster = Cluster()
    run_id = os.urandom(3).hex()
    teams = {team: f"vj-bench-{team}-{run_id}" for team in TEAMS}
    workdir = Path(tempfile.mkdtemp(prefix="vj-kueue-load-"))
    admin = api_for(cluster.kubeconfig, pool=32)
    kueue = operator = None
    made = kueue_objects(run_id, teams)
    ok = False
    try:
        exe = lc_kueue.kueue_bin_dir(os.environ.get("VIDEOJOB_CLUSTER_NO_BUILD", "").strip() != "1") / "kueue-manager"
        kueue = lc_kueue.start(cluster.state, workdir / "kueue", exe)
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd/videojobs.videojob.io")
        for namespace in teams.values():
            cluster.kubectl("create", "namespace", namespace)
        cluster.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in made))
        grant(cluster, list(teams.values()), run_id)
        kubeconfig = cluster.kubeconfig_for(list(teams.values())[0], workdir / "operator.kubeconfig")
        operator = Operator(list(teams.values()), kubeconfig, workdir, args.delay_s, None,
                            extra_env={"VIDEOJOB_ADMISSION": "kueue",
                                       "VIDEOJOB_KUEUE_POLL_INTERVAL_S": str(args.poll_s)})
        operator.wait_ready()
        time.sleep(1.0)  # kopf opens its watches right after the startup handlers
        docs = manifests(args.jobs_per_team)
        t0_wall, t0 = time.time(), time.monotonic()
        created: dict[str, float] = {}
        for team, namespace in teams.items():
            created.update({f"{namespace}/{k}": v for k, v in create_all(admin, namespace, docs, 8).items()})
        log(f"created {len(created)} VideoJobs in {time.monotonic() - t0:.1f} s; waiting for them to succeed")
        peak_rss, peak_threads = 0, 0
        deadline = t0 + args.timeout_s
        done = 0
        while time.monotonic() < deadline:
            status = proc_status(operator.pid)
            peak_rss, peak_threads = max(peak_rss, status.get("VmRSS", 0)), max(peak_threads, status.get("Threads", 0))
            done = 0
            for namespace in teams.values():
                items = admin.list_namespaced_custom_object("videojob.io", "v1alpha1", namespace, "videojobs")["items"]
                done += sum(1 for i in items if (i.get("status") or {}).get("phase") in ("Succeeded", "Failed"))
            if done >= len(created):
                break
            time.sleep(2.0)
        elapsed = time.monotonic() - t0
        admitted = admissions(cluster, teams)
        failed = []
        for namespace in teams.values():
            items = admin.list_namespaced_custom_object("videojob.io", "v1alpha1", namespace, "videojobs")["items"]
            failed += [f"{namespace}/{i['metadata']['name']}: {(i.get('status') or {}).get('message', '')[:200]}"
                       for i in items if (i.get("status") or {}).get("phase") != "Succeeded"]
        last = max(at for at, _, _ in admitted) if admitted else t0_wall
        result: dict[str, Any] = {
            "jobs": len(created), "teams": {t: {"namespace": ns, "quotaGPUs": quotas()[t]} for t, ns in teams.items()},
            "delaySecondsPerDriver": args.delay_s, "kueuePollIntervalS": args.poll_s,
            "kueueVersion": kueue.version, "succeeded": len(created) - len(failed), "notSucceeded": failed[:20],
            "workloadsAdmitted": len(admitted), "allDoneSeconds": round(elapsed, 1),
            "jobsPerSecondAdmitted": round(len(admitted) / max(1.0, last - t0_wall), 2),
            "shares": shares(admitted, t0_wall) if admitted else None,
            "operatorPeakRssMiB": round(peak_rss / 1024, 1), "operatorPeakThreads": peak_threads,
            "loadavgBefore": loadavg_before, "loadavgAfter": os.getloadavg(),
            "notes": "Admission times are Kueue's (each Workload's Admitted condition, whole seconds). InstantRay "
                     "replaces Ray; every other part is real (API server, Kueue with webhooks, the operator "
                     "under the chart's RBAC).",
        }
        # Deleting the jobs deletes their Workloads (the finalizer; owner references too).
        for namespace in teams.values():
            cluster.kubectl("delete", "videojobs", "--all", "-n", namespace, "--wait=true", "--timeout=300s",
                            timeout=400)
        left = sum(len(workloads(cluster, ns)) for ns in teams.values())
        result["workloadsLeftAfterDeletion"] = left
        out = write_result("kueue_load.json", result, Path(args.out))
        log(f"{result['jobsPerSecondAdmitted']} jobs/s admitted; shares {json.dumps(result['shares'])}; -> {out}")
        ok = not failed and left == 0
    finally:
        if operator is not None:
            operator.stop()
        for namespace in teams.values():
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False)
        for obj in reversed(made):
            if obj["kind"] != "LocalQueue":
                cluster.kubectl("delete", f"{obj['kind'].lower()}s.{GROUP}", obj["metadata"]["name"],
                                "--ignore-not-found", "--wait=false", check=False)
        cluster.kubectl("delete", "clusterrole,clusterrolebinding", f"videojob-bench-kueue-{run_id}",
                        "--ignore-not-found", check=False)
        if kueue is not None:
            kueue.stop()
        cluster.release()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs-per-team", type=int, default=250)
    parser.add_argument("--delay-s", type=float, default=2.0, help="seconds each fake driver runs")
    parser.add_argument("--poll-s", type=float, default=1.0, help="VIDEOJOB_KUEUE_POLL_INTERVAL_S")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kueue_load.json"))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
