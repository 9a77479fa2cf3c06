"""The pods KubeRay (the real operator, v1.5) makes from the chart installed for real on
the full loopback cluster (DESIGN.md "Testing layers", 5): the README's GPU example,
charts/videojob/ci/kuberay-gpu.yaml, installed as tests/test_chart_install.py installs
it (see there what this cluster adds), and ci/kuberay-cpu.yaml, the end-to-end test's
install.

KWOK never pulls images or runs containers, so these tests run by hand what must
survive a shell: the `ray start` command line KubeRay wrote into its pods goes through
real bash with a stub `ray`. They also check which pods and containers mount a
ServiceAccount token, that KubeRay's probes call only paths Ray's token auth leaves
public, and the NetworkPolicy. The loopback cluster has no CNI, so nothing enforces
NetworkPolicy here: the chart's is checked as an object the API server accepted,
selecting the pods KubeRay made. Fixtures and helpers: tests/chart_install_support.py.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from chart_install_support import (CHART, DRIVERS, GPU_CLASSES, INSTANCE, gpu_args, gpu_limit, installed, of_kind,
                                   pods, ray_token, rendered, scale, wait_pods, worker_selector)
from chart_install_support import helm, service_monitor_crd, volumes  # noqa: F401 - fixtures
from helpers import wait_for


SA_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


# --- the pods KubeRay made from the chart: `ray start`, tokens, probes, NetworkPolicy -----------

def ray_start_argv(pod: dict, work: Path) -> list[str]:
    """What `ray` gets when the pod's Ray container starts: its command and args, exactly
    as KubeRay wrote them (`/bin/bash -c -- "ulimit ...; ray start --flag=value ..."`),
    run by real bash with `ray` a stub on PATH that prints its argv as JSON."""
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] in ("ray-head", "ray-worker")]
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv and argv[0].endswith("bash"), f"not a bash command line: {argv}"
    work.mkdir(parents=True, exist_ok=True)
    bin_dir, home = work / "bin", work / "home"
    bin_dir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    stub = bin_dir / "ray"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint('RAY-ARGV', json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    # KubeRay runs a login shell when ENABLE_LOGIN_SHELL is set; Debian's /etc/profile then
    # resets PATH, so the profile in HOME puts the stub first again.
    (home / ".bash_profile").write_text(f'PATH="{bin_dir}:$PATH"\n')
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", HOME=str(home))
    result = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True, timeout=30)
    lines = [line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("RAY-ARGV ")]
    assert result.returncode == 0 and len(lines) == 1, (argv, result.stdout, result.stderr)
    return json.loads(lines[0])


def start_flags(argv: list[str]) -> dict[str, str | bool]:
    """`ray start --a=b --c` -> {"a": "b", "c": True}."""
    assert argv[0] == "start", argv
    flags: dict[str, str | bool] = {}
    for arg in argv[1:]:
        assert arg.startswith("--"), f"{arg!r} in {argv}: a value bash split off its flag"
        key, sep, value = arg[2:].partition("=")
        flags[key] = value if sep else True
    return flags


def ray_public_paths() -> tuple[set[str], set[str]]:
    """Paths Ray 2.60's token auth leaves open: the dashboard agent's (http_server_agent
    PUBLIC_EXACT_PATHS) and the dashboard head's (the public_exact_paths set literal in
    http_server_head.py)."""
    from ray.dashboard import http_server_agent, http_server_head

    head: set[str] = set()
    for node in ast.walk(ast.parse(inspect.getsource(http_server_head))):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Set)
                and any(getattr(t, "id", None) == "public_exact_paths" for t in node.targets)):
            head = {ast.literal_eval(e) for e in node.value.elts}
    assert head, "http_server_head.py no longer has public_exact_paths"
    return set(http_server_agent.PUBLIC_EXACT_PATHS), head


def token_mounts(pod: dict) -> dict[str, list[str]]:
    """Container name -> the volumes it mounts at the ServiceAccount token path."""
    return {c["name"]: [m["name"] for m in c.get("volumeMounts", []) if m["mountPath"].startswith(SA_TOKEN_DIR)]
            for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])}


def projects_a_token(pod: dict, volume: str) -> bool:
    (spec,) = [v for v in pod["spec"]["volumes"] if v["name"] == volume]
    return any("serviceAccountToken" in s for s in spec.get("projected", {}).get("sources", []))


def test_kuberay_pods_start_ray_with_class_resources_and_no_needless_tokens(
        full_cluster, helm, service_monitor_crd, volumes, full_namespaces, tmp_path):
    """The README's GPU example installed; the pods KubeRay (the real operator, v1.5) made
    from it:
    - `ray start`, run through bash as the pod would: each class's worker advertises
      --resources '{"vj-class-<name>": gpusPerPod}' (valid JSON after bash: KubeRay
      single-quotes the group's `resources` field) and its GPUs, the drivers' pod
      {"vj-driver": slotsPerPod} with no CPUs, the head no CPUs. (Rendered as JSON in
      rayStartParams, as before the fix, bash stripped the quotes and `ray start` got
      {vj-class-h100-80:8}.)
    - ServiceAccount tokens: the head pod runs as KubeRay's ServiceAccount for the
      cluster, which may patch the RayCluster and its pods, and only its autoscaler
      container mounts a token; no Ray container and no worker pod has one; the
      operator pod has its own.
    - KubeRay's probes call only paths Ray's token auth leaves public.
    - The NetworkPolicy the API server accepted selects every Ray pod and not the
      operator, and lets the operator pod in on the head Service's dashboard port
      (not enforced here: no CNI)."""
    system, jobs = full_namespaces(), full_namespaces()
    args = gpu_args(jobs)
    docs = rendered(helm, system, args)
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    volumes(claim)
    ray_token(full_cluster, system)
    rc = of_kind(docs, "RayCluster")[0]["metadata"]["name"]
    slots = [g for g in of_kind(docs, "RayCluster")[0]["spec"]["workerGroupSpecs"]
             if g["groupName"] == DRIVERS][0]["resources"]["vj-driver"]
    with installed(helm, system, args):
        scale(full_cluster, system, rc, {name: 1 for name in GPU_CLASSES})
        (head,), _ = wait_pods(full_cluster, system, f"ray.io/cluster={rc},ray.io/node-type=head", 1)
        (drivers,), _ = wait_pods(full_cluster, system, worker_selector(rc, DRIVERS), 1)
        workers = {name: wait_pods(full_cluster, system, worker_selector(rc, name), 1)[0][0] for name in GPU_CLASSES}
        (operator,), _ = wait_pods(full_cluster, system, f"{INSTANCE},app.kubernetes.io/component=operator", 1)

        # `ray start` as bash hands it over
        for name, pod in workers.items():
            flags = start_flags(ray_start_argv(pod, tmp_path / name))
            klass = GPU_CLASSES[name]
            assert json.loads(flags["resources"]) == {f"vj-class-{name}": klass["gpusPerPod"]}, (name, flags)
            assert flags["num-gpus"] == str(klass["gpusPerPod"]), (name, flags)
            assert int(flags["num-cpus"]) >= klass["gpusPerPod"], f"{name}: one CPU per rank ({flags})"
            assert flags["address"].startswith(f"{rc}-head-svc."), flags
        flags = start_flags(ray_start_argv(drivers, tmp_path / DRIVERS))
        assert json.loads(flags["resources"]) == {"vj-driver": int(slots)} and flags["num-cpus"] == "0", flags
        assert "num-gpus" not in flags
        flags = start_flags(ray_start_argv(head, tmp_path / "head"))
        assert flags["head"] is True and flags["num-cpus"] == "0" and "resources" not in flags, flags

        # ServiceAccount tokens only where used
        account = head["spec"]["serviceAccountName"]
        assert account == rc, "KubeRay's ServiceAccount for the cluster (the autoscaler's Role is bound to it)"
        assert head["spec"]["automountServiceAccountToken"] is False
        mounts = token_mounts(head)
        assert mounts["ray-head"] == [], "the Ray head container has a ServiceAccount token"
        (autoscaler,) = [c for c in head["spec"]["containers"] if c["name"] == "autoscaler"]
        (volume,) = mounts["autoscaler"]
        assert projects_a_token(head, volume)
        assert [n for n, v in mounts.items() if v] == ["autoscaler"]
        for verb, what in (("patch", f"rayclusters.ray.io/{rc}"), ("patch", "pods"), ("list", "pods")):
            can = full_cluster.kubectl("auth", "can-i", verb, what, "-n", system,
                                       f"--as=system:serviceaccount:{system}:{account}", check=False)
            assert can.stdout.strip() == "yes", f"the autoscaler's token may not {verb} {what}: {can.stdout}{can.stderr}"
        for pod in [drivers, *workers.values()]:
            assert pod["spec"]["automountServiceAccountToken"] is False
            assert not any(token_mounts(pod).values()), (pod["metadata"]["name"], token_mounts(pod))
            assert not any(projects_a_token(pod, v["name"]) for v in pod["spec"]["volumes"])
        (operator_token,) = token_mounts(operator)["operator"]
        assert projects_a_token(operator, operator_token), "the operator needs its token"

        # KubeRay's probes with Ray's token auth on: only public paths
        agent_public, head_public = ray_public_paths()
        for pod, public in ((head, head_public | agent_public), (drivers, agent_public), *[(w, agent_public)
                                                                                           for w in workers.values()]):
            ray = pod["spec"]["containers"][0]
            for probe in (ray["livenessProbe"], ray["readinessProbe"]):
                command = " ".join(probe["exec"]["command"])
                paths = set(re.findall(r"http://[^/\s]+(/[^\s'\"]*)", command))
                assert paths and paths <= public, f"{pod['metadata']['name']}: {paths - public} need a token"
        env = {e["name"]: e for e in head["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"

        # the NetworkPolicy, as the API server holds it
        policy = full_cluster.get_json("networkpolicy", rc, "-n", system)
        selector = policy["spec"]["podSelector"]["matchLabels"]
        for pod in [head, drivers, *workers.values()]:
            assert selector.items() <= pod["metadata"]["labels"].items(), pod["metadata"]["name"]
        assert not selector.items() <= operator["metadata"]["labels"].items()
        (from_operator,) = [r for r in policy["spec"]["ingress"] if r.get("ports")]
        (peer,) = from_operator["from"]
        assert peer["podSelector"]["matchLabels"].items() <= operator["metadata"]["labels"].items()
        service = full_cluster.get_json("service", f"{rc}-head-svc", "-n", system)
        dashboard = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "dashboard")
        assert [p["port"] for p in from_operator["ports"]] == [dashboard]
        (among,) = [r for r in policy["spec"]["ingress"] if not r.get("ports")]
        assert among["from"] == [{"podSelector": {"matchLabels": selector}}]


def test_kuberay_cpu_values_start_ray_as_the_end_to_end_test_needs(full_cluster, helm, volumes, full_namespaces,
                                                                    tmp_path):
    """ci/kuberay-cpu.yaml (the end-to-end test's install) on this cluster: KubeRay takes the
    RayCluster, and the `ray start` lines of the pods it makes, through bash: each CPU
    class's worker offers gpusPerPod CPUs and its class resource, the drivers' pod its
    slots and no CPU, and every Ray node a small object store. (Its class pods select
    videojob.io/e2e-pool nodes, which the end-to-end test brings; here they may stay
    unscheduled: the command line is the pod's either way.)"""
    cpu_values = CHART / "ci" / "kuberay-cpu.yaml"
    values = yaml.safe_load(cpu_values.read_text())
    system, jobs = full_namespaces(), full_namespaces()
    args = ["-f", str(cpu_values), "--set", f"watch.namespaces={{{jobs}}}"]
    docs = rendered(helm, system, args)
    (claim,) = of_kind(docs, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    volumes(claim)
    full_cluster.kubectl("create", "secret", "generic", values["ray"]["auth"]["existingSecret"], "-n", system,
                         f"--from-literal=token={os.urandom(16).hex()}")
    rc = of_kind(docs, "RayCluster")[0]["metadata"]["name"]
    classes = {c["name"]: c for c in values["gpuClasses"]}
    drivers = values["ray"]["kuberay"]["drivers"]
    with installed(helm, system, args):
        scale(full_cluster, system, rc, {name: 1 for name in classes})

        def made(selector: str) -> dict | None:
            found = pods(full_cluster, system, selector)
            return found[0] if len(found) == 1 else None

        head = wait_for("the head pod", lambda: made(f"ray.io/cluster={rc},ray.io/node-type=head"), timeout=60)
        flags = start_flags(ray_start_argv(head, tmp_path / "head"))
        assert flags["num-cpus"] == "0" and flags["object-store-memory"] == "100000000", flags
        pod = wait_for("a drivers pod", lambda: made(worker_selector(rc, DRIVERS)), timeout=60)
        flags = start_flags(ray_start_argv(pod, tmp_path / DRIVERS))
        assert json.loads(flags["resources"]) == {"vj-driver": drivers["slotsPerPod"]}, flags
        assert flags["num-cpus"] == "0" and flags["object-store-memory"] == "100000000", flags
        for name, klass in classes.items():
            pod = wait_for(f"a {name} pod", lambda: made(worker_selector(rc, name)), timeout=60)
            assert gpu_limit(pod) == 0
            flags = start_flags(ray_start_argv(pod, tmp_path / name))
            assert json.loads(flags["resources"]) == {f"vj-class-{name}": klass["gpusPerPod"]}, flags
            assert flags["num-cpus"] == str(klass["gpusPerPod"]) and "num-gpus" not in flags, flags
            assert flags["object-store-memory"] == "100000000", flags
