"""The memory planner: how much GPU memory a job needs and which layout runs it.

Pure functions of a spec and an inventory (no torch, no I/O besides reading
the checked-in calibration table once), fast enough to re-plan a queue often.
"""

from .calibration import Calibration, load_calibration, parse_calibration
from .choose import (
    Alternative, Inventory, PlanResult, Request, candidate_layouts, choose, enumerate_layouts, inventory_for_spec,
    plan_spec, request_from_spec, resolve_cache, sweep,
)
from .latency import LatencyEstimate, estimate_latency
from .memory import GiB, Job, Layout, MemoryEstimate, estimate_memory

__all__ = [
    "Alternative", "Calibration", "candidate_layouts", "GiB", "Inventory", "Job", "LatencyEstimate", "Layout",
    "MemoryEstimate", "PlanResult", "Request", "choose", "enumerate_layouts", "estimate_latency",
    "estimate_memory", "inventory_for_spec", "load_calibration", "parse_calibration", "plan_spec",
    "request_from_spec", "resolve_cache", "sweep",
]  # fmt: skip
