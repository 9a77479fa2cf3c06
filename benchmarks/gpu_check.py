"""GPU check: CogVideoX-5b at full size (random weights), 49 x 720 x 480, through the worker.

What one GPU machine can settle in one 10-minute run, each row through the
real worker path (``RankWorker.run`` with a ``JobRequest``: the same loading,
strategy order, text-encoder parking, VAE strategies, memory measurement and
timings as a job of the operator), the weights random (built from the public
configs on the GPU, no download: ``pipelines.RANDOM_WEIGHTS``):

- each offload mode (none, model, group, sequential) with VAE tiling, and no
  offload without tiling: peak GPU memory (``max_memory_allocated``, what the
  worker reports) next to the planner's estimate for the same layout, and
  seconds per denoising step next to the latency model's;
- the step cache at full size for one policy (the one ``cache: auto`` picks for
  CogVideoX): the same job with the cache off and on, the denoise speedup and
  the share of block evaluations skipped.

Rows run most important first; a row whose expected time would pass
``--budget-s`` is recorded as skipped, and the JSON is rewritten after every
row, so a run cut short still leaves what it measured.

  python benchmarks/gpu_check.py             # on the GPU machine (make gpu-check)
  python benchmarks/gpu_check.py --dry-run   # tiny model on the CPU: the same code path end to end
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from machine import write_result  # noqa: E402
from videojob.catalog import get_model  # noqa: E402
from videojob.planner import GiB, Job, Layout, load_calibration  # noqa: E402
from videojob.planner.latency import LatencyModel  # noqa: E402
from videojob.planner.memory import MemoryModel  # noqa: E402
from videojob_runtime.pipelines import RANDOM_WEIGHTS  # noqa: E402
from videojob_runtime.request import JobRequest  # noqa: E402
from videojob_runtime.worker import RankWorker  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GPU_TYPES = ("h200", "h100", "a100", "l40")


@dataclass(frozen=True)
class Row:
    """One job of the check. Rows sharing (offload, cache) reuse the loaded
    pipeline, as a warm group would: VAE tiling is a per-job strategy."""

    offload: str
    vae_tiling: bool
    cache: str
    steps: int
    purpose: str


def rows_for(model_id: str, dry_run: bool) -> list[Row]:
    """Most important first. The cache pair runs enough steps for the cache to act
    (its warm-up is a share of the steps)."""
    model = get_model(model_id)
    policy = next(p for p in ("dbcache", "fbcache", "teacache") if p in model.caches)
    few, cached = (2, 6) if dry_run else (8, 24)
    return [
        Row("none", True, "off", few, "memory and s/step, no offload"),
        Row("none", False, "off", few, "VAE tiling off (decode peak)"),
        Row("none", True, "off", cached, "step cache baseline"),
        Row("none", True, policy, cached, "step cache on"),
        Row("model", True, "off", few, "model offload"),
        Row("group", True, "off", max(2, few // 2), "group offload"),
        Row("sequential", True, "off", 2, "sequential offload (slow: 2 steps)"),
    ]


def planned(cal, job: Job, row: Row, gpu: str) -> dict[str, Any]:
    """The planner's figures for the layout the worker runs (the text encoder parked
    on the host after encoding, the VAE's unread conv cache skipped: its defaults)."""
    layout = Layout(offload=row.offload, vae_tiling=row.vae_tiling, cache=row.cache)
    memory = MemoryModel(cal, job).estimate(layout)
    latency = LatencyModel(cal, job, gpu if gpu in GPU_TYPES else "a100").estimate(layout)
    return {"estimatedPeakGiB": float(f"{memory.peak / GiB:.4g}"), "estimatedPeakStage": memory.peak_stage,
            "estimatedSecondsPerStep": float(f"{latency.denoise / job.steps:.4g}")}


def run_row(worker: RankWorker, model_id: str, row: Row, dtype: str, seed: int) -> dict[str, Any]:
    model = get_model(model_id)
    request = JobRequest(
        job_id=f"gpu-check-{row.offload}-{row.vae_tiling}-{row.cache}-{row.steps}", model_id=model_id,
        task="t2v", prompt="a random-weight benchmark", width=model.native_width, height=model.native_height,
        frames=model.native_frames, fps=8, steps=row.steps, guidance=model.default_guidance, seed=seed,
        dtype=dtype, source=RANDOM_WEIGHTS, offload=row.offload, vae_tiling=row.vae_tiling, cache=row.cache,
        frames_dtype="uint8", track_memory=worker.device == "cpu")
    start = time.perf_counter()
    result = worker.run(request)
    wall = time.perf_counter() - start
    out: dict[str, Any] = {"wallSeconds": round(wall, 2), "ok": bool(result.get("ok"))}
    if not result.get("ok"):
        error = result.get("error") or {}
        out["error"] = {k: error.get(k) for k in ("reason", "stage", "message", "peak_bytes") if k in error}
        return out
    timings = result["timings"]
    out.update({
        "reusedPipeline": result["reused"],
        "peakGiB": float(f"{result['peak_bytes'] / GiB:.4g}"),
        "secondsPerStep": round(timings["denoise"] / row.steps, 4),
        "stageSeconds": {k: round(v, 3) for k, v in timings.items()},
        "cache": result.get("cache"),
        "framesShape": result.get("frames_shape"),
    })
    return out


def describe_device(device: str) -> tuple[str, dict[str, Any]]:
    if device != "cuda":
        return "cpu-dry-run", {"device": "cpu"}
    props = torch.cuda.get_device_properties(0)
    name = props.name
    gpu = next((k for k in GPU_TYPES if k in name.lower()), "generic")
    return gpu, {"device": "cuda", "name": name, "memoryGiB": round(props.total_memory / GiB, 1),
                 "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
                 "cuda": torch.version.cuda}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, the same code path")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="start no row that would end past this many seconds from the start")
    parser.add_argument("--only", help="comma-separated row numbers (1-based) to run")
    parser.add_argument("--out", help="result file (default: benchmarks/results/gpu-MODEL-GPU.json; "
                                      "a dry run: out/gpu-check-dry-run.json)")
    args = parser.parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; use --dry-run on a CPU", file=sys.stderr)
        return 2
    model_id = "tiny-cogvideox" if args.dry_run else "cogvideox-5b"
    model = get_model(model_id)
    dtype = "float32" if args.dry_run else "bfloat16"
    gpu, device_facts = describe_device(device)
    cal = load_calibration().model(model_id)
    numbered = list(enumerate(rows_for(model_id, args.dry_run), 1))
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        numbered = [(i, r) for i, r in numbered if i in keep]
    default = Path("out/gpu-check-dry-run.json") if args.dry_run else RESULTS / f"gpu-{model_id}-{gpu}.json"
    out_path = Path(args.out) if args.out else default
    worker = RankWorker(0, 1, device=device)
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    last_wall, last_steps = 0.0, 1

    def write() -> Path:
        baseline = next((r for r in results if r["cache"] == "off" and r.get("role") == "step cache baseline"
                         and r.get("ok")), None)
        cached = next((r for r in results if r["cache"] != "off" and r.get("ok")), None)
        cache_summary = None
        if baseline and cached:
            cache_summary = {
                "policy": cached["cache"], "steps": cached["steps"],
                "denoiseSpeedup": round(baseline["stageSeconds"]["denoise"] / cached["stageSeconds"]["denoise"], 3),
                "stats": cached.get("cacheStats"),
            }
        return write_result(out_path.name, {
            "benchmark": "gpu-check", "model": model_id, "width": model.native_width,
            "height": model.native_height, "frames": model.native_frames, "dtype": dtype, "deviceFacts": device_facts,
            "weights": "random, built on the device from the public configs (pipelines.RANDOM_WEIGHTS)",
            "path": "RankWorker.run(JobRequest) in this process: the worker's loading, strategy order, "
                    "text-encoder parking, VAE strategies, memory measurement and stage timings",
            "budgetSeconds": args.budget_s, "elapsedSeconds": round(time.perf_counter() - started, 1),
            "rows": results, "stepCache": cache_summary,
        }, out_path)

    for number, row in numbered:
        elapsed = time.perf_counter() - started
        expected = last_wall * row.steps / last_steps  # the last row's time, scaled by steps
        entry: dict[str, Any] = {"row": number, "role": row.purpose, "offload": row.offload,
                                 "vaeTiling": row.vae_tiling, "cache": row.cache, "steps": row.steps,
                                 **planned(cal, Job(model, model.native_width, model.native_height,
                                                    model.native_frames, row.steps, model.default_guidance, dtype),
                                           row, gpu)}
        if elapsed + expected > args.budget_s:
            entry.update(ok=False, skipped=f"budget: {elapsed:.0f} s used, this row expected ~{expected:.0f} s")
        else:
            measured = run_row(worker, model_id, row, dtype, seed=0)
            if measured.get("cache"):
                entry["cacheStats"] = measured.pop("cache")
            else:
                measured.pop("cache", None)
            entry.update(measured)
            last_wall, last_steps = measured["wallSeconds"], row.steps
        results.append(entry)
        print(json.dumps(entry), flush=True)
        write()
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    worker.shutdown()
    out = write()
    print(f"wrote {out}")
    # An out-of-memory row is a measurement (the planner says whether it should fit);
    # any other error is a broken check.
    broken = [r for r in results if not (r.get("ok") or r.get("skipped")
                                         or (r.get("error") or {}).get("reason") == "OutOfMemory")]
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
