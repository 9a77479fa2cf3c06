"""Pick the layout a job runs with: enumerate, estimate, keep what fits, rank.

Ranking (a fixed order, so more memory can only move the choice forward):
1. least offload (none < model < group < sequential): offload is what a job
   falls back to when nothing fits without it;
2. then estimated seconds, where each doubling of GPUs must buy at least 10%
   (seconds x (1/0.9)^log2(gpus)): fewer GPUs win when the gain is under 10%.
A layout without offload whose peak is the VAE decode also comes with the
denoiser moved to the host for the decode (``decode_offload``), when that
lowers its need: it costs two weight copies, so it wins only where the same
layout without it does not fit.
When nothing fits, the reason names the smallest change that would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any, Iterable

from ..api.spec import VideoJobSpec, parse_bytes
from ..catalog import ModelInfo, get_model
from ..layout_rules import layout_problem as check_layout
from ..layout_rules import resolved_cache
from .calibration import Calibration, load_calibration
from .latency import LatencyEstimate, LatencyModel
from .memory import GiB, OFFLOAD_MODES, Job, Layout, MemoryEstimate, MemoryModel

GPU_SAVING_THRESHOLD = 0.10
SWEEP_GPU_GIB = (12, 16, 24, 48, 80, 141)
_SUGGEST_GPU_GIB = (12, 16, 24, 32, 40, 48, 80, 96, 141, 192)


@dataclass(frozen=True)
class Inventory:
    """What the cluster offers one job: GPUs of one kind in one node."""

    gpu_memory: int = 80 * GiB
    gpus_per_node: int = 8
    host_memory: int = 512 * GiB
    gpu_type: str = "a100"
    # What one rank runs on, in messages: "GPU", or "CPU rank" for `videojob run` on a CPU.
    unit: str = "GPU"


@dataclass(frozen=True)
class Request:
    """The spec's planning knobs, resolved."""

    job: Job
    max_gpus: int = 8
    allow_offload: bool = True
    cache: str = "off"
    parallel: tuple[int, int, int] | None = None
    fp8_weights: bool = False
    # spec.memory overrides (None: the planner chooses).
    offload: str | None = None
    vae_tiling: bool | None = None
    vae_slicing: bool | None = None
    decode_offload: bool | None = None

    @property
    def forced_memory(self) -> str:
        """The spec.memory overrides, as the user wrote them (empty when none)."""
        parts = [f"{k}: {v}" for k, v in (("offload", self.offload), ("vaeTiling", self.vae_tiling),
                                          ("vaeSlicing", self.vae_slicing),
                                          ("decodeOffload", self.decode_offload)) if v is not None]
        return ", ".join(parts)


class Alternative:
    """One layout with its estimates; the full breakdowns are built on demand."""

    def __init__(self, layout: Layout, memory_model: MemoryModel, latency_model: LatencyModel,
                 inventory: Inventory):
        self.layout = layout
        self.unit = inventory.unit
        self._memory_model, self._latency_model = memory_model, latency_model
        self.need = memory_model.need(layout)
        self.host = memory_model.host(layout)
        self.seconds = latency_model.estimate(layout).total
        why = []
        if self.need > inventory.gpu_memory:
            why.append(f"needs {self.need / GiB:.1f} GiB per {inventory.unit}, has {inventory.gpu_memory / GiB:.0f}")
        if self.host > inventory.host_memory:
            why.append(f"needs {self.host / GiB:.0f} GiB host RAM, has {inventory.host_memory / GiB:.0f}")
        self.fits = not why
        self.why_not = "; ".join(why)

    @cached_property
    def memory(self) -> MemoryEstimate:
        return self._memory_model.estimate(self.layout)

    @cached_property
    def latency(self) -> LatencyEstimate:
        return self._latency_model.estimate(self.layout)

    @property
    def rank_key(self) -> tuple[int, float]:
        penalty = (1 / (1 - GPU_SAVING_THRESHOLD)) ** math.log2(self.layout.gpus)
        return OFFLOAD_MODES.index(self.layout.offload), self.seconds * penalty

    def to_json(self) -> dict[str, Any]:
        lay, mem = self.layout, self.memory
        return {
            "gpus": lay.gpus,
            "ulysses": lay.ulysses,
            "ring": lay.ring,
            "cfg": lay.cfg,
            "offload": lay.offload,
            "vaeTiling": lay.vae_tiling,
            "vaeSlicing": lay.vae_slicing,
            "fp8Weights": lay.fp8_weights,
            "decodeOffload": lay.decode_offload,
            "cache": lay.cache,
            "summary": lay.summary(self.unit),
            "peakGiBPerGPU": round(mem.peak / GiB, 2),
            "needGiBPerGPU": round(mem.need / GiB, 2),
            "peakStage": mem.peak_stage,
            "decodingRanks": mem.decoding_ranks,
            "hostRAMGiB": round(mem.host_bytes / GiB, 1),
            "hostRAMPerRankGiB": {phase: round(b / GiB, 2) for phase, b in mem.host_phases.items()},
            "estimatedSeconds": round(self.latency.total, 1),
            "seconds": {
                "load": round(self.latency.load, 1),
                "encode": round(self.latency.encode, 1),
                "denoise": round(self.latency.denoise, 1),
                "decode": round(self.latency.decode, 1),
                "checkpoint": round(self.latency.checkpoint, 2),
            },
            "checkpoints": self.latency.checkpoints,
            "breakdownGiB": {
                stage: {part: round(b / GiB, 3) for part, b in parts.items()}
                for stage, parts in mem.stages.items()
            },
            "fits": self.fits,
            "whyNot": self.why_not,
        }


@dataclass
class PlanResult:
    chosen: Alternative | None
    alternatives: list[Alternative]
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen.to_json() if self.chosen else None,
            "alternatives": [a.to_json() for a in self.alternatives],
            "reason": self.reason,
        }


def resolve_cache(model: ModelInfo, policy: str) -> str:
    return resolved_cache(model, policy)


def request_from_spec(spec: VideoJobSpec) -> Request:
    spec = spec.resolved()
    model = get_model(spec.model.name)
    job = Job(
        model=model,
        width=spec.video.width or model.native_width,
        height=spec.video.height or model.native_height,
        frames=spec.video.frames or model.native_frames,
        steps=spec.sampling.steps or model.default_steps,
        guidance=model.default_guidance if spec.sampling.guidance_scale is None else spec.sampling.guidance_scale,
        dtype=spec.model.dtype,
        checkpoint_every_steps=spec.checkpoint.every_steps if spec.checkpoint else None,
        checkpoint_every_seconds=spec.checkpoint.every_seconds if spec.checkpoint else None,
    )
    p, m = spec.parallel, spec.memory
    return Request(
        job=job,
        max_gpus=spec.resources.max_gpus,
        allow_offload=spec.resources.allow_offload,
        cache=resolve_cache(model, spec.cache.policy),
        parallel=(p.ulysses, p.ring, p.cfg) if p else None,
        offload=m.offload if m else None,
        vae_tiling=m.vae_tiling if m else None,
        vae_slicing=m.vae_slicing if m else None,
        decode_offload=m.decode_offload if m else None,
    )


def inventory_for_spec(spec: VideoJobSpec, inventory: Inventory) -> Inventory:
    """The spec's resources.gpuMemory, when set, overrides the inventory's."""
    if spec.resources.gpu_memory:
        return replace(inventory, gpu_memory=parse_bytes(spec.resources.gpu_memory))
    return inventory


def degree_triples(request: Request, limit: int) -> Iterable[tuple[int, int, int]]:
    """(ulysses, ring, cfg) the model and job allow on at most ``limit`` GPUs (a
    ``parallel`` override is the only candidate, and is refused above the limit)."""
    job = request.job
    candidates = [request.parallel] if request.parallel else [
        (u, r, c) for c in (1, 2) for u in range(1, limit + 1) for r in range(1, limit + 1) if u * r * c <= limit
    ]
    for ulysses, ring, cfg in candidates:
        if ulysses * ring * cfg <= limit and layout_problem(job, ulysses, ring, cfg, request.cache) is None:
            yield (ulysses, ring, cfg)


def job_env(job: Job, ulysses: int, ring: int, cfg: int, cache: str) -> dict:
    """The layout rules' variables for a resolved job and candidate degrees."""
    return {"width": job.width, "height": job.height, "frames": job.frames, "guidance": job.guidance,
            "ulysses": ulysses, "ring": ring, "cfg": cfg, "cache": cache}


def layout_problem(job: Job, ulysses: int, ring: int, cfg: int, cache: str = "off") -> str | None:
    """Why these degrees cannot run this job (None when they can): the same rules,
    from the same definitions, as validation (``layout_rules``)."""
    broken = check_layout(job.model, job_env(job, ulysses, ring, cfg, cache))
    return broken[1] if broken else None


def allowed_offloads(request: Request) -> list[str]:
    model = request.job.model
    if request.offload is not None:
        return [request.offload] if request.offload in model.offload_modes else []
    return [m for m in OFFLOAD_MODES if m in model.offload_modes and (request.allow_offload or m == "none")]


def enumerate_layouts(request: Request, inventory: Inventory, offloads: list[str] | None = None) -> list[Layout]:
    limit = min(request.max_gpus, inventory.gpus_per_node)
    offloads = allowed_offloads(request) if offloads is None else offloads
    triples = list(degree_triples(request, limit))
    tilings = (False, True) if request.vae_tiling is None else (request.vae_tiling,)
    slicing = bool(request.vae_slicing)
    # The runtime offloads only single-rank jobs (offload under xfuser's
    # sequence parallel is not supported there yet).
    # spec.memory.decodeOffload true forces it on every layout without offload (the
    # only ones it applies to); otherwise decode_offload_variants adds it where it helps.
    forced_decode = bool(request.decode_offload)
    return [
        Layout(ulysses=u, ring=r, cfg=c, offload=off, vae_tiling=tiling, vae_slicing=slicing,
               cache=request.cache, fp8_weights=request.fp8_weights,
               decode_offload=forced_decode and off == "none")
        for off in offloads
        for (u, r, c) in triples
        if off == "none" or u * r * c == 1
        for tiling in tilings
    ]


def decode_offload_variants(batch: list[Alternative], memory_model: MemoryModel, latency_model: LatencyModel,
                            inventory: Inventory) -> list[Alternative]:
    """For each layout without offload whose peak is the decode, the same layout
    with the denoiser moved to the host for the decode, where that lowers the need."""
    out = []
    for alt in batch:
        lay = alt.layout
        if lay.offload != "none" or lay.decode_offload or not memory_model.decode_sets_peak(lay):
            continue
        variant = replace(lay, decode_offload=True)
        if memory_model.need(variant) < alt.need:
            out.append(Alternative(variant, memory_model, latency_model, inventory))
    return out


def evaluate_all(calibration: Calibration, request: Request, inventory: Inventory,
                 exhaustive: bool = True) -> list[Alternative]:
    """Estimates for the layouts; with ``exhaustive=False``, offload tiers are
    tried in rank order and the first tier where something fits ends the search
    (the choice is the same: offload is the first ranking key)."""
    cal = calibration.model(request.job.model.id)
    memory_model = MemoryModel(cal, request.job)
    latency_model = LatencyModel(cal, request.job, inventory.gpu_type)
    out: list[Alternative] = []
    for tier in allowed_offloads(request):
        batch = [Alternative(lay, memory_model, latency_model, inventory)
                 for lay in enumerate_layouts(request, inventory, [tier])]
        if request.decode_offload is None:
            batch += decode_offload_variants(batch, memory_model, latency_model, inventory)
        out += batch
        if not exhaustive and any(a.fits for a in batch):
            break
    return out


def candidate_layouts(request: Request, inventory: Inventory, calibration: Calibration | None = None) -> list[Layout]:
    """Every layout the planner would consider for this request (fitting or not):
    what the runtime must be able to run (tests/test_layout_matrix.py)."""
    return [a.layout for a in evaluate_all(calibration or load_calibration(), request, inventory, exhaustive=True)]


def choose(request: Request, inventory: Inventory, calibration: Calibration | None = None,
           exhaustive: bool = True) -> PlanResult:
    """The layout to run with. ``exhaustive=False`` (the operator's fast path)
    lists only the offload tiers it had to try; the choice is identical."""
    calibration = calibration or load_calibration()
    alternatives = evaluate_all(calibration, request, inventory, exhaustive)
    fitting = [a for a in alternatives if a.fits]
    fitting.sort(key=lambda a: a.rank_key)
    rest = sorted((a for a in alternatives if not a.fits), key=lambda a: a.need)
    ordered = fitting + rest
    if not fitting:
        return PlanResult(None, ordered, _no_fit_reason(request, inventory, calibration, alternatives))
    chosen = fitting[0]
    single = [a for a in fitting if a.layout.gpus == 1]
    reason = (f"fits in {inventory.gpu_memory / GiB:.0f} GiB per {inventory.unit} with "
              f"{chosen.need / GiB:.1f} GiB needed")
    if chosen.layout.gpus > 1 and single:
        speedup = single[0].seconds / chosen.seconds
        reason += f"; {speedup:.1f}x faster than the best 1-{inventory.unit} layout"
    if chosen.layout.offload != "none":
        reason += f"; {chosen.layout.offload} offload because no layout fits without it"
    return PlanResult(chosen, ordered, reason)


def plan_spec(spec: VideoJobSpec, inventory: Inventory, calibration: Calibration | None = None,
              exhaustive: bool = True) -> PlanResult:
    return choose(request_from_spec(spec), inventory_for_spec(spec, inventory), calibration, exhaustive)


def _fits(request: Request, inventory: Inventory, calibration: Calibration) -> bool:
    return any(a.fits for a in evaluate_all(calibration, request, inventory, exhaustive=False))


def _no_fit_reason(request: Request, inventory: Inventory, calibration: Calibration,
                   alternatives: list[Alternative]) -> str:
    job, model = request.job, request.job.model
    if not alternatives:
        if request.parallel:
            u, r, c = request.parallel
            limit = min(request.max_gpus, inventory.gpus_per_node)
            if u * r * c > limit:
                return (f"parallel ulysses {u} x ring {r} x cfg {c} needs {u * r * c} {inventory.unit}s in one "
                        f"node; this node has {inventory.gpus_per_node} (resources.maxGPUs {request.max_gpus}): "
                        "lower the degrees or drop the parallel override")
            problem = layout_problem(job, u, r, c, request.cache)
            return f"parallel ulysses {u} x ring {r} x cfg {c} cannot run this job: {problem}"
        if request.offload is not None and request.offload not in job.model.offload_modes:
            return f"memory.offload {request.offload} is not available for {job.model.id}"
        return "no parallel layout is valid for this model and size"
    smallest = min(alternatives, key=lambda a: a.need)
    head = (
        f"nothing fits: the smallest layout ({smallest.layout.summary(inventory.unit)}) {smallest.why_not}"
    )
    fixes: list[str] = []
    if request.forced_memory:
        free = replace(request, offload=None, vae_tiling=None, vae_slicing=None, decode_offload=None)
        if _fits(free, inventory, calibration):
            fixes.append(f"remove the spec.memory override ({request.forced_memory}): the planner finds a layout")
    if not request.allow_offload and _fits(replace(request, allow_offload=True), inventory, calibration):
        fixes.append("set resources.allowOffload: true")
    node_gpus = inventory.gpus_per_node
    if request.max_gpus < node_gpus and _fits(replace(request, max_gpus=node_gpus), inventory, calibration):
        fixes.append(f"raise resources.maxGPUs to {node_gpus}")
    frames = [f for f in range(job.frames - 1, 0, -1) if model.frames.accepts(f)]
    for f in frames:
        if _fits(replace(request, job=replace(job, frames=f)), inventory, calibration):
            fixes.append(f"fewer frames: video.frames {f} (from {job.frames})")
            break
    if not model.fixed_resolution:
        m = model.size_multiple
        for scale in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3):
            w = max(m, int(job.width * scale) // m * m)
            h = max(m, int(job.height * scale) // m * m)
            if (w, h) == (job.width, job.height) or w < model.min_size or h < model.min_size:
                continue
            smaller = replace(request, job=replace(job, width=w, height=h))
            if _fits(smaller, inventory, calibration):
                fixes.append(f"lower resolution: {w}x{h} (from {job.width}x{job.height})")
                break
    for gib in _SUGGEST_GPU_GIB:
        if gib * GiB > inventory.gpu_memory and _fits(request, replace(inventory, gpu_memory=gib * GiB), calibration):
            fixes.append(f"GPUs with {gib} GiB")
            break
    if not fixes:
        return head + "; no single change found that would make it fit"
    return head + "; would fit with any of: " + "; ".join(fixes)


def sweep(model_id: str, inventory: Inventory, steps: int | None = None,
          calibration: Calibration | None = None) -> list[dict[str, Any]]:
    """Per GPU size, the largest width x height x frames that fits, and how."""
    calibration = calibration or load_calibration()
    model = get_model(model_id)
    frames = sorted((f for f in range(1, model.frames.maximum + 1) if model.frames.accepts(f)), reverse=True)
    m = model.size_multiple
    sizes = [(model.native_width, model.native_height)]
    if not model.fixed_resolution:
        for scale in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2):
            w, h = int(model.native_width * scale) // m * m, int(model.native_height * scale) // m * m
            if w >= model.min_size and h >= model.min_size and (w, h) not in sizes:
                sizes.append((w, h))
    candidates = sorted(((w, h, f) for (w, h) in sizes for f in frames), key=lambda c: -(c[0] * c[1] * c[2]))
    rows = []
    for gib in SWEEP_GPU_GIB:
        inv = replace(inventory, gpu_memory=gib * GiB)
        row: dict[str, Any] = {"gpuGiB": gib, "width": None, "height": None, "frames": None, "layout": None}
        for w, h, f in candidates:
            job = Job(model, w, h, f, steps or model.default_steps, model.default_guidance)
            result = choose(Request(job=job, max_gpus=inventory.gpus_per_node,
                                    cache=resolve_cache(model, "auto")), inv, calibration)
            if result.chosen:
                row.update(width=w, height=h, frames=f, layout=result.chosen.to_json())
                break
        rows.append(row)
    return rows
