"""Planner benchmark: plans per second over random valid specs, and the anchors.

Writes benchmarks/results/planner.json. Goal: 2,000 plans/s or more on the
2-core CI machine, so the operator can re-plan a whole queue every second.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import describe  # noqa: E402
from videojob.catalog import CATALOG, get_model  # noqa: E402
from videojob.planner import GiB, Inventory, Job, Layout, Request, choose, load_calibration, resolve_cache  # noqa: E402
from videojob.planner.latency import LatencyModel  # noqa: E402
from videojob.planner.memory import MemoryModel  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SPECS = 10_000


def random_request(rng: random.Random, models: list) -> tuple[Request, Inventory]:
    model = rng.choice(models)
    frames = rng.choice([f for f in range(1, model.frames.maximum + 1) if model.frames.accepts(f)])
    if model.fixed_resolution:
        width, height = model.native_width, model.native_height
    else:
        m = model.size_multiple
        width = rng.randint(max(model.min_size, 128) // m, model.native_width // m) * m
        height = rng.randint(max(model.min_size, 128) // m, model.native_height // m) * m
    guidance = rng.choice([1.0, model.default_guidance])
    job = Job(model, width, height, frames, rng.randint(10, 60), guidance, rng.choice(["bfloat16", "float16"]))
    request = Request(job=job, max_gpus=rng.choice([1, 2, 4, 8]), allow_offload=rng.random() < 0.9,
                      cache=resolve_cache(model, rng.choice(["off", "auto"])))
    inventory = Inventory(gpu_memory=rng.choice([12, 16, 24, 48, 80, 141]) * GiB, gpus_per_node=rng.choice([1, 2, 4, 8]),
                          host_memory=rng.choice([64, 256, 1024]) * GiB)
    return request, inventory


def throughput(exhaustive: bool, cases: list) -> dict:
    cal = load_calibration()
    start = time.perf_counter()
    fitted = sum(choose(req, inv, cal, exhaustive=exhaustive).chosen is not None for req, inv in cases)
    seconds = time.perf_counter() - start
    return {"specs": len(cases), "seconds": round(seconds, 3), "plansPerSecond": round(len(cases) / seconds),
            "fitted": fitted}


def memory_anchors() -> list[dict]:
    """CogVideoX-2b, 49 frames 720x480, fp16: published max_memory_allocated (diffusers docs)."""
    cal = load_calibration().model("cogvideox-2b")
    model = MemoryModel(cal, Job(get_model("cogvideox-2b"), 720, 480, 49, 50, 6.0, "float16"))
    rows = []
    for name, layout, published in [
        ("none (diffusers default: text encoder kept)", Layout(free_text_encoder=False), 33.0),
        ("model offload", Layout(offload="model"), 19.0),
        ("sequential offload + VAE tiling", Layout(offload="sequential", vae_tiling=True), 4.0),
        ("model offload + VAE tiling", Layout(offload="model", vae_tiling=True), 11.0),
    ]:
        est = model.estimate(layout).peak / GiB
        rows.append({"layout": name, "estimatedGiB": round(est, 2), "publishedGiB": published,
                     "publishedIsUpperBound": published == 4.0,
                     "error": round((est - published) / published, 3)})
    return rows


def latency_anchors() -> list[dict]:
    """CogVideoX-5b, 49x720x480, s/step (xDiT docs): estimate vs published."""
    cal = load_calibration().model("cogvideox-5b")
    job = Job(get_model("cogvideox-5b"), 720, 480, 49, 1, 6.0)
    rows = []
    for gpu, degrees, published in [
        ("l40", (1, 1, 1), 6.28), ("l40", (2, 1, 1), 3.63), ("l40", (1, 2, 1), 3.65), ("l40", (1, 1, 2), 3.05),
        ("l40", (2, 1, 2), 1.80), ("l40", (3, 2, 2), 0.82),
        ("a100", (1, 1, 1), 4.07), ("a100", (1, 1, 2), 2.12), ("a100", (2, 1, 2), 1.27),
    ]:
        u, r, c = degrees
        est = LatencyModel(cal, job, gpu).estimate(Layout(ulysses=u, ring=r, cfg=c)).denoise
        rows.append({"gpu": gpu, "ulysses": u, "ring": r, "cfg": c, "estimatedSecondsPerStep": round(est, 2),
                     "publishedSecondsPerStep": published, "error": round((est - published) / published, 3)})
    return rows


def main() -> int:
    rng = random.Random(0)
    models = [m for m in CATALOG.values() if not m.tiny and m.id in load_calibration().models]
    cases = [random_request(rng, models) for _ in range(SPECS)]
    fast = throughput(False, cases)
    full = throughput(True, cases[:2000])
    result = {
        "benchmark": "planner",
        "machine": describe(),
        "goalPlansPerSecond": 2000,
        "operatorFastPath": fast,
        "exhaustiveForCLI": full,
        "memoryAnchors": memory_anchors(),
        "latencyAnchors": latency_anchors(),
        "notes": "operatorFastPath stops at the first offload tier where a layout fits (same choice as the "
                 "exhaustive search, checked by tests/test_planner.py); exhaustiveForCLI lists every layout.",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("operatorFastPath", "exhaustiveForCLI")}, indent=2))
    for row in result["memoryAnchors"]:
        print(f"  memory  {row['layout']:<44} est {row['estimatedGiB']:6.2f} GiB  published {row['publishedGiB']}")
    for row in result["latencyAnchors"]:
        print(f"  latency {row['gpu']} u{row['ulysses']} r{row['ring']} cfg{row['cfg']}: est "
              f"{row['estimatedSecondsPerStep']:.2f} s/step  published {row['publishedSecondsPerStep']}")
    return 0 if fast["plansPerSecond"] >= 2000 else 1


if __name__ == "__main__":
    raise SystemExit(main())
