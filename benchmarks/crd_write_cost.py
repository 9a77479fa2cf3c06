"""What each kind of write to a VideoJob costs the API server, with the CRD's
CEL rules as generated (creation-only guards, ``crd.creation_only``), with
the same rules unguarded, and with no rules at all.

Why: the operator load benchmark is bound by the API server's CPU on this
machine, and CEL rules run on every write, status and metadata patches
included. The three CRDs are served side by side under three API groups
(the same schema), and each kind of request is sent ``--writes`` times from 8
threads per variant, twice in alternating order; the figure is the API
server's CPU seconds (/proc/<pid>/stat) per request, the lower of the two
rounds (the machine is shared; the lower is the less disturbed).

Writes benchmarks/results/crd_write_cost.json.

    python benchmarks/crd_write_cost.py [--writes 300]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import write_result  # noqa: E402
from loadkit import CRD_FILE, PLURAL, VERSION, Cluster, api_for, cpu_seconds, manifests  # noqa: E402

GUARD = re.compile(r"^oldSelf\.hasValue\(\) \|\| \((.*)\)$", re.S)


def variant(crd: dict[str, Any], group: str, rules: str) -> dict[str, Any]:
    """``crd`` served under ``group`` with its rules kept ("guarded"), unguarded, or removed ("none")."""
    out = copy.deepcopy(crd)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if rules == "none":
                node.pop("x-kubernetes-validations", None)
            elif rules == "unguarded":
                for rule in node.get("x-kubernetes-validations") or []:
                    match = GUARD.match(rule["rule"])
                    if match:
                        rule["rule"] = match.group(1)
                        rule.pop("optionalOldSelf", None)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(out)
    out["metadata"]["name"] = f"{PLURAL}.{group}"
    out["spec"]["group"] = group
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=300)
    args = parser.parse_args(argv)
    cluster = Cluster()
    base = yaml.safe_load(CRD_FILE.read_text())
    variants = {"guarded": "guarded.cost.videojob.io", "unguarded": "unguarded.cost.videojob.io",
                "none": "none.cost.videojob.io"}
    api = api_for(cluster.kubeconfig, 16)
    from kubernetes import client

    core = client.CoreV1Api(api.api_client)
    pid = cluster.pid("kube-apiserver")
    results: dict[str, dict[str, list[float]]] = {name: {} for name in variants}
    namespaces: list[str] = []
    try:
        for name, group in variants.items():
            cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                            input=yaml.safe_dump(variant(base, group, name)))
            cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{group}")
        order = list(variants) + list(reversed(variants))
        for round_, name in enumerate(order):
            group = variants[name]
            namespace = f"crd-cost-{name}-{round_}"
            namespaces.append(namespace)
            cluster.kubectl("create", "namespace", namespace)
            docs = manifests(args.writes)
            for doc in docs:
                doc["apiVersion"] = f"{group}/{VERSION}"
                doc["metadata"]["namespace"] = namespace
            names = [d["metadata"]["name"] for d in docs]

            def measure(kind: str, fn, items) -> None:
                before = cpu_seconds(pid)
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    list(pool.map(fn, items))
                per = (cpu_seconds(pid) - before) / len(items) * 1000
                results[name].setdefault(kind, []).append(round(per, 2))

            def event(n: str) -> None:
                core.create_namespaced_event(namespace, {
                    "metadata": {"generateName": f"{n}."}, "type": "Normal", "reason": "Queued", "message": "m",
                    "involvedObject": {"kind": "VideoJob", "name": n, "namespace": namespace,
                                       "apiVersion": f"{group}/{VERSION}"}, "source": {"component": "bench"}})

            measure("create", lambda d: api.create_namespaced_custom_object(group, VERSION, namespace, PLURAL, d),
                    docs)
            measure("get", lambda n: api.get_namespaced_custom_object(group, VERSION, namespace, PLURAL, n), names)
            measure("patchMetadata", lambda n: api.patch_namespaced_custom_object(
                group, VERSION, namespace, PLURAL, n, {"metadata": {"annotations": {"bench": "1"}}}), names)
            measure("patchStatus", lambda n: api.patch_namespaced_custom_object_status(
                group, VERSION, namespace, PLURAL, n, {"status": {"phase": "Queued", "message": "waiting"}}), names)
            measure("event", event, names)
            print(f"crd_write_cost: round {round_} {name}: {results[name]}", file=sys.stderr, flush=True)
    finally:
        for namespace in namespaces:
            cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "crd", *(f"{PLURAL}.{g}" for g in variants.values()), "--wait=false", check=False)
        cluster.release()
    table = {name: {kind: min(values) for kind, values in kinds.items()} for name, kinds in results.items()}
    out = write_result("crd_write_cost.json", {
        "benchmark": "crd_write_cost",
        "unit": "API server CPU milliseconds per request (lower of two rounds)",
        "writesPerKind": args.writes,
        "apiServerCpuMsPerRequest": table,
        "rounds": results,
        "variants": {"guarded": "the CRD as generated: spec rules run at creation only (crd.creation_only)",
                     "unguarded": "the same rules without the guard (run on every write)",
                     "none": "no CEL rules (the OpenAPI schema alone)"},
    })
    for name, kinds in table.items():
        print(f"{name:10s} " + "  ".join(f"{k} {v:.2f}" for k, v in kinds.items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
