"""What the cluster offers: GPU classes, read from the operator's inventory file.

A class is one kind of pod: its GPUs' memory, how many GPUs one pod has (a
job's group never spans pods), how many such pods may run at once, and a
relative cost per GPU-second. The chart renders this file from the same
values as the RayCluster's worker groups, one worker group per class:

    device: cuda                 # cuda, or cpu for CPU ranks (the embedded trial)
    classResources: true         # bundles carry the class resource (default: true on cuda)
    classes:
      - name: a100-80            # a DNS-1123 label; spec.resources.gpuClass names it
        gpuMemory: 80Gi          # per GPU, a Kubernetes quantity
        gpusPerPod: 8
        maxPods: 4               # capacity = maxPods x gpusPerPod
        hostMemory: 1Ti          # host RAM of one pod
        gpuType: a100            # scales the time estimates: a100, l40, h100, h200, generic
        cost: 1.0                # relative cost of one GPU-second (default 1)

The single-class form of the operator issue (``gpuMemory``, ``gpusPerNode``,
``hostMemory``, ``gpuType``, ``device``, ``maxPods`` at the top level) still
reads, as one class named ``default``.

Every bundle of a group of class C carries one unit of the Ray custom resource
``class_resource(C)``, and C's worker group advertises ``gpusPerPod`` of it, so
a group lands on the GPU memory its plan assumed.

Without a file the operator offers this machine's CPUs as CPU ranks (the
embedded trial), the same inventory ``videojob run`` plans with.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .api.spec import parse_bytes
from .planner import GiB, Inventory

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")


def class_resource(name: str) -> str:
    """The Ray custom resource every bundle of a group of class ``name``
    carries and each worker group of that class advertises (one per GPU)."""
    if not _LABEL.match(name or ""):
        raise ValueError(f"GPU class name must be a DNS-1123 label of at most 40 characters, got {name!r}")
    return f"vj-class-{name}"


@dataclass(frozen=True)
class GpuClass:
    """One kind of pod a job's group may land on."""

    name: str
    node: Inventory  # per-GPU memory, GPUs per pod, host RAM, GPU type (what the planner reads)
    max_pods: int = 1
    cost: float = 1.0  # relative cost of one GPU-second
    # The class's pods' node selector (the chart's gpuClasses[].nodeSelector): in
    # kueue admission mode, the Workload's pod set carries it, so Kueue assigns a
    # flavor whose node labels match the class.
    node_selector: tuple[tuple[str, str], ...] = ()

    @property
    def gpus_per_pod(self) -> int:
        return self.node.gpus_per_node

    @property
    def capacity(self) -> int:
        return self.gpus_per_pod * self.max_pods

    @property
    def resource(self) -> str:
        return class_resource(self.name)

    def describe(self) -> str:
        return (f"{self.name} ({self.node.gpu_memory / GiB:.0f} GiB x {self.gpus_per_pod} per pod, "
                f"up to {self.max_pods} pod(s))")


@dataclass(frozen=True)
class ClusterInventory:
    """The GPU classes of a cluster, all on one device kind."""

    classes: tuple[GpuClass, ...]
    device: str = "cuda"  # "cuda" or "cpu"
    # Whether bundles carry the class's custom resource (the Ray cluster's
    # worker groups must advertise it); default: on for cuda, off for cpu.
    class_resources: bool | None = None

    @property
    def uses_class_resources(self) -> bool:
        return self.device == "cuda" if self.class_resources is None else self.class_resources

    def __post_init__(self):
        if not self.classes:
            raise ValueError("an inventory needs at least one GPU class")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"GPU class names must be unique, got {names}")

    @property
    def capacity(self) -> int:
        return sum(c.capacity for c in self.classes)

    @property
    def unit(self) -> str:
        return self.classes[0].node.unit

    def get(self, name: str) -> GpuClass:
        for klass in self.classes:
            if klass.name == name:
                return klass
        raise KeyError(f"no GPU class {name!r}; the inventory has {[c.name for c in self.classes]}")

    # Single-class conveniences (the embedded trial and `videojob run`).
    @property
    def node(self) -> Inventory:
        return self.classes[0].node

    @property
    def max_pods(self) -> int:
        return self.classes[0].max_pods


def local_cpu_inventory() -> ClusterInventory:
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = max(1, min(8, os.cpu_count() or 1))
    node = Inventory(gpu_memory=host // ranks, gpus_per_node=ranks, host_memory=host, gpu_type="generic",
                     unit="CPU rank")
    return ClusterInventory((GpuClass("local", node),), "cpu")


_CLASS_KEYS = {"name", "gpuMemory", "gpusPerPod", "maxPods", "hostMemory", "gpuType", "cost", "nodeSelector"}
_LEGACY_KEYS = {"gpuMemory", "gpusPerNode", "hostMemory", "gpuType", "device", "maxPods"}


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{where} must be an integer, got {value!r}") from None


def _parse_class(data: Any, where: str, device: str) -> GpuClass:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of {sorted(_CLASS_KEYS)}")
    unknown = set(data) - _CLASS_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_CLASS_KEYS)}")
    name = str(data.get("name", ""))
    if not _LABEL.match(name):
        raise ValueError(f"{where}.name must be a DNS-1123 label (a-z, 0-9, '-'; at most 40), got {name!r}")
    gpus = _int(data.get("gpusPerPod", 8), f"{where}.gpusPerPod")
    if not 1 <= gpus <= 8:
        raise ValueError(f"{where}.gpusPerPod must be 1-8, got {gpus}")
    pods = _int(data.get("maxPods", 1), f"{where}.maxPods")
    if not 1 <= pods <= 10_000:
        raise ValueError(f"{where}.maxPods must be 1-10000, got {pods}")
    try:
        cost = float(data.get("cost", 1.0))
    except (TypeError, ValueError):
        raise ValueError(f"{where}.cost must be a number, got {data.get('cost')!r}") from None
    if not 0 < cost < 1e6:
        raise ValueError(f"{where}.cost must be positive, got {cost}")
    try:
        node = Inventory(gpu_memory=parse_bytes(str(data.get("gpuMemory", "80Gi"))), gpus_per_node=gpus,
                         host_memory=parse_bytes(str(data.get("hostMemory", "512Gi"))),
                         gpu_type=str(data.get("gpuType", "a100")),
                         unit="GPU" if device == "cuda" else "CPU rank")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if node.gpu_memory <= 0 or node.host_memory <= 0:
        raise ValueError(f"{where}: gpuMemory and hostMemory must be positive")
    selector = data.get("nodeSelector") or {}
    if not isinstance(selector, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in selector.items()):
        raise ValueError(f"{where}.nodeSelector must be a mapping of label names to strings, got {selector!r}")
    return GpuClass(name, node, pods, cost, tuple(sorted(selector.items())))


def parse_inventory(data: Any, where: str = "inventory") -> ClusterInventory:
    """An inventory from its YAML data; errors name the key and where it was read."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the inventory must be a mapping with 'classes' (a list) and 'device'")
    device = data.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"{where}: device must be cuda or cpu, got {device!r}")
    if "classes" not in data:  # the single-class form
        unknown = set(data) - _LEGACY_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown inventory key(s) {sorted(unknown)}; known: "
                             f"{sorted(_LEGACY_KEYS | {'classes'})}")
        single = {k: v for k, v in data.items() if k != "device"}
        if "gpusPerNode" in single:
            single["gpusPerPod"] = single.pop("gpusPerNode")
        return ClusterInventory((_parse_class({"name": "default", **single}, where, device),), device)
    unknown = set(data) - {"classes", "device", "classResources"}
    if unknown:
        raise ValueError(f"{where}: unknown inventory key(s) {sorted(unknown)}; known: "
                         "['classes', 'classResources', 'device']")
    class_resources = data.get("classResources")
    if class_resources is not None and not isinstance(class_resources, bool):
        raise ValueError(f"{where}.classResources must be true or false, got {class_resources!r}")
    raw = data["classes"]
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}.classes must be a non-empty list of GPU classes")
    classes = tuple(_parse_class(item, f"{where}.classes[{i}]", device) for i, item in enumerate(raw))
    try:
        return ClusterInventory(classes, device, class_resources)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def load_inventory(path: str | None) -> ClusterInventory:
    """The inventory file's classes (this machine's CPUs without a file)."""
    if not path:
        return local_cpu_inventory()
    return parse_inventory(yaml.safe_load(Path(path).read_text()) or {}, str(path))


__all__ = ["ClusterInventory", "GiB", "GpuClass", "class_resource", "load_inventory", "local_cpu_inventory",
           "parse_inventory"]
