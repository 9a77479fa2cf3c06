"""GPU check: CogVideoX-5b at full size with random weights, 49x720x480, one GPU.

For each offload mode: peak memory (torch.cuda.max_memory_allocated) and
seconds per denoising step, next to the planner's estimates for the same
layout, written to benchmarks/results/gpu-<model>-<gpu>.json. Weights are
random (built from the public configs, no download): memory and latency are
what this measures, not the picture.

  python benchmarks/gpu_check.py                 # on the GPU machine (make gpu-check)
  python benchmarks/gpu_check.py --dry-run       # tiny model on the CPU: checks the script end to end
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from machine import write_result  # noqa: E402
from videojob.catalog import get_model  # noqa: E402
from videojob.planner import GiB, Job, Layout, load_calibration  # noqa: E402
from videojob.planner.latency import LatencyModel  # noqa: E402
from videojob.planner.memory import MemoryModel  # noqa: E402
from videojob_runtime.pipelines import build_tiny_pipeline, pipeline_class, tiny_tokenizer, _scheduler  # noqa: E402
from videojob_runtime.configs import build_component  # noqa: E402
from videojob_runtime.strategies import OffloadConfig, VaeConfig, apply_offload, apply_vae  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def build_pipeline(model_id: str, dtype: str, device: str):
    """Full-size pipeline with random weights, initialised on ``device`` (fast), kept on the host."""
    model = get_model(model_id)
    if model.tiny:
        return build_tiny_pipeline(model_id, "t2v", dtype)
    parts = {}
    for name in ("text_encoder", "transformer", "vae"):
        with torch.device(device):
            parts[name] = build_component(model_id, name, dtype).eval()
        parts[name].to("cpu")
        torch.cuda.empty_cache() if device == "cuda" else None
    return pipeline_class(model_id, "t2v")(tokenizer=tiny_tokenizer(), scheduler=_scheduler(model.family), **parts)


def measure(pipe, device: str, mode: str, tiling: bool, width: int, height: int, frames: int, steps: int,
            guidance: float) -> dict:
    apply_offload(pipe, OffloadConfig(mode=mode, device=device, use_stream=device == "cuda"))
    apply_vae(pipe, VaeConfig(tiling=tiling, slicing=False))
    marks: list[float] = []

    def on_step(p, i, t, kw):
        if device == "cuda":
            torch.cuda.synchronize()
        marks.append(time.perf_counter())
        return {}

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    error = None
    try:
        with torch.inference_mode():
            pipe(prompt="a random-weight benchmark", height=height, width=width, num_frames=frames,
                 num_inference_steps=steps, guidance_scale=guidance, output_type="np",
                 generator=torch.Generator().manual_seed(0), callback_on_step_end=on_step,
                 max_sequence_length=16 if get_model(MODEL).tiny else 226)
    except torch.OutOfMemoryError as exc:
        error = f"OutOfMemory: {exc}".splitlines()[0]
    end = time.perf_counter()
    per_step = (marks[-1] - marks[0]) / (len(marks) - 1) if len(marks) > 1 else None
    peak = torch.cuda.max_memory_allocated() / GiB if device == "cuda" else None
    return {"peakGiB": peak, "secondsPerStep": per_step, "totalSeconds": end - start, "error": error}


MODEL = "cogvideox-5b"


def main() -> int:
    global MODEL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, same code path")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", default="none,model,group,sequential")
    parser.add_argument("--out", help="result file (default: benchmarks/results/gpu-MODEL-GPU.json; "
                                      "a dry run defaults to out/gpu-check-dry-run.json)")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; use --dry-run on a CPU", file=sys.stderr)
        return 2
    MODEL = "tiny-cogvideox" if args.dry_run else "cogvideox-5b"
    model = get_model(MODEL)
    width, height, frames = model.native_width, model.native_height, model.native_frames
    dtype = "float32" if args.dry_run else "bfloat16"
    guidance = model.default_guidance
    cal = load_calibration().model(MODEL)
    job = Job(model, width, height, frames, args.steps, guidance, dtype)
    gpu = "cpu-dry-run"
    if device == "cuda":
        name = torch.cuda.get_device_name(0).lower()
        gpu = next((k for k in ("h200", "h100", "a100", "l40") if k in name), "generic")
    rows = []
    for mode in args.modes.split(","):
        for tiling in (False, True):
            layout = Layout(offload=mode, vae_tiling=tiling, free_text_encoder=False, skip_unread_conv_cache=False)
            estimate = MemoryModel(cal, job).estimate(layout)
            latency = LatencyModel(cal, job, gpu if gpu in ("h200", "h100", "a100", "l40") else "a100").estimate(layout)
            start = time.perf_counter()
            pipe = build_pipeline(MODEL, dtype, device)
            build_s = time.perf_counter() - start
            measured = measure(pipe, device, mode, tiling, width, height, frames, args.steps, guidance)
            row = {"offload": mode, "vaeTiling": tiling, "buildSeconds": round(build_s, 1),
                   "estimatedPeakGiB": round(estimate.peak / GiB, 2), "estimatedPeakStage": estimate.peak_stage,
                   "estimatedSecondsPerStep": round(latency.denoise / args.steps, 3), **measured}
            print(json.dumps(row), flush=True)
            rows.append(row)
            del pipe
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    result = {"benchmark": "gpu-check", "model": MODEL, "width": width, "height": height, "frames": frames,
              "dtype": dtype, "steps": args.steps, "weights": "random, built from the public configs", "rows": rows}
    default = Path("out/gpu-check-dry-run.json") if args.dry_run else RESULTS / f"gpu-{MODEL}-{gpu}.json"
    out = write_result(default.name, result, Path(args.out) if args.out else default)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
