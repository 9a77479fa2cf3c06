"""Readable tables for `videojob plan`: chosen layout first, then the rest."""

from __future__ import annotations

from ..api.spec import VideoJobSpec
from .choose import Alternative, Inventory, PlanResult
from .memory import GiB

_SHOWN = 15


def _gib(value: float) -> str:
    return f"{value / GiB:6.2f}"


def _breakdown(alt: Alternative) -> list[str]:
    stages = list(alt.memory.stages)
    parts: list[str] = []
    for stage in stages:
        for part in alt.memory.stages[stage]:
            if part not in parts:
                parts.append(part)
    width = max(len(p) for p in parts + ["total"]) + 2
    lines = ["Memory per GPU (GiB)".ljust(width) + "".join(s.rjust(10) for s in stages)]
    for part in parts:
        cells = [alt.memory.stages[s].get(part) for s in stages]
        lines.append(
            ("  " + part).ljust(width) + "".join(("-" if c is None else f"{c / GiB:.2f}").rjust(10) for c in cells)
        )
    lines.append("  total".ljust(width) + "".join(f"{alt.memory.stage_total(s) / GiB:.2f}".rjust(10) for s in stages))
    return lines


def _row(index: int, alt: Alternative) -> str:
    fits = "yes" if alt.fits else "no: " + alt.why_not
    return (
        f"{index:>3}  {alt.layout.gpus:>4}  {alt.layout.summary():<58}"
        f"{_gib(alt.memory.peak)}  {_gib(alt.memory.need)}  {alt.memory.host_bytes / GiB:7.1f}"
        f"  {alt.latency.total:8.1f}  {fits}"
    )


def _size(value: int) -> str:
    """GiB for a heading: 80, 141, 0.5 (never a size below 1 GiB shown as 0)."""
    return f"{round(value / GiB, 2):g}"


def render_plan(spec: VideoJobSpec, inventory: Inventory, result: PlanResult, show_all: bool = False,
                fits_with: list[str] | None = None) -> str:
    """The plan as a table; ``fits_with``: the caller's own single changes that
    would make a plan that fits none fit (the CLI's flags), shown after the reason."""
    r = spec.resolved()
    lines = [
        f"Plan for {r.model.name} {r.video.width}x{r.video.height}, {r.video.frames} frames, "
        f"{r.sampling.steps} steps, guidance {r.sampling.guidance_scale}, {r.model.dtype}",
        f"on up to {inventory.gpus_per_node} x {_size(inventory.gpu_memory)} GiB GPUs ({inventory.gpu_type}), "
        f"{_size(inventory.host_memory)} GiB host RAM",
        "",
    ]
    if result.chosen:
        c = result.chosen
        lines += [
            f"Chosen: {c.layout.summary()} on {c.layout.gpus} GPU(s)",
            f"  peak {c.memory.peak / GiB:.2f} GiB per GPU in {c.memory.peak_stage} "
            f"(need {c.memory.need / GiB:.2f} with CUDA context and fragmentation), "
            f"host RAM {c.memory.host_bytes / GiB:.1f} GiB",
            f"  per rank: {c.memory.host_phases.get('load', 0) / GiB:.1f} GiB of weights while loading, "
            f"{c.memory.host_phases.get('job', 0) / GiB:.1f} GiB parked on the host during the job; "
            f"{c.memory.decoding_ranks} of {c.layout.gpus} rank(s) decode",
            f"  about {c.latency.total:.0f} s: load {c.latency.load:.0f}, encode {c.latency.encode:.1f}, "
            f"denoise {c.latency.denoise:.0f}, decode {c.latency.decode:.0f}" + (
                f", {c.latency.checkpoints} checkpoint(s) {c.latency.checkpoint:.2f}" if c.latency.checkpoints
                else ", no checkpoints"),
            f"  why: {result.reason}",
            "",
            *_breakdown(c),
        ]
    else:
        reason = result.reason
        if reason.lower().startswith("nothing fits: "):  # the planner's own reason may open with it
            reason = reason[len("nothing fits: "):]
        lines += [f"Nothing fits: {reason}"]
        if fits_with:
            lines += [f"Would fit with: {'; or '.join(fits_with)}"]
    fitting = sum(a.fits for a in result.alternatives)
    lines += [
        "",
        f"Alternatives ({len(result.alternatives)} considered, {fitting} fit; best first):",
        f"{'#':>3}  {'GPUs':>4}  {'layout':<58}{'peak':>6}  {'need':>6}  {'host':>7}  {'seconds':>8}  fits",
    ]
    shown = result.alternatives if show_all else result.alternatives[:_SHOWN]
    lines += [_row(i + 1, a) for i, a in enumerate(shown)]
    if len(shown) < len(result.alternatives):
        lines.append(f"  ... {len(result.alternatives) - len(shown)} more (--all or --json to see them)")
    return "\n".join(lines)


def render_sweep(model_id: str, rows: list[dict], inventory: Inventory) -> str:
    lines = [
        f"Largest {model_id} video that fits, per GPU size (up to {inventory.gpus_per_node} GPU(s), "
        f"{inventory.host_memory / GiB:.0f} GiB host RAM):",
        f"{'GPU GiB':>8}  {'size':>10}  {'frames':>6}  how",
    ]
    for row in rows:
        if row["layout"] is None:
            lines.append(f"{row['gpuGiB']:>8}  {'-':>10}  {'-':>6}  nothing fits")
            continue
        lay = row["layout"]
        size = f"{row['width']}x{row['height']}"
        lines.append(
            f"{row['gpuGiB']:>8}  {size:>10}  {row['frames']:>6}  {lay['summary']} on {lay['gpus']} GPU(s), "
            f"peak {lay['peakGiBPerGPU']} GiB, ~{lay['estimatedSeconds']:.0f} s"
        )
    return "\n".join(lines)
