"""Full mode's nodes: the KWOK controller and the fake nodes it keeps Ready.

KWOK (tools/kwok, built by build-gotool.sh) fakes the kubelet of every Node
with the annotation kwok.x-k8s.io/node=fake, following the stages in
hack/cluster/kwok/stages.yaml: the node becomes Ready, and pods bound to it
become Running with a pod IP from 10.244.0.0/16 (nothing runs). The Nodes come
from hack/cluster/fake-nodes.yaml (`up --fake-nodes` overrides): CPU nodes and
1-GPU / 8-GPU nodes with nvidia.com/gpu capacity and a taint that pods
requesting nvidia.com/gpu tolerate through the apiserver's
ExtendedResourceToleration admission plugin (which this step turns on).
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from .binaries import resolve_tool_bin_dir
from .client import api, kubectl
from .common import HACK, ClusterError, Paths, log, write_state
from .procs import wait_until
from .steps import Process, Run, Step

FAKE_NODES = HACK / "fake-nodes.yaml"
KWOK_STAGES = HACK / "kwok" / "stages.yaml"
# kwok manages only nodes with this annotation (fake-nodes.yaml sets it).
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node=fake"
KWOK_POD_CIDR = "10.244.0.0/16"  # pod IPs kwok hands out


class Kwok(Process):
    """Fakes the kubelet of every node with the annotation."""
    name = "kwok"
    ports = ("kwok",)

    def resolve(self, bin_dir: Path, args, build: bool) -> Path:
        return resolve_tool_bin_dir("kwok", "kwok", "VIDEOJOB_KWOK_BIN_DIR", build)

    def record(self, run: Run) -> None:
        tool_bin_dir = run.tools[self.name]
        run.state["exes"][self.name] = str(tool_bin_dir / "kwok")
        run.state.setdefault("tool_bin_dirs", {})["kwok"] = str(tool_bin_dir)

    def argv(self, run: Run) -> list[str]:
        return [
            run.state["exes"][self.name],
            f"--config={KWOK_STAGES}",
            f"--kubeconfig={run.state['kubeconfig']}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}",
            f"--server-address=127.0.0.1:{run.state['ports']['kwok']}",
            f"--cidr={KWOK_POD_CIDR}",
        ]

    def health_url(self, state: dict, paths: Paths) -> tuple[str, None]:
        return f"http://127.0.0.1:{state['ports'].get('kwok')}/healthz", None

    def summary(self, run: Run) -> str:
        return "kwok"


class FakeNodes(Step):
    """Creates the Nodes (after kwok runs) and waits until they are Ready."""
    name = "fake-nodes"
    process = False
    admission_plugins = ("ExtendedResourceToleration",)

    def preflight(self, bin_dir: Path, args) -> None:
        fake_nodes = Path(args.fake_nodes).resolve()
        if not fake_nodes.is_file():
            raise ClusterError(f"no fake nodes file {fake_nodes}")

    def resolve(self, bin_dir: Path, args, build: bool) -> Path:
        return Path(args.fake_nodes).resolve()

    def start(self, run: Run) -> None:
        state, paths = run.state, run.paths
        names = create_fake_nodes(state, paths, run.tools[self.name])
        state["fake_nodes"] = names
        write_state(paths, state)
        wait_until(f"fake nodes {', '.join(names)} to be Ready (kwok) and untainted "
                   "by the node lifecycle controller",
                   lambda: nodes_ready(state, paths, names), 90, run.procs.get("kwok"),
                   paths.log("kwok"), interval=0.5)
        log(f"{len(names)} fake nodes Ready after {time.monotonic() - run.t0:.1f}s")

    def summary(self, run: Run) -> str:
        return f"{len(run.state['fake_nodes'])} fake nodes"


def create_fake_nodes(state: dict, paths: Paths, manifest: Path) -> list[str]:
    """Create the Nodes of `manifest`, then set their capacity and allocatable
    through the status subresource (what a kubelet would report), so they do not
    depend on how the apiserver treats status in a create. Returns the names."""
    # kubectl parses the YAML (stdlib only here): one JSON object per document.
    out = kubectl(state, "create", "--dry-run=client", "-o", "json", "-f", str(manifest))
    items, pos, decoder = [], 0, json.JSONDecoder()
    while out[pos:].strip():
        pos += len(out[pos:]) - len(out[pos:].lstrip())
        doc, pos = decoder.raw_decode(out, pos)
        items.extend(doc.get("items", []) if doc.get("kind") == "List" else [doc])
    names = []
    for node in items:
        if node.get("kind") != "Node":
            raise ClusterError(f"{manifest}: only Nodes are allowed, found {node.get('kind')}")
        name = node["metadata"]["name"]
        annotations = node["metadata"].get("annotations") or {}
        key, _, value = KWOK_NODE_ANNOTATION.partition("=")
        if annotations.get(key) != value:
            raise ClusterError(f"{manifest}: node {name} lacks the annotation {KWOK_NODE_ANNOTATION} "
                               "(kwok would not manage it, and it would never become Ready)")
        status, resp = api(state, paths, "POST", "/api/v1/nodes", node)
        if status not in (200, 201, 409):
            raise ClusterError(f"creating node {name}: HTTP {status}: {resp}")
        want = {k: node.get("status", {})[k] for k in ("capacity", "allocatable")
                if k in node.get("status", {})}
        if want:
            status, resp = api(state, paths, "PATCH", f"/api/v1/nodes/{name}/status",
                               {"status": want}, content_type="application/merge-patch+json")
            if status != 200:
                raise ClusterError(f"setting the status of node {name}: HTTP {status}: {resp}")
        names.append(name)
    return names


def nodes_ready(state: dict, paths: Paths, names: list[str]) -> bool:
    status, resp = api(state, paths, "GET", "/api/v1/nodes")
    if status != 200:
        return False
    by_name = {n["metadata"]["name"]: n for n in resp.get("items", [])}
    for name in names:
        node = by_name.get(name)
        if not node:
            return False
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in node.get("status", {}).get("conditions", []))
        not_ready_taint = any(t.get("key", "").startswith("node.kubernetes.io/")
                              for t in node.get("spec", {}).get("taints", []) or [])
        if not ready or not_ready_taint:
            return False
    return True


KWOK = Kwok()
FAKE_NODES_STEP = FakeNodes()
