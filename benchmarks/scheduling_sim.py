"""Fleet simulation: the real class planner and the real gang scheduler in simulated time.

A 512-GPU mixed fleet (``FLEET``), 10,000 jobs drawn with a fixed seed from a
stated mix (``MIX``), Poisson arrivals, and three policies over the same
arrivals:

  ours          ``plan_classes`` picks class and layout (least offload, then
                cost-weighted GPU-seconds); ``Scheduler`` admits (priority,
                FCFS within a priority, EASY backfill, warm groups, and
                load-aware spill: the other classes of ``ClassChoice.options``
                are the job's fallbacks, tried when its own class is busy)
  one-gpu       every job on one GPU, offload allowed: ``plan_classes`` with
                ``maxGPUs: 1`` pinned to each class, smallest GPU memory first;
                the first class where it fits
  eight-gpus    the 8-GPU class only: the fitting layout with the most GPUs the
                planner allows for the model (8 where the model and size allow
                it; the UNets run on 1), best ranked among those

Both baselines go through the same ``Scheduler``: what differs is only where
and how wide each job runs.

Run times are simulated with the planner's latency model: a job runs for the
planner's estimated seconds for its layout on its class's GPU type, less the
estimate's weight-load seconds when it reuses a warm group (every finished
job keeps its group, idle groups expire after ``IDLE_TTL_S``, as the
operator's default). The scheduler's reservations use the full estimate.
Planning is memoized per distinct spec.

The simulation is event driven (arrivals, completions). Two exact
shortcuts keep long queues cheap, and ``verify()`` checks them against the
plain scheduler on a prefix of the same arrivals (identical start times):
- ``_Scheduler`` skips ``_place`` for a job no pod of its class has room for
  (free plus idle GPUs): ``_place`` returns None exactly then (this holds for
  a spill's ``_place`` in the fallback class too);
- per class, only the first ``WINDOW`` waiting jobs in queue order are in the
  scheduler; the rest wait in queue order outside, and are moved in (and the
  scheduler called again at the same instant) whenever one of them could be
  placed, which gives the same admissions as one call over the whole queue.
  This one holds only when classes are independent: with fallbacks (ours) a
  job outside the window could spill, and whether a class's queue is empty
  depends on jobs outside it, so a policy whose asks carry fallbacks keeps
  its whole queue in the scheduler (only the first shortcut applies).

Writes benchmarks/results/scheduling_sim.json (machine.write_result) and
benchmarks/results/scheduling_sim.png.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import RESULTS, write_result  # noqa: E402
from videojob.api import parse_spec  # noqa: E402
from videojob.catalog import get_model  # noqa: E402
from videojob.inventory import ClusterInventory, parse_inventory  # noqa: E402
from videojob.planner import load_calibration  # noqa: E402
from videojob.planner.choose import choose, inventory_for_spec, request_from_spec  # noqa: E402
from videojob.planner.classes import class_rank, plan_classes  # noqa: E402
from videojob.scheduling import Ask, Fallback, Scheduler  # noqa: E402

SEED = 0
JOBS = 10_000
# Offered load: the arrival rate is set so that the work offered, in GPU-seconds
# under ours' layouts, is this fraction of the fleet's GPU-seconds.
TARGET_FLEET_LOAD = 0.5
IDLE_TTL_S = 600.0  # the operator's default VIDEOJOB_WARM_GROUP_TTL_S
WINDOW = 32
VERIFY_JOBS = 500

# 40 x 8 + 32 x 4 + 64 x 1 = 512 GPUs. The planner has no L4 speed: the 24 GiB
# class is planned with gpuType l40 (the slowest calibrated GPU; a real L4 is
# slower, so this flatters the 24 GiB class).
FLEET = {"device": "cuda", "classes": [
    {"name": "h100-80", "gpuMemory": "80Gi", "gpusPerPod": 8, "maxPods": 40, "hostMemory": "1Ti",
     "gpuType": "h100", "cost": 1.0},
    {"name": "l40-48", "gpuMemory": "48Gi", "gpusPerPod": 4, "maxPods": 32, "hostMemory": "512Gi",
     "gpuType": "l40", "cost": 0.55},
    {"name": "l4-24", "gpuMemory": "24Gi", "gpusPerPod": 1, "maxPods": 64, "hostMemory": "128Gi",
     "gpuType": "l40", "cost": 0.3},
]}

# The job mix: model shares; per job, resolution scale (of the model's native
# size; fixed-resolution models stay native), frames (native or about half),
# steps (default or half) and priority are drawn independently.
MIX = {
    "models": {"cogvideox-2b": 0.15, "cogvideox-5b": 0.20, "cogvideox-5b-i2v": 0.10, "cogvideox1.5-5b": 0.10,
               "consisid": 0.05, "wan2.1-t2v-1.3b": 0.15, "wan2.1-t2v-14b": 0.10, "i2vgen-xl": 0.05,
               "animatediff": 0.10},
    "resolutionScale": {"1.0": 0.60, "0.75": 0.25, "0.5": 0.15},
    "frames": {"native": 0.60, "half": 0.40},
    "steps": {"default": 0.70, "half": 0.30},
    "priority": {"0": 0.80, "10": 0.15, "100": 0.05},
    "otherFields": "model defaults (guidance, cache auto, maxGPUs 8, offload allowed)",
}
POLICIES = ("ours", "one-gpu", "eight-gpus")


@dataclass(frozen=True)
class Draw:
    index: int
    arrival: float
    model: str
    width: int
    height: int
    frames: int
    steps: int
    priority: int

    @property
    def shape(self) -> tuple:
        return (self.model, self.width, self.height, self.frames, self.steps)


@dataclass(frozen=True)
class Plan:
    klass: str
    gpus: int
    seconds: float
    load: float
    pool_key: str
    summary: str
    offload_rank: int = 0
    fallbacks: tuple["Plan", ...] = ()  # ours: the other classes' plans, in ``options`` order
    spill: tuple[Fallback, ...] = ()  # the same, as the scheduler takes them

    def on(self, klass: str) -> "Plan":
        """The plan it runs with in ``klass`` (its own or a fallback's)."""
        return self if klass == self.klass else next(f for f in self.fallbacks if f.klass == klass)


def _pick(rng: random.Random, shares: dict) -> str:
    return rng.choices(list(shares), weights=list(shares.values()))[0]


def draw_jobs(seed: int = SEED, n: int = JOBS) -> tuple[list[Draw], list[float]]:
    """The jobs (arrival times at rate 1/s, to be scaled) and the unit-rate gaps."""
    rng = random.Random(seed)
    draws, t = [], 0.0
    for i in range(n):
        model = get_model(_pick(rng, MIX["models"]))
        scale = 1.0 if model.fixed_resolution else float(_pick(rng, MIX["resolutionScale"]))
        m = model.size_multiple
        width = max(m, int(model.native_width * scale) // m * m)
        height = max(m, int(model.native_height * scale) // m * m)
        frames = model.native_frames if _pick(rng, MIX["frames"]) == "native" \
            else model.frames.nearest(model.native_frames // 2)
        steps = model.default_steps if _pick(rng, MIX["steps"]) == "default" else model.default_steps // 2
        priority = int(_pick(rng, MIX["priority"]))
        t += rng.expovariate(1.0)
        draws.append(Draw(i, t, model.id, width, height, frames, steps, priority))
    return draws, [d.arrival for d in draws]


def spec_data(shape: tuple, **resources) -> dict:
    model, width, height, frames, steps = shape
    data = {"model": {"name": model}, "prompt": "a simulated video",
            "video": {"width": width, "height": height, "frames": frames}, "sampling": {"steps": steps}}
    task = get_model(model).tasks[0]
    if task == "i2v":
        data["image"] = "pvc://inputs/image.png"
    if task == "identity":
        data["faceImage"] = "pvc://inputs/face.png"
    if resources:
        data["resources"] = resources
    return data


class Planner:
    """The three policies' plans, memoized per distinct spec."""

    def __init__(self, inventory: ClusterInventory):
        self.inventory = inventory
        self.cal = load_calibration()
        self.memo: dict[tuple, Plan | None] = {}
        self.eight = next(c for c in inventory.classes if c.gpus_per_pod == 8)
        self.by_memory = sorted(inventory.classes, key=lambda c: (c.node.gpu_memory, c.name))
        self.seconds = 0.0

    def _plan(self, klass, alternative, fallbacks: tuple[Plan, ...] = ()) -> Plan:
        summary = alternative.layout.summary()
        return Plan(klass.name, alternative.layout.gpus, alternative.seconds, alternative.latency.load,
                    f"{klass.name}|{summary}", summary, class_rank(klass, alternative)[0], fallbacks,
                    tuple(Fallback(f.klass, f.gpus, f.seconds, f.pool_key, f.offload_rank) for f in fallbacks))

    def plan(self, policy: str, shape: tuple) -> Plan | None:
        key = (policy, shape)
        if key not in self.memo:
            start = time.perf_counter()
            self.memo[key] = getattr(self, "_" + policy.replace("-", "_"))(shape)
            self.seconds += time.perf_counter() - start
        return self.memo[key]

    def _ours(self, shape: tuple) -> Plan | None:
        choice = plan_classes(parse_spec(spec_data(shape)), self.inventory, self.cal)
        if not choice.chosen:
            return None
        return self._plan(choice.klass, choice.chosen, tuple(self._plan(k, a) for k, a in choice.options[1:]))

    def _one_gpu(self, shape: tuple) -> Plan | None:
        for klass in self.by_memory:
            choice = plan_classes(parse_spec(spec_data(shape, maxGPUs=1, gpuClass=klass.name)), self.inventory,
                                  self.cal)
            if choice.chosen:
                return self._plan(klass, choice.chosen)
        return None

    def _eight_gpus(self, shape: tuple) -> Plan | None:
        spec = parse_spec(spec_data(shape, gpuClass=self.eight.name))
        result = choose(request_from_spec(spec), inventory_for_spec(spec, self.eight.node), self.cal)
        fitting = [a for a in result.alternatives if a.fits]  # in the planner's rank order
        if not fitting:
            return None
        most = max(a.layout.gpus for a in fitting)
        return self._plan(self.eight, next(a for a in fitting if a.layout.gpus == most))


class _Scheduler(Scheduler):
    """The real scheduler, with ``_place`` skipped for a job that no pod of its
    class has room for (free plus idle GPUs): exactly when ``_place`` would
    return None (a warm group, a free pod or evicting idle groups all need a pod
    whose free plus idle GPUs cover the job)."""

    _room: dict | None = None

    def room(self, klass: str) -> int:
        c = self.classes[klass]
        idle = [0] * c.max_pods
        for g in self.idle.values():
            if g.klass == klass:
                idle[g.pod] += g.gpus
        return max(c.gpus_per_pod - c.used[p] + idle[p] for p in range(c.max_pods))

    def schedule(self, now):
        self._room = {}
        try:
            return super().schedule(now)
        finally:
            self._room = None

    def _place(self, ask, avoid_pod=None):
        if self._room is not None:
            room = self._room.get(ask.klass)
            if room is None:
                room = self._room[ask.klass] = self.room(ask.klass)
            if ask.gpus > room:
                return None
        return super()._place(ask, avoid_pod)

    def _start(self, ask, *args, **kwargs):
        if self._room is not None:
            self._room.pop(ask.klass, None)
        return super()._start(ask, *args, **kwargs)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def simulate(policy: str, draws: list[Draw], planner: Planner, inventory: ClusterInventory,
             window: int | None = WINDOW) -> dict:
    """Event-driven run of one policy; ``window=None``: the plain scheduler, whole queue.
    A policy whose asks carry fallbacks runs its whole queue in ``_Scheduler`` (see the module)."""
    wall = time.perf_counter()
    classes = {c.name: (c.gpus_per_pod, c.max_pods) for c in inventory.classes}
    sched = (_Scheduler if window else Scheduler)(classes, idle_ttl_s=IDLE_TTL_S)
    plans = {d.index: planner.plan(policy, d.shape) for d in draws}
    if any(p.spill for p in plans.values() if p is not None):
        window = None
    never_fit = [d.index for d in draws if plans[d.index] is None]
    events: list[tuple[float, int, int]] = []  # (time, 0 = completion / 1 = arrival, job index)
    for d in draws:
        if plans[d.index] is not None:
            heapq.heappush(events, (d.arrival, 1, d.index))
    by_key = {f"j{d.index}": d for d in draws}
    backlog: dict[str, list[tuple[tuple, Ask]]] = defaultdict(list)  # per class, heap by queue order
    outside: dict[str, Counter] = defaultdict(Counter)  # per class: GPUs asked -> jobs in the backlog
    in_window: Counter = Counter()
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    busy = Counter()  # GPU-seconds per class
    cost = {c.name: c.cost for c in inventory.classes}
    reuses = evictions = backfills = spills = calls = 0
    ran_on: dict[int, str] = {}

    def add(ask: Ask) -> None:
        """Into the scheduler when it comes before every job kept outside (``trim`` restores the window)."""
        queue = backlog[ask.klass]
        if window is None or not queue or ask.order < queue[0][0]:
            sched.enqueue(ask)
            in_window[ask.klass] += 1
        else:
            heapq.heappush(queue, (ask.order, ask))
            outside[ask.klass][ask.gpus] += 1

    def refill(klass: str) -> bool:
        """Move the next jobs into the scheduler when one of them could start now
        (or the window has room); the caller then schedules again at the same instant."""
        queue = backlog[klass]
        if not queue:
            return False
        if in_window[klass] >= window:
            smallest = min(g for g, n in outside[klass].items() if n)
            if sched.room(klass) < smallest:
                return False
        for _ in range(min(window, len(queue))):
            _, ask = heapq.heappop(queue)
            outside[klass][ask.gpus] -= 1
            sched.enqueue(ask)
            in_window[klass] += 1
        return True

    def trim(klass: str) -> None:
        """Keep the scheduler's share of the queue to the first ``window`` jobs."""
        if in_window[klass] <= window:
            return
        mine = sorted((a for a in sched.waiting.values() if a.klass == klass), key=lambda a: a.order)
        for ask in mine[window:]:
            sched.cancel(ask.key)
            in_window[klass] -= 1
            heapq.heappush(backlog[klass], (ask.order, ask))
            outside[klass][ask.gpus] += 1

    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, index = heapq.heappop(events)
            key = f"j{index}"
            if kind == 0:
                run = sched.running[key]
                sched.finish(key, now, keep_group=run.group or f"g{index}")
            else:
                plan, d = plans[index], by_key[key]
                add(Ask(key, plan.klass, plan.gpus, d.priority, sched.next_seq(), plan.seconds, plan.pool_key,
                        plan.offload_rank, plan.spill))
        sched.expire(now)
        while True:
            calls += 1
            for adm in sched.schedule(now):
                index = int(adm.key[1:])
                in_window[plans[index].klass] -= 1
                plan = plans[index].on(adm.klass)
                ran_on[index] = adm.klass
                seconds = plan.seconds - (plan.load if adm.reuse else 0.0)
                start[index], end[index] = now, now + seconds
                busy[adm.klass] += adm.gpus * seconds
                reuses += adm.reuse is not None
                evictions += len(adm.evict)
                backfills += adm.backfilled
                spills += adm.spilled
                heapq.heappush(events, (now + seconds, 0, index))
            if window is None or not any([refill(k) for k in classes]):
                break
        if window is not None:
            for k in classes:
                trim(k)
    assert not sched.waiting and not any(backlog.values()), "jobs left waiting at the end"
    makespan = max(end.values()) - min(d.arrival for d in draws)
    waits = {i: start[i] - by_key[f"j{i}"].arrival for i in start}
    capacity = inventory.capacity
    per_class = {}
    for c in inventory.classes:
        ran = [i for i in start if ran_on[i] == c.name]
        per_class[c.name] = {
            "jobs": len(ran),
            "spilledIn": sum(ran_on[i] != plans[i].klass for i in ran),
            "busyGpuSeconds": round(busy[c.name]),
            "utilisation": round(busy[c.name] / (c.capacity * makespan), 4),
            "waitP95Seconds": _round(percentile([waits[i] for i in ran], 0.95)),
        }
    by_priority = {}
    for priority in sorted({d.priority for d in draws}):
        w = [waits[i] for i in waits if by_key[f"j{i}"].priority == priority]
        by_priority[str(priority)] = {"jobs": len(w), "waitP50Seconds": _round(percentile(w, 0.5)),
                                      "waitP95Seconds": _round(percentile(w, 0.95))}
    wait_values = list(waits.values())
    return {
        "completed": len(end),
        "neverFit": len(never_fit),
        "throughputVideosPerHour": round(len(end) / makespan * 3600, 1),
        "waitP50Seconds": _round(percentile(wait_values, 0.5)),
        "waitP95Seconds": _round(percentile(wait_values, 0.95)),
        "waitMeanSeconds": _round(statistics.fmean(wait_values)),
        "waitMaxSeconds": _round(max(wait_values)),
        "gpuUtilisation": round(sum(busy.values()) / (capacity * makespan), 4),
        "makespanSeconds": round(makespan, 1),
        "makespanHours": round(makespan / 3600, 2),
        "busyGpuSeconds": round(sum(busy.values())),
        "costPerVideo": round(sum(cost[k] * v for k, v in busy.items()) / max(1, len(end)), 1),
        "warmReuses": reuses,
        "evictions": evictions,
        "backfills": backfills,
        "spills": spills,
        "scheduleCalls": calls,
        "perClass": per_class,
        "byPriority": by_priority,
        "simulationWallSeconds": round(time.perf_counter() - wall, 2),
        "_starts": start,
        "_waits": wait_values,
    }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def offered_load(policy: str, draws: list[Draw], planner: Planner, inventory: ClusterInventory,
                 rate: float) -> dict:
    """Per class: arrival rate x mean GPU-seconds per job there / the class's GPUs (> 1: overloaded)."""
    gpu_seconds = Counter()
    for d in draws:
        plan = planner.plan(policy, d.shape)
        if plan is not None:
            gpu_seconds[plan.klass] += plan.gpus * plan.seconds
    out = {c.name: round(rate * gpu_seconds[c.name] / len(draws) / c.capacity, 3) for c in inventory.classes}
    out["fleet"] = round(rate * sum(gpu_seconds.values()) / len(draws) / inventory.capacity, 3)
    return out


def verify(draws: list[Draw], planner: Planner, inventory: ClusterInventory,
           policies: tuple[str, ...] = POLICIES) -> dict:
    """The shortcuts change nothing: the same start times as the plain scheduler over the whole queue."""
    report = {}
    for policy in policies:
        fast = simulate(policy, draws, planner, inventory, window=4)
        plain = simulate(policy, draws, planner, inventory, window=None)
        if fast["_starts"] != plain["_starts"]:
            diff = sorted(i for i in plain["_starts"] if fast["_starts"].get(i) != plain["_starts"][i])
            raise AssertionError(f"{policy}: the windowed simulation differs from the plain scheduler "
                                 f"for {len(diff)} jobs, first {diff[:5]}")
        report[policy] = {"jobs": len(draws), "identicalStartTimes": True,
                          "plainSeconds": plain["simulationWallSeconds"],
                          "windowedSeconds": fast["simulationWallSeconds"]}
    return report


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    names = list(results)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c"]
    ax = axes[0]
    bars = ax.bar(names, [results[n]["throughputVideosPerHour"] for n in names], color=colors)
    ax.bar_label(bars, fmt="%.0f")
    ax.set_title("Throughput (videos/hour)")
    ax = axes[1]
    x = range(len(names))
    p50 = [max(results[n]["waitP50Seconds"], 0.1) for n in names]
    p95 = [max(results[n]["waitP95Seconds"], 0.1) for n in names]
    ax.bar([i - 0.2 for i in x], p50, width=0.4, label="p50", color="#9ecae1")
    ax.bar([i + 0.2 for i in x], p95, width=0.4, label="p95", color="#3182bd")
    ax.set_xticks(list(x), names)
    ax.set_yscale("log")
    ax.set_title("Queue wait (s, log; 0 shown at 0.1)")
    ax.legend()
    ax = axes[2]
    for name, color in zip(names, colors):
        waits = sorted(results[name]["_waits"])
        ys = [(i + 1) / len(waits) for i in range(len(waits))]
        ax.plot([max(w, 0.1) for w in waits], ys, label=name, color=color)
    ax.set_xscale("log")
    ax.set_xlabel("queue wait (s, log; 0 shown at 0.1)")
    ax.set_title("CDF of queue wait")
    ax.legend(loc="lower right")
    ax = axes[3]
    bars = ax.bar(names, [results[n]["costPerVideo"] for n in names], color=colors)
    ax.bar_label(bars, fmt="%.0f")
    ax.set_title("Cost per video (h100-80 GPU-seconds)")
    fig.suptitle("Scheduling simulation: 512 GPUs, 10,000 jobs (run times from the planner's latency model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=JOBS, help=f"jobs to draw (default {JOBS})")
    parser.add_argument("--verify-jobs", type=int, default=VERIFY_JOBS,
                        help=f"prefix checked against the plain scheduler (default {VERIFY_JOBS}; 0: skip)")
    parser.add_argument("--no-write", action="store_true", help="print the table only (a trial run)")
    args = parser.parse_args(argv)
    wall = time.perf_counter()
    inventory = parse_inventory(FLEET, "scheduling_sim.FLEET")
    assert inventory.capacity == 512, inventory.capacity
    planner = Planner(inventory)
    draws, unit_arrivals = draw_jobs(SEED, args.jobs)
    # Rate: the work offered under ours' layouts is TARGET_FLEET_LOAD of the fleet.
    ours = [planner.plan("ours", d.shape) for d in draws]
    mean_gpu_seconds = statistics.fmean(p.gpus * p.seconds for p in ours if p is not None)
    rate = TARGET_FLEET_LOAD * inventory.capacity / mean_gpu_seconds
    draws = [Draw(d.index, a / rate, d.model, d.width, d.height, d.frames, d.steps, d.priority)
             for d, a in zip(draws, unit_arrivals)]
    for policy in POLICIES[1:]:
        for d in draws:
            planner.plan(policy, d.shape)
    checked = verify(draws[:args.verify_jobs], planner, inventory) if args.verify_jobs else {}
    results = {policy: simulate(policy, draws, planner, inventory) for policy in POLICIES}
    offered = {policy: offered_load(policy, draws, planner, inventory, rate) for policy in POLICIES}
    layouts = {}
    for policy in POLICIES:
        counts = Counter()
        for d in draws:
            plan = planner.plan(policy, d.shape)
            counts[f"{plan.klass}: {plan.summary}" if plan else "never fits"] += 1
        layouts[policy] = dict(counts.most_common(8))
    png = RESULTS / "scheduling_sim.png"
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        plot(results, png)
    public = {p: {k: v for k, v in r.items() if not k.startswith("_")} for p, r in results.items()}
    for policy in POLICIES:
        public[policy]["offeredLoad"] = offered[policy]
        public[policy]["topLayouts"] = layouts[policy]
    document = {
        "benchmark": "scheduling_sim",
        "method": "simulated with the planner's latency model: a job runs for the planner's estimated seconds "
                  "for its layout and class GPU type, less the estimate's weight-load seconds when it reuses a "
                  "warm group; event-driven (arrivals, completions); the real plan_classes and Scheduler; every "
                  "finished job keeps its group warm, idle groups expire after idleTtlSeconds",
        "policies": {
            "ours": "plan_classes (least offload, then cost-weighted GPU-seconds) + Scheduler (priority, FCFS, "
                    "EASY backfill, warm groups, load-aware spill to the other classes of ClassChoice.options: "
                    "a job that cannot start in its class starts on the first one where it needs no more offload, "
                    "no job of that class waits, it fits now and it is expected to finish sooner)",
            "one-gpu": "maxGPUs 1, offload allowed, the smallest-GPU-memory class where it fits (plan_classes "
                       "pinned to each class in turn) + the same Scheduler",
            "eight-gpus": "the 8-GPU class only, the fitting layout with the most GPUs the planner allows (8 where "
                          "the model and size allow; UNets 1), best ranked among those + the same Scheduler",
        },
        "fleet": {"gpus": inventory.capacity, "classes": FLEET["classes"],
                  "note": "the planner has no L4 speed: l4-24 is planned and simulated at gpuType l40's speed "
                          "(optimistic for an L4)"},
        "jobs": args.jobs,
        "seed": SEED,
        "mix": MIX,
        "distinctSpecs": len({d.shape for d in draws}),
        "arrivals": {"process": "Poisson", "ratePerSecond": round(rate, 4), "ratePerHour": round(rate * 3600, 1),
                     "lastArrivalSeconds": round(draws[-1].arrival, 1),
                     "rule": f"rate x mean GPU-seconds per job under ours' layouts = {TARGET_FLEET_LOAD} x "
                             f"{inventory.capacity} GPUs (ours' mean: {mean_gpu_seconds:.1f} GPU-seconds per job)"},
        "idleTtlSeconds": IDLE_TTL_S,
        "metrics": {"throughputVideosPerHour": "completed / makespan", "makespan": "first arrival to last "
                    "completion", "wait": "admission time - arrival time (queue wait), over completed jobs",
                    "gpuUtilisation": "busy GPU-seconds / (512 x makespan); idle warm groups are not busy",
                    "costPerVideo": "class cost x GPUs x run seconds, summed over jobs, per video (cost units: "
                                    "h100-80 GPU-seconds); what ours' class choice minimises per job",
                    "offeredLoad": "rate x mean GPU-seconds per job planned there (its preferred class, before "
                                   "any spill) / the class's GPUs (> 1: more work arrives than the class can run)",
                    "spills": "jobs that started on a fallback class (perClass.spilledIn: per class they ran in)"},
        "exactnessCheck": {"firstJobs": args.verify_jobs, "windowUsed": 4, "policies": checked,
                           "note": "fast path vs the plain Scheduler over the whole queue; a policy whose asks "
                                   "carry fallbacks (ours) uses no window, only the skipped _place"},
        "planningSeconds": round(planner.seconds, 2),
        "results": public,
        "plot": str(png.relative_to(RESULTS.parent.parent)),
        "wallSeconds": round(time.perf_counter() - wall, 1),
    }
    out = None if args.no_write else write_result("scheduling_sim.json", document)
    print(f"fleet 512 GPUs ({', '.join(f'{c.name} {c.gpus_per_pod}x{c.max_pods}' for c in inventory.classes)}); "
          f"{args.jobs} jobs, Poisson {rate * 3600:.0f}/h (offered {TARGET_FLEET_LOAD:.0%} of the fleet under ours)")
    head = (f"{'policy':<11} {'videos/h':>9} {'wait p50 s':>11} {'wait p95 s':>11} {'GPU util':>9} "
            f"{'makespan h':>11} {'never fit':>10} {'cost/video':>11}  offered load per class")
    print(head)
    print("-" * len(head))
    for policy in POLICIES:
        r = public[policy]
        load = ", ".join(f"{k} {v:.2f}" for k, v in r["offeredLoad"].items())
        print(f"{policy:<11} {r['throughputVideosPerHour']:>9.0f} {r['waitP50Seconds']:>11.0f} "
              f"{r['waitP95Seconds']:>11.0f} {r['gpuUtilisation']:>9.1%} {r['makespanHours']:>11.2f} "
              f"{r['neverFit']:>10} {r['costPerVideo']:>11.0f}  {load}")
    spilled_in = {k: v["spilledIn"] for k, v in public["ours"]["perClass"].items()}
    print(f"spills (ours): {public['ours']['spills']} jobs started on a fallback class "
          f"(into {', '.join(f'{k} {v}' for k, v in spilled_in.items())})")
    print(f"exact shortcuts checked on the first {args.verify_jobs} jobs of each policy; planning "
          f"{planner.seconds:.1f} s; total {time.perf_counter() - wall:.0f} s")
    if out is not None:
        print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
