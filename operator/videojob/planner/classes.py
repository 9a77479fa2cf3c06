"""Which GPU class a job runs on, and with which layout.

Policy (the README's "Scheduling" section states the same):
1. each class is planned on its own (``choose``: least offload, then
   estimated seconds where each doubling of GPUs must buy at least 10%);
2. across classes: least offload first, then the least cost-weighted
   GPU-seconds (class cost x GPUs x estimated seconds), then the order of the
   inventory;
3. ``spec.resources.gpuClass`` pins a class: only that one is planned.
A job no class can hold fails at once with each class's reason.

``ClassChoice.options`` lists every class that can hold the job with its own
best layout (the same per-class pick), in the cross-class order of 2.; the
first is ``klass``/``chosen``. The scheduler may spill a job to a later one
when its own class is busy (see ``videojob.scheduling.scheduler``).

A re-plan after an out-of-memory failure passes ``margin`` > 1 (the memory
each class offers is divided by it: the estimate is taken to be that much
low) and the layouts that ran out of memory in ``exclude``; what comes out is
stricter: more offload, VAE tiling, more GPUs, or a bigger class.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from ..api.spec import VideoJobSpec
from ..inventory import ClusterInventory, GpuClass
from .calibration import Calibration, load_calibration
from .choose import Alternative, choose, inventory_for_spec, request_from_spec
from .memory import OFFLOAD_MODES


@dataclass(frozen=True)
class ClassChoice:
    klass: GpuClass | None
    chosen: Alternative | None
    reason: str
    # (class name, what the planner said about it), in inventory order.
    considered: tuple[tuple[str, str], ...] = ()
    # Every class that can hold the job with its best layout there, best first
    # (``class_rank``, then inventory order); ``options[0]`` is (klass, chosen).
    options: tuple[tuple[GpuClass, Alternative], ...] = ()

    @property
    def cost(self) -> float:
        if self.chosen is None or self.klass is None:
            return float("inf")
        return self.klass.cost * self.chosen.layout.gpus * self.chosen.seconds


def class_rank(klass: GpuClass, alternative: Alternative) -> tuple[int, float]:
    return (OFFLOAD_MODES.index(alternative.layout.offload),
            klass.cost * alternative.layout.gpus * alternative.seconds)


def plan_classes(spec: VideoJobSpec, inventory: ClusterInventory, calibration: Calibration | None = None,
                 margin: float = 1.0, exclude: Iterable[tuple[str, str]] = ()) -> ClassChoice:
    """The class and layout for ``spec`` (see the module's policy).

    ``exclude``: (class name, layout summary) pairs not to choose again."""
    if margin < 1.0:
        raise ValueError(f"margin must be at least 1, got {margin}")
    calibration = calibration or load_calibration()
    banned = set(exclude)
    pinned = spec.resources.gpu_class
    if pinned is not None:
        try:
            classes = [inventory.get(pinned)]
        except KeyError:
            names = [c.name for c in inventory.classes]
            return ClassChoice(None, None, f"spec.resources.gpuClass: no GPU class {pinned!r} in this cluster; "
                                           f"use one of {names} or leave it unset")
    else:
        classes = list(inventory.classes)
    request = request_from_spec(spec)
    ranked: list[tuple[tuple, GpuClass, Alternative, str]] = []
    considered = []
    for order, klass in enumerate(classes):
        node = inventory_for_spec(spec, klass.node)
        if margin > 1.0:
            node = replace(node, gpu_memory=int(node.gpu_memory / margin))
        result = choose(request, node, calibration, exhaustive=margin > 1.0 or bool(banned))
        pick = next((a for a in result.alternatives
                     if a.fits and (klass.name, a.layout.summary(node.unit)) not in banned), None)
        if pick is None:
            why = result.reason if result.chosen is None else "only layouts that already ran out of memory fit"
            considered.append((klass.name, why))
            continue
        considered.append((klass.name, f"{pick.layout.summary(node.unit)}, ~{pick.seconds:.0f} s"))
        why = result.reason if pick is result.chosen else f"{pick.layout.summary(node.unit)} fits"
        ranked.append(((*class_rank(klass, pick), order), klass, pick, why))
    if not ranked:
        detail = "; ".join(f"{name}: {why}" for name, why in considered)
        scope = f"GPU class {pinned}" if pinned else "any GPU class of this cluster"
        return ClassChoice(None, None, f"does not fit {scope}: {detail}", tuple(considered))
    ranked.sort(key=lambda r: r[0])
    _, klass, pick, why = ranked[0]
    reason = f"class {klass.name}: {why}"
    if len(classes) > 1:
        reason += f" (least offload, then least cost-weighted GPU-seconds of {len(classes)} classes)"
    if margin > 1.0:
        reason += f"; re-planned assuming {margin:.2f}x the estimated memory"
    return ClassChoice(klass, pick, reason, tuple(considered), tuple((k, a) for _, k, a, _ in ranked))


__all__ = ["ClassChoice", "class_rank", "plan_classes"]
