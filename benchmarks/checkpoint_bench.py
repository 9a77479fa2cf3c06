"""Denoising checkpoint cost per family at the medium size, and resume bit-identical.

For each family with a denoising loop at its medium benchmark size
(configs.MEDIUM_SIZES: published widths, 4 layers, random weights), one rank,
cache off, the job run by RankWorker in this process as a Ray actor runs it:

  off / on     the same job without checkpoints and with one every EVERY steps,
               interleaved (order rotated each round), REPEATS each, medians:
               the end-to-end overhead ratio side by side in one run
  checkpoint   every CheckpointStore.save of the "on" runs, timed around the
               call (encode, SHA-256, write, fsync, rename, directory fsync):
               seconds (mean, max) and bytes; against the mean denoising step
               of the "off" runs (the worker's denoise stage / steps):
               shareOfStep = checkpointSeconds / stepSeconds
  resume       a run failed after step FAULT (the worker's fault injection),
               then a new run resumed from its newest checkpoint: frames
               bit-identical to the uninterrupted run (resumeBitIdentical)

  python benchmarks/checkpoint_bench.py                          # make bench
  python benchmarks/checkpoint_bench.py --dry-run --out X.json   # 3 steps, one repeat: same code path
Writes benchmarks/results/checkpoint.json (machine.write_result). Exit 1 when a
resume was not bit-identical (the result is written first). The per-family
figures are under "families" -> {model id: {...}} (read by the preemption simulation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import RESULTS, write_result  # noqa: E402


@dataclass(frozen=True)
class Family:
    model_id: str          # the medium-size model
    task: str
    scheduler: str | None  # None: the pipeline's own


FAMILIES = (
    Family("cogvideox-2b", "t2v", None),
    Family("wan2.1-t2v-1.3b", "t2v", "UniPCMultistepScheduler"),
    Family("consisid", "identity", None),
)
STEPS, EVERY, REPEATS = 8, 2, 2
DRY_STEPS, DRY_EVERY, DRY_REPEATS = 3, 1, 1
SEED = 0
PROMPT = "a red fox in snow"  # within the medium size's 16 text tokens
# ConsisID's face hidden states: 32 tokens at the medium size, as stepcache_bench.py feeds.
FACE_VIT_TOKENS = 32


def log(msg: str) -> None:
    print(f"[checkpoint {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fault_step(steps: int) -> int:
    """The step after which the interrupted run fails: past the middle of the job."""
    return steps // 2 + 1


def expected_resume_step(steps: int, every: int) -> int:
    return (fault_step(steps) // every) * every


# -- timing the store's writes ---------------------------------------------------

@contextlib.contextmanager
def timed_saves():
    """Every CheckpointStore.save while inside: (step, bytes, seconds around the call)."""
    from videojob_runtime.checkpoint import CheckpointStore

    original = CheckpointStore.save
    saves: list[dict] = []

    def save(self, step, state):
        start = time.perf_counter()
        out = original(self, step, state)
        saves.append({"step": step, "bytes": out[1], "seconds": time.perf_counter() - start})
        return out

    CheckpointStore.save = save
    try:
        yield saves
    finally:
        CheckpointStore.save = original


# -- the job --------------------------------------------------------------------

def make_request(fam: Family, steps: int, inputs: Path, ckdir: Path | None, **extra):
    from videojob.catalog import get_model
    from videojob_runtime.configs import MEDIUM_SIZES
    from videojob_runtime.request import JobRequest

    medium = MEDIUM_SIZES[fam.model_id]
    data = dict(job_id="ckbench", model_id=fam.model_id, task=fam.task, prompt=PROMPT, width=medium.width,
                height=medium.height, frames=medium.frames, fps=8, steps=steps,
                guidance=get_model(fam.model_id).default_guidance, seed=SEED, dtype="float32",
                frames_dtype="float32", track_memory=False, size="medium")
    if fam.task == "identity":
        data.update(face_image=str(inputs / "face.png"), local_inputs_dir=str(inputs))
    if ckdir is not None:
        data.update(checkpoint_dir=str(ckdir))
    return JobRequest(**{**data, **extra})


def prepare(worker, fam: Family, req, inputs: Path) -> str:
    """Load the pipeline, put the family's scheduler on, write ConsisID's face inputs; the scheduler's name."""
    import diffusers
    import numpy as np
    from PIL import Image
    from videojob_runtime.pipelines import inner_pipeline

    worker.load(req)
    inner = inner_pipeline(worker.pipe)
    if fam.scheduler == "UniPCMultistepScheduler":  # Wan's published scheduler: flow prediction
        inner.scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                            flow_shift=3.0)
    elif fam.scheduler is not None:
        inner.scheduler = getattr(diffusers, fam.scheduler).from_config(inner.scheduler.config)
    if fam.task == "identity":
        cfg = inner.transformer.config
        rng = np.random.default_rng(SEED)
        Image.fromarray((rng.random((req.height, req.width, 3)) * 255).astype("uint8")).save(inputs / "face.png")
        arrays = {"id_cond": rng.standard_normal((1, cfg.LFE_id_dim)).astype("float32")}
        hidden = (1, FACE_VIT_TOKENS, cfg.LFE_vit_dim)
        arrays.update({f"id_vit_hidden_{i}": rng.standard_normal(hidden).astype("float32")
                       for i in range(cfg.LFE_num_scale)})
        np.savez(str(inputs / "face.png.npz"), **arrays)
    return type(inner.scheduler).__name__


def run_ok(worker, req) -> tuple[float, dict]:
    start = time.perf_counter()
    out = worker.run(req)
    seconds = time.perf_counter() - start
    if not out.get("ok"):
        raise RuntimeError(f"{req.model_id}: the job failed: {out.get('error')}")
    return seconds, out


def tensor_bytes(obj) -> int:
    """The bytes of the tensors' storages in ``obj``, each storage once: what torch.save
    writes (a scheduler's views, such as Wan's sigmas and timesteps, share one)."""
    import torch

    storages: dict[tuple[int, int], int] = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            storages[(st.data_ptr(), st.nbytes())] = st.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return sum(storages.values())


def bench_family(fam: Family, steps: int, every: int, repeats: int, root: Path, warmup: bool = True) -> dict:
    """One family: off/on interleaved, every save timed, then interrupted and resumed.
    ``warmup``: one untimed run first (the dry run leaves it out: its figures are not kept)."""
    import numpy as np
    import torch
    from videojob_runtime.checkpoint import CheckpointStore
    from videojob_runtime.resume import job_fingerprint
    from videojob_runtime.worker import RankWorker

    torch.set_num_threads(1)
    inputs = root / f"{fam.model_id}-inputs"
    inputs.mkdir(parents=True)
    worker = RankWorker(0, 1)
    base = make_request(fam, steps, inputs, None)
    build_start = time.perf_counter()
    scheduler = prepare(worker, fam, base, inputs)
    build_s = time.perf_counter() - build_start
    log(f"{base.model_id}: built in {build_s:.1f} s ({scheduler}, {base.width}x{base.height}x{base.frames}, "
        f"{steps} steps)")
    if warmup:
        run_ok(worker, base)
    whole = None  # the uninterrupted reference: the first run without checkpoints

    samples: dict[str, list[float]] = {"off": [], "on": []}
    denoise: dict[str, list[float]] = {"off": [], "on": []}
    saves: list[dict] = []
    hook_seconds: list[float] = []
    on_identical = True
    runs = 0
    for i in range(repeats):
        for kind in (("off", "on") if i % 2 == 0 else ("on", "off")):
            runs += 1
            ckdir = root / f"{fam.model_id}-run{runs}" if kind == "on" else None
            extra = {"checkpoint_every_steps": every} if kind == "on" else {}
            req = make_request(fam, steps, inputs, ckdir, **extra)
            with timed_saves() as these:
                seconds, out = run_ok(worker, req)
            if whole is None and kind == "off":
                whole = out
            samples[kind].append(seconds)
            denoise[kind].append(out["timings"]["denoise"])
            if kind == "on":
                saves.extend(these)
                report = out["checkpoints"]
                hook_seconds.append(report["seconds"] / max(report["written"], 1))
                on_identical &= bool(np.array_equal(out["frames"], whole["frames"]))
                if ckdir.exists():
                    raise RuntimeError(f"{base.model_id}: checkpoints left behind after success in {ckdir}")
            log(f"{base.model_id}: checkpoints {kind}: {seconds:.2f} s")
    if not saves:
        raise RuntimeError(f"{base.model_id}: no checkpoint was written")

    # Interrupted after step `fault`, then resumed from the newest checkpoint.
    fault = fault_step(steps)
    ckdir = root / f"{fam.model_id}-resume"
    failed = worker.run(make_request(fam, steps, inputs, ckdir, checkpoint_every_steps=every,
                                     inject_fault={"stage": "denoise", "step": fault}))
    if failed.get("ok") or (failed.get("error") or {}).get("step") != fault:
        raise RuntimeError(f"{base.model_id}: the interrupted run did not fail at step {fault}: {failed}")
    on_disk = sorted(p.name for p in ckdir.iterdir())
    store = CheckpointStore(ckdir, job_fingerprint(make_request(fam, steps, inputs, ckdir)), steps)
    newest = store.newest().checkpoint
    if newest is None:
        raise RuntimeError(f"{base.model_id}: no readable checkpoint after the interrupted run ({on_disk})")
    resume_s, resumed = run_ok(worker, make_request(fam, steps, inputs, ckdir,
                                                    checkpoint_every_steps=every))
    identical = bool(np.array_equal(resumed["frames"], whole["frames"]))
    max_diff = float(np.abs(resumed["frames"] - whole["frames"]).max())
    log(f"{base.model_id}: interrupted after step {fault} ({', '.join(on_disk)}), resumed from step "
        f"{resumed['checkpoints']['resumedFromStep']}: bit-identical {identical}")

    write_s = [s["seconds"] for s in saves]
    nbytes = [s["bytes"] for s in saves]
    step_s = statistics.median(denoise["off"]) / steps
    ckpt_s = statistics.mean(write_s)
    off_s, on_s = statistics.median(samples["off"]), statistics.median(samples["on"])
    per_job = len(saves) // repeats
    return {
        "model": base.model_id, "scheduler": scheduler,
        "size": base.size, "width": base.width, "height": base.height, "frames": base.frames,
        "steps": steps, "everySteps": every, "checkpointsPerJob": per_job,
        "checkpointSeconds": round(ckpt_s, 5),
        "checkpointSecondsMax": round(max(write_s), 5),
        "checkpointSecondsSamples": [round(s, 5) for s in write_s],
        "hookSecondsPerCheckpoint": round(statistics.mean(hook_seconds), 5),
        "checkpointBytes": int(statistics.mean(nbytes)),
        "checkpointBytesMax": max(nbytes),
        "latentBytes": tensor_bytes(newest.state["outputs"][0]),
        "schedulerStateBytes": tensor_bytes(newest.state["scheduler"]),
        "stateBytes": tensor_bytes(newest.state),
        "stateStep": newest.step,
        "stateFileBytes": newest.nbytes,
        "stepSeconds": round(step_s, 5),
        "shareOfStep": round(ckpt_s / step_s, 5),
        "jobSecondsOff": round(off_s, 4),
        "jobSecondsOn": round(on_s, 4),
        "overhead": round(on_s / off_s - 1, 4),
        "expectedOverhead": round(per_job * ckpt_s / off_s, 5),
        "samples": {k: [round(s, 4) for s in v] for k, v in samples.items()},
        "buildSeconds": round(build_s, 2),
        "checkpointsChangeNothing": on_identical,
        "interruptedAfterStep": fault,
        "checkpointsOnDisk": on_disk,
        "resumedFromStep": resumed["checkpoints"]["resumedFromStep"],
        "expectedResumedFromStep": expected_resume_step(steps, every),
        "resumedJobSeconds": round(resume_s, 4),
        "resumeBitIdentical": identical and resumed["checkpoints"]["resumedFromStep"] == expected_resume_step(
            steps, every),
        "resumeMaxDifference": max_diff,
    }


def filesystem_of(path: Path) -> str | None:
    """The mount's filesystem type (fsync costs differ: ext4 vs tmpfs)."""
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        return None
    return kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help=f"{DRY_STEPS} steps, a checkpoint every {DRY_EVERY}, {DRY_REPEATS} repeat, "
                             "no warm-up: the same code path")
    parser.add_argument("--out", help="result file (default benchmarks/results/checkpoint.json)")
    parser.add_argument("--families", help="comma-separated model ids (default every family)")
    args = parser.parse_args(argv)
    families = FAMILIES
    if args.families:
        wanted = args.families.split(",")
        unknown = sorted(set(wanted) - {f.model_id for f in FAMILIES})
        if unknown:
            raise ValueError(f"--families: unknown {', '.join(unknown)}; known: "
                             f"{', '.join(f.model_id for f in FAMILIES)}")
        families = tuple(f for f in FAMILIES if f.model_id in wanted)
    steps, every, repeats = (DRY_STEPS, DRY_EVERY, DRY_REPEATS) if args.dry_run else (STEPS, EVERY, REPEATS)
    out = Path(args.out) if args.out else RESULTS / "checkpoint.json"
    root = Path(tempfile.mkdtemp(prefix="vj-ckbench-"))
    start = time.perf_counter()
    try:
        rows = {fam.model_id: bench_family(fam, steps, every, repeats, root, warmup=not args.dry_run)
                for fam in families}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    all_identical = all(r["resumeBitIdentical"] for r in rows.values())
    result = {
        "benchmark": "checkpoint",
        "measuredBy": os.environ.get("VIDEOJOB_BENCH_TARGET") or "by hand",
        "ompNumThreads": os.environ.get("OMP_NUM_THREADS"),
        "dryRun": args.dry_run,
        "job": {"steps": steps, "everySteps": every, "repeats": repeats, "seed": SEED, "dtype": "float32",
                "ranks": 1, "cache": "off", "interruptedAfterStep": fault_step(steps),
                "checkpointFilesystem": filesystem_of(root)},
        "families": rows,
        "allResumesBitIdentical": all_identical,
        "seconds": round(time.perf_counter() - start, 1),
        "notes": "One rank, cache off, RankWorker in this process (torch threads 1). checkpointSeconds: "
                 "CheckpointStore.save timed around the call (torch.save encode, SHA-256, write, fsync, "
                 "rename, directory fsync, prune), mean over every checkpoint of the 'on' runs (Max: the "
                 "largest); hookSecondsPerCheckpoint adds the state snapshot (latents and scheduler state "
                 "copied off the loop, RNG states). stepSeconds: the worker's denoise stage / steps of the "
                 "'off' runs (median). shareOfStep = checkpointSeconds / stepSeconds. overhead = on / off - 1 "
                 "on the median job seconds (interleaved runs: on a shared 2-core machine its noise is larger "
                 "than the checkpoints' cost; expectedOverhead = checkpointsPerJob * checkpointSeconds / "
                 "jobSecondsOff). Resume: a run failed after step interruptedAfterStep, a new run resumed "
                 "from its newest checkpoint; resumeBitIdentical: its frames equal the uninterrupted run's "
                 "bit for bit and it resumed from the expected step. Medium size: configs.MEDIUM_SIZES "
                 "(published widths, 4 layers, random weights); Wan runs UniPC (flow prediction, shift 3).",
    }
    written = write_result(out.name, result, out)
    print(json.dumps({m: {k: r[k] for k in ("checkpointSeconds", "checkpointSecondsMax", "checkpointBytes",
                                            "stepSeconds", "shareOfStep", "overhead", "resumeBitIdentical")}
                      for m, r in rows.items()}, indent=2))
    print(f"wrote {written}")
    if not all_identical:
        print("a resume was not bit-identical to the uninterrupted run", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
