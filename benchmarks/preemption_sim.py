"""Fleet simulation of priority preemption: the real planner, scheduler and victim picker in simulated time.

A two-class fleet (``fleet()``), jobs drawn with a fixed seed: ~80% low
priority (0), long (native size, default steps), Poisson arrivals; ~20% high
priority (100), arriving in bursts. The same arrivals run under each policy
of ``POLICY_TEXT``: no preemption; preemption with checkpoints; preemption
restarting from step 0; and, as a sensitivity row, periodic checkpoints only.

A job's attempt, what a stop costs and how it is counted are in the JSON's
"model" (``MODEL``); run times come from the planner's latency model. The
simulation raises if a pod ever holds more GPUs than it has, or a job is lost.

Writes benchmarks/results/preemption_sim.json (machine.write_result) and .png.
"""

from __future__ import annotations

import heapq
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import RESULTS, write_result  # noqa: E402
from scheduling_sim import _pick, percentile, spec_data  # noqa: E402
from videojob.api import parse_spec  # noqa: E402
from videojob.catalog import get_model  # noqa: E402
from videojob.inventory import parse_inventory  # noqa: E402
from videojob.jobrequest import checkpoint_interval  # noqa: E402
from videojob.planner import load_calibration  # noqa: E402
from videojob.planner.classes import plan_classes  # noqa: E402
from videojob.scheduling import Ask, Scheduler, plan_preemptions  # noqa: E402

SEED = 0
JOBS, PODS = 10_000, (10, 4)  # full run: h100-80 8-GPU pods, l40-48 4-GPU pods (96 GPUs, ~the mix's split)
DRY_JOBS, DRY_PODS = 160, (3, 1)
TARGET_LOAD = 0.85  # the busiest class: offered GPU-seconds (planned layouts, no losses) / its GPU-seconds
HIGH_SHARE, BURST = 0.20, (2, 6)  # high-priority share of jobs; jobs per burst (uniform)
BURST_GAP_S = 10.0  # mean seconds between the jobs of one burst
LOW, HIGH = 0, 100
IDLE_TTL_S = 600.0  # the operator's default warm-group TTL
MIX = {
    "low": {"models": {"wan2.1-t2v-14b": 0.35, "cogvideox1.5-5b": 0.30, "wan2.1-t2v-1.3b": 0.15,
                       "cogvideox-5b": 0.10, "consisid": 0.10},
            "resolutionScale": {"1.0": 1.0}, "steps": {"default": 1.0}},
    "high": {"models": {"cogvideox-5b": 0.30, "wan2.1-t2v-14b": 0.25, "cogvideox1.5-5b": 0.15,
                        "wan2.1-t2v-1.3b": 0.15, "cogvideox-2b": 0.15},
             "resolutionScale": {"1.0": 0.5, "0.75": 0.3, "0.5": 0.2}, "steps": {"default": 0.7, "half": 0.3}},
}
# Assumed (named in the JSON): what no measurement here gives.
GROUP_START_S = 15.0  # placing a Ray group's rank actors before the weight load
CKPT_ASSUMED_S = 1.0  # per checkpoint, only where neither checkpoint.json nor the planner gives one
POLICIES = {  # name: (preempt, periodic checkpoints, save when stopped, what it is)
    "no-preemption": (False, False, False, "priority only orders the queue (backfill keeps the head's reservation)"),
    "preempt-checkpoint": (True, True, True, "plan_preemptions after each schedule; a victim stops at its next step "
                           "boundary, saving a checkpoint there (the runtime's gate.py), plus periodic checkpoints "
                           "every ~10% of the steps for jobs planned over a minute; it resumes from its newest one; "
                           "resumable=True"),
    "preempt-restart": (True, False, False, "the same, no checkpoints: a victim starts again from step 0; "
                        "resumable=False"),
    "preempt-periodic-only": (True, True, False, "sensitivity: periodic checkpoints only, a victim loses the steps "
                              "since the last one (the picker still assumes resumable=True)"),
}

MODEL = {
    "attempt": "group start + weight load (both only on a cold start: a finished job keeps its group warm, "
               "idleTtlSeconds) + encode + the steps not yet saved + checkpoint writes + decode",
    "stop": "at the next boundary: group start, load or encode before the first step, else the end of the current "
            "step (after a periodic write under way); a victim in its last step or decoding finishes instead "
            "(preemptionsEndedFirst)",
    "gpuSecondsLost": "GPUs x (restarts: start/load/encode of stopped attempts; thrownAway: computed steps no "
                      "checkpoint holds; checkpointWrites: every write, periodic and at the stop)",
    "highWait": "first start - arrival (high priority is never preempted)", "lowWait": "all seconds queued",
    "videosPerHour": "completed / makespan (first arrival to last completion)"}

METRICS = {"highWaitP95": "highPriority.waitP95Seconds", "lowWaitP95": "lowPriority.waitP95Seconds",
           "gpuSecondsLost": "gpuSecondsLost", "videosPerHour": "videosPerHour", "preemptions": "preemptions"}


def fleet(pods: tuple[int, int]) -> dict:
    return {"device": "cuda", "classes": [
        {"name": "h100-80", "gpuMemory": "80Gi", "gpusPerPod": 8, "maxPods": pods[0], "hostMemory": "1Ti",
         "gpuType": "h100", "cost": 1.0},
        {"name": "l40-48", "gpuMemory": "48Gi", "gpusPerPod": 4, "maxPods": pods[1], "hostMemory": "512Gi",
         "gpuType": "l40", "cost": 0.55}]}


@dataclass(frozen=True)
class Job:
    index: int
    arrival: float
    shape: tuple  # (model, width, height, frames, steps), as scheduling_sim.spec_data takes it
    priority: int


@dataclass(frozen=True)
class Plan:
    klass: str
    gpus: int
    seconds: float  # the planner's estimate (the scheduler's est_seconds)
    load: float
    encode: float
    per_step: float
    decode: float
    steps: int
    pool_key: str
    every: int  # periodic checkpoint interval in steps (0: none), as the operator's default
    ckpt_s: float  # seconds per checkpoint write


def draw_jobs(n: int, seed: int = SEED) -> tuple[list[tuple[float, bool, float]], list[Job]]:
    """Arrivals at unit rate (to be scaled): (burst or arrival time, high, seconds into its burst); the jobs."""
    rng = random.Random(seed)
    times: list[tuple[float, bool, float]] = []
    low_rate = 1.0 - HIGH_SHARE
    burst_rate = HIGH_SHARE / (sum(BURST) / 2)
    t_low, t_burst = rng.expovariate(low_rate), rng.expovariate(burst_rate)
    while len(times) < n:
        if t_low < t_burst:
            times.append((t_low, False, 0.0))
            t_low += rng.expovariate(low_rate)
        else:
            offset = 0.0
            for _ in range(rng.randint(*BURST)):
                times.append((t_burst, True, offset))
                offset += rng.expovariate(1.0 / BURST_GAP_S)
            t_burst += rng.expovariate(burst_rate)
    times = times[:n]
    jobs = []
    for i, (_, high, _) in enumerate(times):
        mix = MIX["high" if high else "low"]
        model = get_model(_pick(rng, mix["models"]))
        scale = 1.0 if model.fixed_resolution else float(_pick(rng, mix["resolutionScale"]))
        m = model.size_multiple
        width = max(m, int(model.native_width * scale) // m * m)
        height = max(m, int(model.native_height * scale) // m * m)
        steps = model.default_steps if _pick(rng, mix["steps"]) == "default" else model.default_steps // 2
        jobs.append(Job(i, 0.0, (model.id, width, height, model.native_frames, steps), HIGH if high else LOW))
    return times, jobs


def measured_checkpoint_seconds() -> dict[str, float]:
    """Per family, the mean seconds per checkpoint in benchmarks/results/checkpoint.json
    ("families" -> {model id: {"checkpointSeconds": ...}}, checkpoint_bench.py), when it exists."""
    path = RESULTS / "checkpoint.json"
    table = (json.loads(path.read_text()).get("families") or {}) if path.exists() else {}
    return {get_model(model_id).family.value: float(row["checkpointSeconds"]) for model_id, row in table.items()
            if isinstance(row, dict) and isinstance(row.get("checkpointSeconds"), (int, float))}


class Planner:
    """plan_classes per distinct spec (memoized), with the latency split the simulation needs."""

    def __init__(self, inventory):
        self.inventory, self.cal, self.memo = inventory, load_calibration(), {}
        self.measured = measured_checkpoint_seconds()
        self.ckpt_source: dict[str, str] = {}

    def checkpoint_seconds(self, shape: tuple) -> float:
        """Seconds per write: measured per family (checkpoint.json), else the planner's
        estimate per checkpoint, else an assumed figure."""
        family = get_model(shape[0]).family.value
        if family in self.measured:
            self.ckpt_source[family] = "measured: benchmarks/results/checkpoint.json (medium size, that machine)"
            return self.measured[family]
        data = spec_data(shape)  # planned with a checkpoint every ~10% of the steps (any layout)
        data["checkpoint"] = {"everySteps": max(1, round(shape[4] / 10))}
        lat = plan_classes(parse_spec(data), self.inventory, self.cal).chosen.latency
        if lat.checkpoints:
            self.ckpt_source[family] = "the planner's estimate (LatencyEstimate.checkpoint / checkpoints)"
            return lat.checkpoint / lat.checkpoints
        self.ckpt_source[family] = "assumed: provenance.assumed.checkpointSeconds"
        return CKPT_ASSUMED_S

    def plan(self, shape: tuple) -> Plan | None:
        if shape not in self.memo:
            choice = plan_classes(parse_spec(spec_data(shape)), self.inventory, self.cal)
            plan = None
            if choice.chosen:
                a, lat, steps = choice.chosen, choice.chosen.latency, shape[4]
                planned = lat.load + lat.encode + lat.denoise + lat.decode  # without checkpoints, as the operator
                every = checkpoint_interval(steps, None, None, lat.denoise, planned)
                plan = Plan(choice.klass.name, a.layout.gpus, a.seconds, lat.load, lat.encode, lat.denoise / steps,
                            lat.decode, steps, f"{choice.klass.name}|{a.layout.summary()}", every,
                            self.checkpoint_seconds(shape))
            self.memo[shape] = plan
        return self.memo[shape]


@dataclass
class Attempt:
    start: float
    cold: bool
    s0: int  # the step it resumed from
    pod: int
    end: float = 0.0
    over: bool = False  # stopped or ended: later events of it are stale


def attempt_times(plan: Plan, a: Attempt, periodic: bool) -> tuple[float, list[float], float]:
    """(pre-step seconds, the end offset of each step s0+1..steps, completion offset) of an attempt."""
    pre = (GROUP_START_S + plan.load if a.cold else 0.0) + plan.encode
    t, ends = pre, []
    for step in range(a.s0 + 1, plan.steps + 1):
        t += plan.per_step
        ends.append(t)
        if periodic and plan.every and step % plan.every == 0 and step < plan.steps:
            t += plan.ckpt_s
    return pre, ends, t + plan.decode


def simulate(policy: str, jobs: list[Job], planner: Planner, classes: dict) -> dict:
    preempt, periodic, save_on_stop, _ = POLICIES[policy]
    wall = time.perf_counter()
    sched = Scheduler(classes, idle_ttl_s=IDLE_TTL_S)
    plans = {j.index: planner.plan(j.shape) for j in jobs}
    events: list[tuple[float, int, int, int]] = []  # (time, 0 end / 1 stop / 2 arrival, job, attempt)
    for j in jobs:
        if plans[j.index] is not None:
            heapq.heappush(events, (j.arrival, 2, j.index, 0))
    attempts: dict[int, list[Attempt]] = {i: [] for i in plans}
    saved: Counter = Counter()  # the newest checkpoint's step per job
    queued_at: dict[int, float] = {}
    first_start: dict[int, float] = {}
    queue_time: Counter = Counter()  # all seconds waiting, over attempts
    done: dict[int, float] = {}
    lost = Counter()  # GPU-seconds: restarts, thrownAway, checkpointWrites
    busy = 0.0
    stops = ended_first = 0
    holding: dict[tuple[str, int], int] = Counter()  # what physically holds GPUs: attempts + idle groups
    idle: dict[str, tuple[str, int, int]] = {}

    def check(now: float) -> None:
        for (klass, pod), gpus in holding.items():
            if gpus > classes[klass][0] or gpus != sched.classes[klass].used[pod]:
                raise RuntimeError(f"{policy} at {now:.1f} s: pod {klass}/{pod} holds {gpus} GPUs "
                                   f"(has {classes[klass][0]}, the scheduler counts {sched.classes[klass].used[pod]})")

    def release_idle(group: str) -> None:
        klass, pod, gpus = idle.pop(group)
        holding[(klass, pod)] -= gpus

    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, i, n = heapq.heappop(events)
            key, plan = f"j{i}", plans[i]
            if kind == 2:
                queued_at[i] = now
                sched.enqueue(Ask(key, plan.klass, plan.gpus, jobs[i].priority, sched.next_seq(), plan.seconds,
                                  plan.pool_key, restart_s=max(30.0, plan.load + plan.encode),
                                  resumable=periodic and plan.steps >= 2))
                continue
            a = attempts[i][n]
            if a.over:
                continue  # a stale event: the attempt ended otherwise
            a.over = True
            holding[(plan.klass, a.pod)] -= plan.gpus
            pre, ends, _ = attempt_times(plan, a, periodic)
            if kind == 0:
                done[i] = now
                group = sched.running[key].group or f"g{i}.{n}"
                sched.finish(key, now, keep_group=group)
                idle[group] = (plan.klass, a.pod, plan.gpus)
                holding[(plan.klass, a.pod)] += plan.gpus
                writes = sum(1 for s in range(a.s0 + 1, plan.steps) if periodic and plan.every and s % plan.every == 0)
                lost["checkpointWrites"] += plan.gpus * writes * plan.ckpt_s
                busy += plan.gpus * (now - a.start)
                continue
            # kind 1: the victim stopped at a boundary; what it computed past its newest checkpoint is lost
            stops += 1
            elapsed = now - a.start
            computed = sum(1 for e in ends if e <= elapsed + 1e-9)
            writes = sum(1 for s in range(a.s0 + 1, a.s0 + computed + 1)
                         if periodic and plan.every and s % plan.every == 0 and s < plan.steps)
            last = a.s0 + computed
            periodic_here = periodic and plan.every and last % plan.every == 0
            if save_on_stop and computed and last < plan.steps and not periodic_here:
                writes += 1
                saved[i] = last
            elif periodic and plan.every:
                saved[i] = max(a.s0, max((s for s in range(a.s0 + 1, last + 1) if s % plan.every == 0
                                          and s < plan.steps), default=a.s0))
            else:
                saved[i] = 0
            lost["restarts"] += plan.gpus * min(pre, elapsed)
            lost["checkpointWrites"] += plan.gpus * writes * plan.ckpt_s
            lost["thrownAway"] += plan.gpus * (last - saved[i]) * plan.per_step  # restart policy: saved 0
            busy += plan.gpus * elapsed
            sched.preempted(key, now)
            queued_at[i] = now
        sched.expire(now)
        for group in [g for g in idle if g not in sched.idle]:
            release_idle(group)  # expired
        for adm in sched.schedule(now):
            i = int(adm.key[1:])
            plan = plans[i]
            for group in adm.evict + ((adm.reuse,) if adm.reuse else ()):
                release_idle(group)
            a = Attempt(now, adm.reuse is None, saved[i], adm.pod)
            _, _, a.end = attempt_times(plan, a, periodic)
            attempts[i].append(a)
            holding[(plan.klass, adm.pod)] += plan.gpus
            queue_time[i] += now - queued_at[i]
            first_start.setdefault(i, now)
            heapq.heappush(events, (now + a.end, 0, i, len(attempts[i]) - 1))
        check(now)
        if not preempt:
            continue
        for p in plan_preemptions(sched, now):
            i = int(p.victim[1:])
            plan, a = plans[i], attempts[i][-1]
            pre, ends, total = attempt_times(plan, a, periodic)
            x = now - a.start
            if x < pre:  # before the first step: the stage boundaries (start, load, encode)
                marks = [GROUP_START_S, GROUP_START_S + plan.load, pre] if a.cold else [pre]
                stop = next(m for m in marks if m >= x)
            else:
                step_end = next((e for e in ends if e >= x), None)
                stop = total if step_end is None or step_end == ends[-1] else step_end
                k = ends.index(step_end) + a.s0 + 1 if step_end is not None else plan.steps
                periodic_here = periodic and plan.every and k % plan.every == 0
                if save_on_stop and stop < total and not periodic_here:
                    stop += plan.ckpt_s
                elif periodic_here and stop < total:
                    stop += plan.ckpt_s  # the periodic write under way finishes first
            if stop >= total:
                ended_first += 1  # it ends before it could stop: ``finish`` as usual
                continue
            heapq.heappush(events, (a.start + stop, 1, i, len(attempts[i]) - 1))
    submitted = sum(1 for p in plans.values() if p is not None)
    if len(done) != submitted or sched.waiting or sched.running:
        raise RuntimeError(f"{policy}: {submitted} submitted, {len(done)} completed, "
                           f"{len(sched.waiting)} waiting, {len(sched.running)} running at the end")
    arrivals = {j.index: j.arrival for j in jobs}
    makespan = max(done.values()) - min(arrivals.values())
    high = [first_start[i] - arrivals[i] for i in done if jobs[i].priority == HIGH]
    low = [queue_time[i] for i in done if jobs[i].priority == LOW]
    low_turnaround = [done[i] - arrivals[i] for i in done if jobs[i].priority == LOW]
    capacity = sum(per_pod * pods for per_pod, pods in classes.values())
    total_lost = sum(lost.values())
    return {
        "submitted": submitted, "completed": len(done),
        "highPriority": {"jobs": len(high), "waitP50Seconds": _r(percentile(high, 0.5)),
                         "waitP95Seconds": _r(percentile(high, 0.95)), "waitMaxSeconds": _r(max(high)),
                         "waitMeanSeconds": _r(statistics.fmean(high))},
        "lowPriority": {"jobs": len(low), "waitP50Seconds": _r(percentile(low, 0.5)),
                        "waitP95Seconds": _r(percentile(low, 0.95)),
                        "turnaroundP95Seconds": _r(percentile(low_turnaround, 0.95))},
        "gpuSecondsLost": round(total_lost), "gpuSecondsLostParts": {k: round(v) for k, v in sorted(lost.items())},
        "lostShareOfBusy": round(total_lost / busy, 4) if busy else 0.0,
        "videosPerHour": round(len(done) / makespan * 3600, 1),
        "makespanSeconds": round(makespan, 1),
        "busyGpuSeconds": round(busy), "gpuUtilisation": round(busy / (capacity * makespan), 4),
        "preemptions": stops, "preemptionsEndedFirst": ended_first,
        "jobsPreempted": sum(1 for i in done if len(attempts[i]) > 1),
        "simulationWallSeconds": round(time.perf_counter() - wall, 2),
        "_high": high,
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def compare(public: dict) -> dict:
    """The headline metrics side by side, and their ratios between policies."""
    def value(policy: str, name: str) -> float | None:
        row = public[policy]
        for part in METRICS[name].split("."):
            row = row[part]
        return row

    out = {name: {p: value(p, name) for p in public} for name in METRICS}
    pairs = [(m, p, "no-preemption") for m in ("highWaitP95", "lowWaitP95", "videosPerHour")
             for p in ("preempt-checkpoint", "preempt-restart")] + [("gpuSecondsLost", "preempt-restart",
                                                                      "preempt-checkpoint")]
    out["ratios"] = {f"{m} {a} / {b}": _ratio(value(a, m), value(b, m)) for m, a, b in pairs}
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    colors = ["#7f7f7f", "#2ca02c", "#d62728", "#1f77b4"][:len(names)]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.6))
    ax, x = axes[0], range(len(names))
    for off, q, color in ((-0.2, "waitP50Seconds", "#9ecae1"), (0.2, "waitP95Seconds", "#3182bd")):
        ax.bar([i + off for i in x], [max(results[n]["highPriority"][q], 0.1) for n in names], width=0.4,
               color=color, label=q[4:7])
    ax.set_xticks(list(x), names, rotation=15)
    ax.set_yscale("log")
    ax.set_title("High-priority queue wait (s, log)")
    ax.legend()
    ax = axes[1]
    bottom = [0.0] * len(names)
    for part, color in (("thrownAway", "#d62728"), ("restarts", "#ff7f0e"), ("checkpointWrites", "#2ca02c")):
        vals = [results[n]["gpuSecondsLostParts"].get(part, 0) / 3600 for n in names]
        ax.bar(names, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar_label(ax.containers[-1], labels=[f"{b:.1f}" for b in bottom])
    ax.set_ylim(0, max(max(bottom), 0.01) * 1.15)
    ax.set_title("GPU-hours lost to preemption")
    ax.tick_params(axis="x", rotation=15)
    ax.legend()
    ax = axes[2]
    bars = ax.bar(names, [results[n]["lowPriority"]["waitP95Seconds"] for n in names], color=colors)
    ax.bar_label(bars, labels=[f"{results[n]['lowPriority']['waitP95Seconds']:.0f} s\n"
                               f"{results[n]['videosPerHour']:.1f} videos/h" for n in names])
    ax.set_ylim(0, max(results[n]["lowPriority"]["waitP95Seconds"] for n in names) * 1.25)
    ax.set_title("Low-priority wait p95 (s); videos/hour (completed / makespan)")
    ax.tick_params(axis="x", rotation=15)
    ax = axes[3]
    for name, color in zip(names, colors):
        waits = sorted(results[name]["_high"])
        ax.plot([max(w, 0.1) for w in waits], [(k + 1) / len(waits) for k in range(len(waits))], label=name,
                color=color)
    ax.set_xscale("log")
    ax.set_xlabel("high-priority wait (s, log; 0 shown at 0.1)")
    ax.set_title("CDF of high-priority wait")
    ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help=f"jobs to draw (default {JOBS}; dry run {DRY_JOBS})")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"small: {DRY_JOBS} jobs on {DRY_PODS} pods, seconds to run")
    parser.add_argument("--out", type=Path, default=RESULTS / "preemption_sim.json",
                        help="the JSON to write (the plot goes beside it, .png)")
    args = parser.parse_args(argv)
    n = args.jobs or (DRY_JOBS if args.dry_run else JOBS)
    if n < 10:
        raise ValueError(f"--jobs must be at least 10, not {n}")
    pods = DRY_PODS if args.dry_run else PODS
    wall = time.perf_counter()
    inventory = parse_inventory(fleet(pods), "preemption_sim.fleet")
    classes = {c.name: (c.gpus_per_pod, c.max_pods) for c in inventory.classes}
    planner = Planner(inventory)
    times, jobs = draw_jobs(n)
    planned = [planner.plan(j.shape) for j in jobs]
    offered = Counter()
    for p in planned:
        if p is not None:
            offered[p.klass] += p.gpus * p.seconds
    busiest = max(offered, key=lambda k: offered[k] / (classes[k][0] * classes[k][1]))
    rate = TARGET_LOAD * classes[busiest][0] * classes[busiest][1] * n / offered[busiest]
    jobs = [Job(j.index, t / rate + offset, j.shape, j.priority) for j, (t, _, offset) in zip(jobs, times)]
    results = {policy: simulate(policy, jobs, planner, classes) for policy in POLICIES}
    horizon = max(j.arrival for j in jobs)
    png = args.out.with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    title = (f"Preemption simulation: {inventory.capacity} GPUs, {n} jobs ({HIGH_SHARE:.0%} high priority in "
             f"bursts), offered load {TARGET_LOAD:.0%} of {busiest}; planner latency model")
    try:
        plot(results, png, title)
        plotted = str(png)
    except ImportError:  # no matplotlib in this venv: the JSON only
        plotted = None
    public = {p: {k: v for k, v in r.items() if not k.startswith("_")} for p, r in results.items()}
    comparison = compare(public)
    document = {
        "benchmark": "preemption_sim",
        "dryRun": args.dry_run,
        "method": "simulated time, event driven (arrivals, attempt ends, victims' stops); the real plan_classes "
                  "(memoized per distinct spec), Scheduler and plan_preemptions, then Scheduler.preempted when a "
                  "victim reaches its stop boundary; run times from the planner's latency model",
        "provenance": {
            "simulated": "every number under results (nothing here ran on a GPU)",
            "fromThePlanner": "class, GPUs, estimated seconds, load/encode/denoise/decode seconds per layout",
            "measuredBy": "`make bench` runs this simulation (command below); its inputs are the planner's model",
            "assumed": {"groupStartSeconds": GROUP_START_S, "checkpointSeconds": CKPT_ASSUMED_S,
                        "noFailures": "no failures are simulated, so no-preemption writes no checkpoints"},
            "checkpointSecondsSource": dict(sorted(planner.ckpt_source.items())),
        },
        "policies": {name: text for name, (*_, text) in POLICIES.items()},
        "model": MODEL,
        "fleet": {"gpus": inventory.capacity, "classes": fleet(pods)["classes"]},
        "jobs": n, "seed": SEED, "mix": MIX, "highShare": HIGH_SHARE,
        "arrivals": {"low": "Poisson", "high": f"bursts: Poisson burst starts, {BURST[0]}-{BURST[1]} jobs each, "
                                                f"exponential gaps of mean {BURST_GAP_S} s",
                     "jobsPerHour": round(rate * 3600, 1), "lastArrivalSeconds": round(horizon, 1),
                     "offeredLoad": {k: round(rate * v / n / (classes[k][0] * classes[k][1]), 3)
                                     for k, v in offered.items()},
                     "rule": f"the busiest class ({busiest}) is offered {TARGET_LOAD} of its GPU-seconds "
                             "(rate x planned GPU-seconds of its jobs per job / its GPUs)"},
        "idleTtlSeconds": IDLE_TTL_S,
        "distinctSpecs": len(planner.memo),
        "comparison": comparison,
        "results": public,
        "plot": plotted,
        "wallSeconds": round(time.perf_counter() - wall, 1),
    }
    out = write_result("preemption_sim.json", document, path=args.out)
    print(f"{inventory.capacity} GPUs, {n} jobs, {rate * 3600:.0f}/h, offered {TARGET_LOAD:.0%} of {busiest}\n"
          f"{'policy':<22} {'high p50':>9} {'high p95':>9} {'high max':>9} {'low p95':>9} {'lost GPU-s':>11} "
          f"{'videos/h':>9} {'preempts':>9}")
    for policy, r in public.items():
        h = r["highPriority"]
        print(f"{policy:<22} {h['waitP50Seconds']:>9.1f} {h['waitP95Seconds']:>9.1f} {h['waitMaxSeconds']:>9.1f} "
              f"{r['lowPriority']['waitP95Seconds']:>9.1f} {r['gpuSecondsLost']:>11} {r['videosPerHour']:>9.1f} "
              f"{r['preemptions']:>9}")
    print(f"wrote {out}" + (f" and {png}" if plotted else "") + f" in {time.perf_counter() - wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
