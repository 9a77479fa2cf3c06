"""Step caches at a size where the denoiser dominates: speed, quality and memory, side by side.

For each family (CogVideoX-2b, Wan-1.3B, ConsisID) at its medium size
(``videojob_runtime.configs.MEDIUM_SIZES``: the published transformer's widths,
heads and head dims with fewer layers, a short prompt, a small video), one
pipeline with one set of random weights and one seed runs cache off and every
cache policy the catalog gives the model, at several thresholds, round-robin,
``--repeats`` times each. Per (policy, threshold):

  speedup         median denoise-stage seconds, cache off / cache on (the stage:
                  from the first denoiser call to the end of the last step);
                  also from the denoising thread's CPU seconds, which a busy
                  shared machine does not inflate (speedupCpuTime)
  skipped         transformer block evaluations skipped (dbcache/fbcache count
                  blocks; teacache skips whole denoiser calls, i.e. all blocks)
  quality         PSNR and max abs error vs cache off on the denoised latents
                  (peak = the reference's max - min) and on the decoded frames
                  (in [0, 1], peak 1)
  memory          bytes of the tensors the cache holds at the end of the last
                  step (found by walking the cache's state from the transformer
                  and the handle; weights excluded) vs the planner's "step
                  cache" figure for the same job (videojob.planner.memory)

A cache-off profile run per family first (also the warm-up) gives the
transformer's share of the denoise stage, the blocks' share of the transformer,
and the per-step decision statistics the thresholds were chosen from.

Sequence parallel 2 (two processes, gloo, xfuser's Ulysses on the CPU, built
by the runtime's ``build_parallel_pipeline`` as the worker does): cache off vs
each SP-capable policy at the threshold the sweep chose; both ranks' per-call
skip decisions are compared.

``cache: auto`` rule: per family, the fastest (CPU-time speedup) (policy, threshold) whose latents
stay at PSNR >= 30 dB against cache off and >= 20 dB above the PSNR between
two seeds' latents (``quality_floor_db``); compared with what the runtime does
today (layout_rules.resolved_cache and the cache's default threshold).

  python benchmarks/stepcache_bench.py            # the medium size (minutes)
  python benchmarks/stepcache_bench.py --dry-run --out X.json --png X.png  # tiny models, same code path
Writes benchmarks/results/stepcache.json (machine.write_result) and stepcache.png.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from machine import RESULTS, write_result  # noqa: E402

# (full-size model, the tiny model of the same family for --dry-run)
FAMILIES = (("cogvideox-2b", "tiny-cogvideox"), ("wan2.1-t2v-1.3b", "tiny-wan"), ("consisid", "tiny-consisid"))
STEPS = 10
DRY_STEPS = 4
REPEATS = 3
SEED = 0
PROMPT, NEGATIVE = "a red fox runs through fresh snow at dawn", "blurry, low quality"
AUTO_MIN_PSNR_DB = 30.0
AUTO_MARGIN_OVER_OTHER_SEED_DB = 20.0
# ConsisID's face inputs: EVA-CLIP ViT-L/14-336 hidden states are 577 tokens;
# at the medium size the face extractor would then be ~30% of the
# transformer's time (measured), against well under 1% at full size, so the
# medium job feeds 32 (the extractor's widths are the published ones).
FACE_VIT_TOKENS = 32
DRY_FACE_VIT_TOKENS = 5

# Thresholds per (family, policy), ascending; the runtime's default is among
# them (what `auto` runs today: 0.08 dbcache, 0.05 fbcache, 0.1 teacache). The
# others span the decision statistics of the cache-off profile run (in the
# JSON as "decisionStatistics"; medium size, 10 steps, seed 0): from just above
# the smallest per-step change (few skips) to the largest (skip all but warmup).
#   CogVideoX-2b first-block residual change 0.80-0.99 per step (random
#     weights: the timestep modulation dominates the residual);
#   Wan-1.3B first-block residual change 0.15-0.21 (both CFG branches);
#   every family's input change 0.015-0.16 per step, rising (teacache sums it
#     until the threshold, so 0.05-0.3 spans one to several skipped steps in a row).
TEACACHE_THRESHOLDS = (0.05, 0.1, 0.2, 0.3)
THRESHOLDS = {
    ("cogvideox", "dbcache"): (0.08, 0.82, 0.86, 1.0),
    ("cogvideox", "fbcache"): (0.05, 0.82, 0.86, 1.0),
    ("cogvideox", "teacache"): TEACACHE_THRESHOLDS,
    ("wan", "dbcache"): (0.08, 0.16, 0.18, 0.22),
    ("wan", "fbcache"): (0.05, 0.16, 0.18, 0.22),
    ("wan", "teacache"): TEACACHE_THRESHOLDS,
    ("consisid", "teacache"): TEACACHE_THRESHOLDS,
}


def log(msg: str) -> None:
    print(f"[stepcache {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the job ------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One family's benchmark job."""

    family: str
    model_id: str           # the catalog model whose facts apply (caches, CFG calls)
    size: str               # "medium" (load_pipeline size) or "full" (a tiny catalog model)
    task: str
    width: int
    height: int
    frames: int
    steps: int
    guidance: float
    text_tokens: int
    layers: int
    face_vit_tokens: int


def make_case(full_id: str, tiny_id: str, dry_run: bool) -> Case:
    from videojob.catalog import get_model
    from videojob_runtime.configs import MEDIUM_SIZES

    model = get_model(tiny_id if dry_run else full_id)
    task = model.tasks[0]
    if dry_run:
        return Case(model.family.value, tiny_id, "full", task, model.native_width, model.native_height,
                    model.native_frames, DRY_STEPS, model.default_guidance, model.arch.text_tokens,
                    model.arch.layers, DRY_FACE_VIT_TOKENS)
    size = MEDIUM_SIZES[full_id]
    return Case(model.family.value, full_id, "medium", task, size.width, size.height, size.frames, STEPS,
                model.default_guidance, size.text_tokens, size.layers, FACE_VIT_TOKENS)


def build_pipeline(case: Case):
    from videojob_runtime.pipelines import load_pipeline

    pipe = load_pipeline(case.model_id, case.task, "float32", seed=SEED, size=case.size)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(pipe, case: Case) -> dict:
    """The pipeline call's arguments: the prompt encoded once by the runtime's
    encode_and_release (so no run times the text encoder), the task's inputs."""
    import torch
    from videojob_runtime.generate import call_parameters
    from videojob_runtime.pipelines import inner_pipeline
    from videojob_runtime.strategies import TextEncoderConfig, encode_and_release

    inner = inner_pipeline(pipe)
    embeds = encode_and_release(inner, TextEncoderConfig(release="keep"), PROMPT, NEGATIVE,
                                do_classifier_free_guidance=case.guidance > 1.0,
                                max_sequence_length=case.text_tokens, device=torch.device("cpu"))
    kwargs = dict(height=case.height, width=case.width, num_frames=case.frames,
                  num_inference_steps=case.steps, guidance_scale=case.guidance, output_type="np",
                  max_sequence_length=case.text_tokens, **embeds.pipeline_kwargs())
    if case.task == "identity":
        from PIL import Image

        cfg = inner.transformer.config
        rng = np.random.default_rng(SEED)
        gen = torch.Generator().manual_seed(SEED)
        kwargs["image"] = Image.fromarray((rng.random((case.height, case.width, 3)) * 255).astype("uint8"))
        kwargs["id_cond"] = torch.randn(1, cfg.LFE_id_dim, generator=gen)
        kwargs["id_vit_hidden"] = [torch.randn(1, case.face_vit_tokens, cfg.LFE_vit_dim, generator=gen)
                                   for _ in range(cfg.LFE_num_scale)]
    accepted = call_parameters(pipe)
    return {k: v for k, v in kwargs.items() if k in accepted}


def blocks_of(transformer):
    for name in ("transformer_blocks", "blocks"):
        blist = getattr(transformer, name, None)
        if blist is not None and len(blist):
            return blist
    raise ValueError(f"{type(transformer).__name__} has no block list")


# -- measuring the cache's memory ---------------------------------------------

def weight_storages(pipe) -> set[int]:
    import torch
    from videojob_runtime.pipelines import inner_pipeline

    keys = set()
    for module in inner_pipeline(pipe).components.values():
        if isinstance(module, torch.nn.Module):
            for t in list(module.parameters()) + list(module.buffers()):
                keys.add(t.untyped_storage().data_ptr())
    return keys


def held_tensors(roots, exclude: set[int]) -> dict[int, tuple[int, str, tuple]]:
    """Tensors reachable from ``roots`` ((object, name) pairs) through attributes,
    containers and closures, weights (``exclude``) left out: {storage: (bytes, path, shape)}.
    This is how the cache's state is found whatever library keeps it (cache-dit's
    context buffers, diffusers' hook state, the TeaCache branches)."""
    import torch

    seen, found = set(), {}
    stack = list(roots)
    atoms = (str, bytes, int, float, bool, complex, type(None), type, types.ModuleType, torch.dtype, torch.device)
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, atoms):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta":
                continue
            key = obj.untyped_storage().data_ptr()
            if key and key not in exclude:
                found.setdefault(key, (obj.untyped_storage().nbytes(), path, tuple(obj.shape)))
            continue
        if isinstance(obj, dict):
            items = [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif isinstance(obj, types.FunctionType):
            items = [(c.cell_contents, f"{path}.<closure>") for c in (obj.__closure__ or ())
                     if c.cell_contents is not None]
        elif isinstance(obj, types.MethodType):
            items = [(obj.__self__, f"{path}.__self__"), (obj.__func__, f"{path}.__func__")]
        else:
            items = [(v, f"{path}.{k}") for k, v in getattr(obj, "__dict__", {}).items()]
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    items.append((getattr(obj, slot), f"{path}.{slot}"))
        stack.extend(items)
    return found


def planned_cache_bytes(case: Case, policy: str, ulysses: int = 1) -> float:
    """The planner's "step cache" bytes per rank for this job (the medium
    model's catalog facts; 0 for off)."""
    from videojob.catalog import get_model
    from videojob.planner import Job, Layout, load_calibration
    from videojob.planner.memory import MemoryModel
    from videojob_runtime.configs import medium_model

    model = medium_model(case.model_id) if case.size == "medium" else get_model(case.model_id)
    job = Job(model, case.width, case.height, case.frames, case.steps, case.guidance, "float32")
    est = MemoryModel(load_calibration().model(case.model_id), job).estimate(Layout(ulysses=ulysses, cache=policy))
    return float(est.stages["denoise"].get("step cache", 0.0))


# -- one run --------------------------------------------------------------------

@dataclass
class Run:
    denoise_s: float
    denoise_cpu_s: float          # this thread's CPU time over the same span (immune to a busy machine)
    decode_s: float
    transformer_s: float
    calls: int
    skipped_calls: list          # per denoiser call: True where the cache skipped work in it
    block_evaluations: int
    block_skipped: int
    latents: np.ndarray | None
    frames: np.ndarray | None
    cache_bytes: int | None
    cache_tensors: list | None


def run_once(pipe, case: Case, kwargs: dict, handle, measure_memory: bool = False, exclude=None,
             seed: int = SEED) -> Run:
    import torch
    from videojob_runtime.pipelines import denoiser

    tr = denoiser(pipe)
    layers = len(blocks_of(tr))
    state = {"first": None, "first_cpu": None, "t": 0.0, "in": 0.0, "evals": 0, "skipped": 0}
    skipped_calls: list[bool] = []
    marks: list[float] = []
    cpu_marks: list[float] = []
    captured: dict = {}
    teacache = type(handle).__name__ == "TeaCacheHandle"

    def counters():
        if handle is None:
            return 0, 0
        st = handle.stats()
        return (st["evaluations"], st["skipped"])

    def pre(_m, _a, _k):
        now = time.perf_counter()
        if state["first"] is None:
            state["first"], state["first_cpu"] = now, time.thread_time()
        state["in"] = now
        state["evals"], state["skipped"] = counters()

    def post(_m, _a, _k, _o):
        state["t"] += time.perf_counter() - state["in"]
        evals, skipped = counters()
        if handle is None:
            skipped_calls.append(False)
        elif teacache:
            skipped_calls.append(skipped > state["skipped"])
        else:
            skipped_calls.append(evals - state["evals"] < layers)

    def on_step_end(_pipe, index, _t, callback_kwargs):
        marks.append(time.perf_counter())
        cpu_marks.append(time.thread_time())
        if index == case.steps - 1:
            latents = callback_kwargs.get("latents")
            if latents is not None:
                captured["latents"] = latents.detach().float().cpu().numpy().copy()
            if measure_memory:
                roots = [(tr, "transformer")] + ([(handle, "handle")] if handle is not None else [])
                captured["held"] = held_tensors(roots, exclude or set())
        return {}

    hooks = [tr.register_forward_pre_hook(pre, with_kwargs=True),
             tr.register_forward_hook(post, with_kwargs=True)]
    torch.manual_seed(seed)
    try:
        with torch.inference_mode():
            out = pipe(generator=torch.Generator().manual_seed(seed), callback_on_step_end=on_step_end, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    end = time.perf_counter()
    frames = getattr(out, "frames", None)
    if frames is not None and not (isinstance(frames, (list, tuple)) and frames and frames[0] is None):
        frames = np.asarray(frames, dtype=np.float32)[0]
    else:
        frames = None  # xfuser's CogVideoX: only the last rank decodes
    calls = len(skipped_calls)
    if handle is None:
        evals, skipped = calls * layers, 0
    elif teacache:
        st = handle.stats()
        evals, skipped = st["evaluations"] * layers, st["skipped"] * layers
    else:
        st = handle.stats()
        evals, skipped = st["evaluations"], st["skipped"]
    held = captured.get("held")
    return Run(denoise_s=marks[-1] - state["first"], denoise_cpu_s=cpu_marks[-1] - state["first_cpu"],
               decode_s=end - marks[-1], transformer_s=state["t"],
               calls=calls, skipped_calls=skipped_calls, block_evaluations=evals, block_skipped=skipped,
               latents=captured.get("latents"), frames=frames,
               cache_bytes=None if held is None else int(sum(v[0] for v in held.values())),
               cache_tensors=None if held is None else [
                   {"bytes": b, "shape": list(s), "where": p.rsplit(".", 1)[-1][-80:]}
                   for b, p, s in sorted(held.values(), key=lambda v: -v[0])])


def run_cached(pipe, case, kwargs, policy: str, threshold, *, measure_memory: bool, exclude):
    """One run with ``policy`` at ``threshold`` applied for it alone (removed after)."""
    from videojob_runtime.strategies.order import apply_step_cache_for

    handle = apply_step_cache_for(pipe, case.model_id, policy, threshold, case.steps)
    if handle is not None:
        handle.refresh(case.steps, cfg=case.guidance > 1.0)
    try:
        return run_once(pipe, case, kwargs, handle, measure_memory=measure_memory, exclude=exclude)
    finally:
        if handle is not None:
            handle.remove()


def profile_run(pipe, case: Case, kwargs: dict) -> tuple[Run, dict]:
    """Cache off, instrumented: stage and transformer/block times, and the
    per-call statistics the caches decide on (per CFG branch)."""
    from videojob.catalog import get_model
    from videojob_runtime.pipelines import denoiser

    tr = denoiser(pipe)
    blocks = blocks_of(tr)
    per_step = get_model(case.model_id).denoiser_calls_per_step(case.guidance)
    times = {"transformer": 0.0, "blocks": 0.0}
    record = {"inputs": [], "residuals": []}
    t_in: dict = {}

    def timer(name):
        def pre(m, args, kw):
            t_in[id(m)] = time.perf_counter()

        def post(m, args, kw, out):
            times[name] += time.perf_counter() - t_in[id(m)]
        return pre, post

    def tr_pre(m, args, kw):
        hs = args[0] if args else kw["hidden_states"]
        record["inputs"].append(hs.detach().float().clone())

    def first_pre(m, args, kw):
        t_in["first-in"] = (args[0] if args else kw["hidden_states"]).detach().float().clone()

    def first_post(m, args, kw, out):
        hidden = out[0] if isinstance(out, tuple) else out
        record["residuals"].append(hidden.detach().float() - t_in["first-in"])

    hooks = [tr.register_forward_pre_hook(tr_pre, with_kwargs=True),
             blocks[0].register_forward_pre_hook(first_pre, with_kwargs=True),
             blocks[0].register_forward_hook(first_post, with_kwargs=True)]
    pre, post = timer("transformer")
    hooks += [tr.register_forward_pre_hook(pre, with_kwargs=True), tr.register_forward_hook(post, with_kwargs=True)]
    for b in blocks:
        pre, post = timer("blocks")
        hooks += [b.register_forward_pre_hook(pre, with_kwargs=True), b.register_forward_hook(post, with_kwargs=True)]
    try:
        run = run_once(pipe, case, kwargs, None)
    finally:
        for h in hooks:
            h.remove()

    def rel(a, b):
        return round(float((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12)), 4)

    branches = {}
    for branch in range(per_step):
        ins, res = record["inputs"][branch::per_step], record["residuals"][branch::per_step]
        name = ("cond", "uncond")[branch] if per_step == 2 else "batched"
        branches[name] = {
            "firstBlockResidualChange": [rel(res[i], res[i - 1]) for i in range(1, len(res))],
            "inputChange": [rel(ins[i], ins[i - 1]) for i in range(1, len(ins))],
        }
    del record
    return run, {
        "denoiseSeconds": round(run.denoise_s, 3),
        "transformerSeconds": round(times["transformer"], 3),
        "blocksSeconds": round(times["blocks"], 3),
        "decodeSeconds": round(run.decode_s, 3),
        "transformerShareOfDenoise": round(times["transformer"] / run.denoise_s, 4),
        "blocksShareOfTransformer": round(times["blocks"] / times["transformer"], 4),
        "decisionStatistics": {
            "what": "per denoiser call, relative mean abs change since the previous call of the same CFG "
                    "branch: of the first block's residual (what dbcache/fbcache compare with their "
                    "threshold) and of the denoiser's input (what teacache accumulates against its threshold)",
            **branches},
    }


# -- comparisons ------------------------------------------------------------------

def compare(a: np.ndarray | None, ref: np.ndarray | None, peak: float | None = None) -> dict:
    """PSNR (dB) and max abs error of ``a`` against ``ref``; peak: the reference's max - min by default."""
    if a is None or ref is None:
        return {"psnrDb": None, "maxAbsError": None, "bitIdentical": None}
    a64, r64 = a.astype(np.float64), ref.astype(np.float64)
    mse = float(np.mean((a64 - r64) ** 2))
    peak = float(r64.max() - r64.min()) if peak is None else peak
    identical = bool(np.array_equal(a, ref))
    psnr = None if mse == 0 else round(10 * math.log10(peak ** 2 / mse), 2)
    return {"psnrDb": psnr, "maxAbsError": round(float(np.abs(a64 - r64).max()), 6), "bitIdentical": identical}


def psnr_at_least(q: dict, floor: float) -> bool:
    return q["bitIdentical"] or (q["psnrDb"] is not None and q["psnrDb"] >= floor)


def median(xs):
    return statistics.median(xs)


def skip_pattern(flags: list[bool]) -> str:
    """One character per denoiser call: C computed, S skipped (by the cache)."""
    return "".join("S" if f else "C" for f in flags)


# -- one family ---------------------------------------------------------------------

def policies_for(case: Case) -> list[str]:
    from videojob.catalog import get_model

    return [c for c in get_model(case.model_id).caches if c not in ("off", "auto")]


def default_threshold(policy: str) -> float:
    from videojob_runtime.stepcache import DEFAULT_THRESHOLDS
    from videojob_runtime.teacache import DEFAULT_THRESHOLD

    return DEFAULT_THRESHOLD if policy == "teacache" else DEFAULT_THRESHOLDS[policy]


def thresholds_for(case: Case, policy: str) -> tuple[float, ...]:
    values = THRESHOLDS[(case.family, policy)]
    assert default_threshold(policy) in values, (case.family, policy, "the runtime's default must be measured")
    return values


def bench_family(case: Case, repeats: int) -> dict:
    t0 = time.perf_counter()
    pipe = build_pipeline(case)
    from videojob_runtime.pipelines import denoiser

    tr = denoiser(pipe)
    params = sum(p.numel() for p in tr.parameters())
    t_encode = time.perf_counter()
    kwargs = call_kwargs(pipe, case)
    encode_s = time.perf_counter() - t_encode
    tokens = _tokens(case)
    log(f"{case.model_id} ({case.size}): {case.layers} layers, {tokens} video tokens + {case.text_tokens} text, "
        f"{params / 1e6:.0f}M transformer parameters, built in {time.perf_counter() - t0:.1f} s")
    profile_out, profile = profile_run(pipe, case, kwargs)
    # How far apart two unrelated videos are on the same metrics (another seed, cache off):
    # the scale the cache's error is judged against (auto_choice).
    other = run_once(pipe, case, kwargs, None, seed=SEED + 1)
    profile["otherSeed"] = {"seed": SEED + 1, "latents": compare(other.latents, profile_out.latents),
                            "frames": compare(other.frames, profile_out.frames, peak=1.0)}
    profile["encodeSeconds"] = round(encode_s, 3)
    profile["transformerShareOfJob"] = round(
        profile["transformerSeconds"] / (encode_s + profile["denoiseSeconds"] + profile["decodeSeconds"]), 4)
    log(f"  profile (cache off): denoise {profile['denoiseSeconds']} s, transformer share "
        f"{profile['transformerShareOfDenoise']:.1%}, blocks {profile['blocksShareOfTransformer']:.1%} of it; "
        f"another seed's latents at {profile['otherSeed']['latents']['psnrDb']} dB")
    exclude = weight_storages(pipe)
    configs = [("off", None)] + [(p, t) for p in policies_for(case) for t in thresholds_for(case, p)]
    runs: dict[tuple, list[Run]] = {c: [] for c in configs}
    for rep in range(repeats):
        for policy, threshold in configs:
            run = run_cached(pipe, case, kwargs, policy, threshold, measure_memory=rep == 0, exclude=exclude)
            runs[(policy, threshold)].append(run)
            log(f"  rep {rep + 1}/{repeats} {policy:8s} {'' if threshold is None else threshold:<5} "
                f"denoise {run.denoise_s:6.2f} s  skipped {run.block_skipped}/"
                f"{run.block_evaluations + run.block_skipped}")
    off = runs[("off", None)]
    ref = off[0]
    baseline = ref.cache_bytes or 0  # non-weight tensors reachable with cache off (0 on one rank)
    off_s = median([r.denoise_s for r in off])
    off_cpu = median([r.denoise_cpu_s for r in off])
    rows = []
    for (policy, threshold), rs in runs.items():
        first = rs[0]
        med = median([r.denoise_s for r in rs])
        total = first.block_evaluations + first.block_skipped
        planned = planned_cache_bytes(case, policy)
        rows.append({
            "policy": policy,
            "threshold": threshold,
            "runtimeDefaultThreshold": threshold is not None and threshold == default_threshold(policy),
            "denoiseSecondsMedian": round(med, 3),
            "denoiseSeconds": [round(r.denoise_s, 3) for r in rs],
            "speedup": round(off_s / med, 3),
            "speedupOfFastestRuns": round(min(r.denoise_s for r in off) / min(r.denoise_s for r in rs), 3),
            "denoiseCpuSeconds": [round(r.denoise_cpu_s, 3) for r in rs],
            "speedupCpuTime": round(off_cpu / median([r.denoise_cpu_s for r in rs]), 3),
            "wallOverCpu": round(max(r.denoise_s / r.denoise_cpu_s for r in rs), 3),
            "blockEvaluations": first.block_evaluations,
            "blockEvaluationsSkipped": first.block_skipped,
            "skippedFraction": round(first.block_skipped / total, 4) if total else 0.0,
            "denoiserCalls": first.calls,
            "callsWithSkips": sum(first.skipped_calls),
            "skipPattern": skip_pattern(first.skipped_calls),
            "latents": compare(first.latents, ref.latents),
            "frames": compare(first.frames, ref.frames, peak=1.0),
            "sameOutputEveryRepeat": all(np.array_equal(r.latents, first.latents) for r in rs),
            "cacheBytesMeasured": first.cache_bytes - baseline,
            "cacheBytesPlanned": round(planned),
            "plannedOverMeasured": round(planned / (first.cache_bytes - baseline), 3)
            if first.cache_bytes - baseline else None,
            "cacheTensors": first.cache_tensors if policy != "off" else None,
        })
    result = {
        "family": case.family,
        "model": case.model_id,
        "size": asdict(case),
        "videoTokens": tokens,
        "transformerParameters": params,
        "profile": profile,
        "cacheOffBaselineBytes": baseline,
        "rows": rows,
        "auto": auto_choice(case, rows, profile["otherSeed"]["latents"]["psnrDb"]),
        "_pipe_off_frames": ref.frames,
    }
    del pipe
    return result


def _tokens(case: Case) -> int:
    from videojob.catalog import get_model

    return get_model(case.model_id).arch.tokens(case.width, case.height, case.frames)


def quality_floor_db(other_seed_psnr_db: float | None) -> float:
    """The latents PSNR a cached run must keep: 30 dB, and 20 dB above the PSNR
    between two seeds' latents (the cache's RMS error under a tenth of the
    distance to an unrelated video, the bound tests/test_stepcache.py uses)."""
    return max(AUTO_MIN_PSNR_DB, (other_seed_psnr_db or 0.0) + AUTO_MARGIN_OVER_OTHER_SEED_DB)


def auto_choice(case: Case, rows: list[dict], other_seed_psnr_db: float | None) -> dict:
    """The rule: the fastest (policy, threshold) whose latents keep
    ``quality_floor_db`` against cache off; "off" when no cached row is faster.
    Compared with the runtime's choice today: layout_rules.resolved_cache, at
    the cache's default threshold."""
    from videojob.catalog import get_model
    from videojob.layout_rules import resolved_cache

    floor = quality_floor_db(other_seed_psnr_db)
    ok = [r for r in rows if r["policy"] != "off" and psnr_at_least(r["latents"], floor)]
    best = max(ok, key=lambda r: r["speedupCpuTime"], default=None)
    if best is None or best["speedupCpuTime"] <= 1.0:
        best = next(r for r in rows if r["policy"] == "off")
    runtime_policy = resolved_cache(get_model(case.model_id), "auto")
    runtime_row = next((r for r in rows if r["policy"] == runtime_policy and r["runtimeDefaultThreshold"]), None)
    return {
        "rule": f"fastest (CPU-time speedup) policy and threshold with latents PSNR >= max({AUTO_MIN_PSNR_DB:g} "
                f"dB, another seed's + {AUTO_MARGIN_OVER_OTHER_SEED_DB:g} dB) vs cache off (off when nothing "
                "cached is faster)",
        "latentsPsnrFloorDb": round(floor, 2),
        "passing": [[r["policy"], r["threshold"]] for r in ok],
        "benchChoice": {"policy": best["policy"], "threshold": best["threshold"], "speedup": best["speedup"],
                        "speedupCpuTime": best["speedupCpuTime"],
                        "latentsPsnrDb": best["latents"]["psnrDb"], "framesPsnrDb": best["frames"]["psnrDb"],
                        "skippedFraction": best["skippedFraction"]},
        "runtimeToday": {"policy": runtime_policy, "threshold": default_threshold(runtime_policy)
                         if runtime_policy != "off" else None,
                         "speedup": runtime_row["speedup"] if runtime_row else None,
                         "speedupCpuTime": runtime_row["speedupCpuTime"] if runtime_row else None,
                         "skippedFraction": runtime_row["skippedFraction"] if runtime_row else None},
        "agrees": bool(runtime_row is not None and best["policy"] == runtime_policy
                       and best["threshold"] == runtime_row["threshold"]),
    }


# -- sequence parallel ---------------------------------------------------------------

def _sp_rank(rank: int, world: int, ports, case: Case, configs: list, repeats: int, queue) -> None:
    """One rank: the worker's setup (collectives counter, CPU patches, gloo,
    xfuser's groups, build_parallel_pipeline), then the configs round-robin. Rank 0
    listens on a port the kernel picks (the runtime's ``master_store``) and hands
    it to the others through ``ports``."""
    try:
        import torch

        torch.set_num_threads(1)
        from videojob_runtime import collectives, distributed

        collectives.install()
        from videojob_runtime.pipelines import build_parallel_pipeline, inner_pipeline
        from videojob_runtime.xfuser_cpu import apply_cpu_patches

        apply_cpu_patches()
        if rank == 0:
            store = distributed.master_store("127.0.0.1", world, 600.0)
            for _ in range(world - 1):
                ports.put(store.port)
            distributed.init_process_group(rank, world, "127.0.0.1", store.port, "cpu", 600.0, store=store)
        else:
            distributed.init_process_group(rank, world, "127.0.0.1", ports.get(timeout=600), "cpu", 600.0)
        pipe = build_parallel_pipeline(case.model_id, case.task, "float32", None, SEED, ulysses=world, ring=1, cfg=1,
                                       on_cpu=True, width=case.width, height=case.height, frames=case.frames,
                                       steps=case.steps, size=case.size)
        inner_pipeline(pipe).set_progress_bar_config(disable=True)
        kwargs = call_kwargs(pipe, case)
        run_once(pipe, case, kwargs, None)  # warm-up
        exclude = weight_storages(pipe)
        out = {c: [] for c in configs}
        before = collectives.total()
        for rep in range(repeats):
            for policy, threshold in configs:
                run = run_cached(pipe, case, kwargs, policy, threshold, measure_memory=rep == 0, exclude=exclude)
                out[(policy, threshold)].append({
                    "denoise_s": run.denoise_s, "pattern": skip_pattern(run.skipped_calls),
                    "evaluations": run.block_evaluations, "skipped": run.block_skipped,
                    "cache_bytes": run.cache_bytes, "frames": run.frames if rep == 0 else None})
                if rank == 0:
                    log(f"  SP{world} rep {rep + 1}/{repeats} {policy:8s} {'' if threshold is None else threshold:<5} "
                        f"denoise {run.denoise_s:6.2f} s  skipped {run.block_skipped}")
        queue.put((rank, {"ok": True, "runs": out, "collectives": collectives.total() - before}))
        distributed.shutdown()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                          "traceback": traceback.format_exc()[-3000:]}))


def bench_sp(case: Case, family_result: dict, repeats: int, world: int = 2, timeout_s: float = 900.0) -> dict:
    rows = family_result["rows"]
    configs = [("off", None)]
    chosen = {}
    for policy in policies_for(case):
        if policy == "fbcache":
            continue  # refused under SP (per-rank decisions)
        own = [r for r in rows if r["policy"] == policy]
        good = [r for r in own if r["blockEvaluationsSkipped"]
                and psnr_at_least(r["latents"], family_result["auto"]["latentsPsnrFloorDb"])]
        pick = max(good, key=lambda r: r["speedupCpuTime"], default=None) or \
            max(own, key=lambda r: r["skippedFraction"])
        chosen[policy] = pick["threshold"]
        configs.append((policy, pick["threshold"]))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = ctx.Queue()
    procs = [ctx.Process(target=_sp_rank, args=(r, world, ports, case, configs, repeats, queue), daemon=True)
             for r in range(world)]
    log(f"{case.model_id}: sequence parallel {world} (ulysses, gloo), configs {configs}")
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            rank, payload = queue.get(timeout=max(deadline - time.monotonic(), 1.0))
            results[rank] = payload
            if not payload["ok"]:
                raise RuntimeError(f"SP rank {rank} failed: {payload['error']}\n{payload['traceback']}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    ranks = [results[r]["runs"] for r in range(world)]
    baseline = [rk[("off", None)][0]["cache_bytes"] or 0 for rk in ranks]
    off_runs = ranks[0][("off", None)]
    off_s = median([r["denoise_s"] for r in off_runs])
    off_frames = next(rk[("off", None)][0]["frames"] for rk in ranks if rk[("off", None)][0]["frames"] is not None)
    one_rank_off = next(r for r in rows if r["policy"] == "off")["denoiseSecondsMedian"]
    sp_rows = []
    for config in configs:
        per_rank = [rk[config] for rk in ranks]
        patterns = [[run["pattern"] for run in runs] for runs in per_rank]
        med = median([run["denoise_s"] for run in per_rank[0]])
        frames = next((runs[0]["frames"] for runs in per_rank if runs[0]["frames"] is not None), None)
        first = per_rank[0][0]
        sp_rows.append({
            "policy": config[0], "threshold": config[1],
            "denoiseSecondsMedian": round(med, 3),
            "denoiseSecondsPerRank": [[round(run["denoise_s"], 3) for run in runs] for runs in per_rank],
            "speedupVsSpCacheOff": round(off_s / med, 3),
            "speedupVsOneRankCacheOff": round(one_rank_off / med, 3),
            "blockEvaluationsSkipped": first["skipped"],
            "skippedFraction": round(first["skipped"] / (first["skipped"] + first["evaluations"]), 4),
            "skipPatternPerRank": [p[0] for p in patterns],
            "ranksAgree": all(p == patterns[0] for p in patterns),
            "cacheBytesMeasuredPerRank": [runs[0]["cache_bytes"] - base for runs, base in zip(per_rank, baseline)],
            "cacheBytesPlannedPerRank": round(planned_cache_bytes(case, config[0], ulysses=world)),
            "frames": compare(frames, off_frames, peak=1.0),
        })
    return {
        "model": case.model_id, "ranks": world, "layout": f"ulysses{world}", "backend": "gloo",
        "collectivesPerRank": [results[r]["collectives"] for r in range(world)],
        "thresholdsFromSweep": chosen,
        "cacheOffBaselineBytesPerRank": baseline,
        "spCacheOffVsOneRankFrames": compare(off_frames, family_result["_pipe_off_frames"], peak=1.0),
        "rows": sp_rows,
        "notes": "each rank is one process with one thread (2 processes on the 2 cores); frames compared on the "
                 "decoding rank against SP cache off; skipPatternPerRank: one character per denoiser call "
                 "(C computed, S skipped), rank 0 first; thresholds: the sweep's fastest that skips and passes "
                 "the auto rule's latents floor, else its most skipping one; cacheBytesMeasuredPerRank: "
                 "reachable non-weight tensors with the cache minus the same with cache off (xfuser's own "
                 "state, cacheOffBaselineBytesPerRank).",
    }


# -- plot ------------------------------------------------------------------------------

def plot(families: list[dict], sp: dict | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(len(families), 3)
    fig, axes = plt.subplots(2, cols, figsize=(5.4 * cols, 9.2), squeeze=False)
    markers = {"dbcache": "o", "fbcache": "s", "teacache": "^"}
    colors = {"dbcache": "#1f77b4", "fbcache": "#ff7f0e", "teacache": "#2ca02c"}

    def cached(fam):
        return sorted({r["policy"] for r in fam["rows"]} - {"off"})

    for ax, fam in zip(axes[0], families):
        for policy in cached(fam):
            rows = sorted((r for r in fam["rows"] if r["policy"] == policy), key=lambda r: r["threshold"])
            xs = [r["latents"]["psnrDb"] if r["latents"]["psnrDb"] is not None else 100.0 for r in rows]
            ys = [r["speedup"] for r in rows]
            ax.plot(xs, ys, marker=markers.get(policy, "x"), color=colors.get(policy), label=f"{policy} (wall, median)")
            ax.plot(xs, [r["speedupCpuTime"] for r in rows], marker=markers.get(policy, "x"), color=colors.get(policy),
                    ls=":", mfc="none", alpha=0.8, label=f"{policy} (CPU time)")
            for r, x, y in zip(rows, xs, ys):
                ax.annotate(f"{r['threshold']:g} ({100 * r['skippedFraction']:.0f}%)", (x, y),
                            textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axvline(fam["auto"]["latentsPsnrFloorDb"], color="grey", ls="--", lw=1, label="auto rule's floor")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("latents PSNR vs cache off (dB; identical shown at 100)")
        ax.set_ylabel("denoise speedup vs cache off (x)")
        auto = fam["auto"]["benchChoice"]
        ax.set_title(f"{fam['model']}: {fam['size']['layers']} layers, {fam['videoTokens']} video tokens\n"
                     f"labels: threshold (blocks skipped); auto rule picks {auto['policy']} "
                     f"{auto['threshold'] if auto['threshold'] is not None else ''}", fontsize=9)
        ax.legend(fontsize=8)
    for ax in axes[0][len(families):]:
        ax.axis("off")
    ax = axes[1][0]
    for fam, ls in zip(families, ("-", "--", ":")):
        for policy in cached(fam):
            rows = sorted((r for r in fam["rows"] if r["policy"] == policy), key=lambda r: r["threshold"])
            ax.plot([100 * r["skippedFraction"] for r in rows],
                    [r["frames"]["psnrDb"] if r["frames"]["psnrDb"] is not None else 100.0 for r in rows],
                    marker=markers.get(policy, "x"), color=colors.get(policy), ls=ls,
                    label=f"{fam['model']} {policy}")
    ax.set_xlabel("transformer block evaluations skipped (%)")
    ax.set_ylabel("decoded frames PSNR vs cache off (dB)")
    ax.set_title("Decoded frames: quality vs work skipped", fontsize=9)
    ax.legend(fontsize=6)
    ax = axes[1][1]
    labels, measured, planned = [], [], []
    for fam in families:
        for policy in cached(fam):
            row = next(r for r in fam["rows"] if r["policy"] == policy)
            labels.append(f"{fam['family']}\n{policy}")
            measured.append(row["cacheBytesMeasured"] / 2**20)
            planned.append(row["cacheBytesPlanned"] / 2**20)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, measured, width=0.4, label="measured (held at the last step)", color="#3182bd")
    ax.bar(x + 0.2, planned, width=0.4, label="planner's step-cache figure", color="#bdbdbd")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("MiB")
    ax.set_title("Memory held by the cache, one rank", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1][2]
    if sp:
        names = [f"{r['policy']} {r['threshold'] if r['threshold'] is not None else ''}" for r in sp["rows"]]
        vals = [r["speedupVsSpCacheOff"] for r in sp["rows"]]
        bars = ax.bar(names, vals, color=["#999999"] + [colors.get(r["policy"], "#1f77b4") for r in sp["rows"][1:]])
        ax.bar_label(bars, labels=[f"{v:.2f}x" + (", ranks agree" if r["ranksAgree"] else ", RANKS DISAGREE")
                                   for v, r in zip(vals, sp["rows"])], fontsize=8)
        ax.set_title(f"{sp['model']}, {sp['layout']} ({sp['ranks']} processes, gloo): speedup vs SP alone",
                     fontsize=9)
        ax.set_ylabel("denoise speedup (x, median)")
    else:
        ax.axis("off")
    for ax in axes[1][3:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the tiny models, 4 steps, 1 repeat: same code path")
    parser.add_argument("--repeats", type=int, help=f"timed runs per configuration (default {REPEATS}; dry run 1)")
    parser.add_argument("--families", default=",".join(f for f, _ in FAMILIES),
                        help="comma-separated full-size model ids to run")
    parser.add_argument("--sp-family", default="cogvideox-2b", help="the family run under SP2 ('' for none)")
    parser.add_argument("--out", help="result file (default benchmarks/results/stepcache.json)")
    parser.add_argument("--png", help="plot file (default: next to --out, stepcache.png)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    repeats = args.repeats or (1 if args.dry_run else REPEATS)
    wanted = [f for f in args.families.split(",") if f]
    started = time.perf_counter()
    families, sp = [], None
    for full_id, tiny_id in FAMILIES:
        if full_id not in wanted:
            continue
        case = make_case(full_id, tiny_id, args.dry_run)
        fam = bench_family(case, repeats)
        families.append(fam)
        if full_id == args.sp_family:
            sp = bench_sp(case, fam, repeats=max(1, min(repeats, 2)))
    for fam in families:
        fam.pop("_pipe_off_frames", None)
    out = Path(args.out) if args.out else RESULTS / "stepcache.json"
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot(families, sp, png, "Step caches, CPU float32, random weights, " +
         ("tiny models (dry run)" if args.dry_run else "medium size (full widths, fewer layers)") +
         f", {DRY_STEPS if args.dry_run else STEPS} steps: speed vs quality vs cache off")
    result = {
        "benchmark": "stepcache",
        "dryRun": args.dry_run,
        "setup": {
            "device": "cpu", "dtype": "float32", "threadsPerProcess": torch.get_num_threads(),
            "steps": DRY_STEPS if args.dry_run else STEPS, "repeats": repeats, "seed": SEED,
            "weights": "random (seeded per component); quality is cache on vs cache off, same weights and seed",
            "size": "tiny catalog models (dry run)" if args.dry_run else
                    "medium: videojob_runtime.configs.MEDIUM_SIZES (full-size transformer widths, fewer layers)",
        },
        "definitions": {
            "denoiseSeconds": "first denoiser call to the end of the last step (the step callback), "
                              "prompt encoded beforehand",
            "speedup": "median denoise seconds cache off / median cache on, same run, round-robin",
            "speedupOfFastestRuns": "the same from each configuration's fastest run (a shared machine only "
                                    "ever adds time)",
            "speedupCpuTime": "the same from the denoising thread's CPU seconds (time.thread_time; one "
                              "thread does all the work, so this is the wall time of an idle machine): "
                              "the figure the auto rule ranks by",
            "wallOverCpu": "the largest wall / CPU ratio of the configuration's runs: 1.0 on an idle core, "
                           "more when other processes took the core",
            "skippedFraction": "transformer block evaluations skipped / possible (teacache skips whole "
                               "denoiser calls: all blocks)",
            "latents.psnrDb": "PSNR of the denoised latents (last step) vs cache off, peak = the "
                              "reference's max - min; null when identical",
            "frames.psnrDb": "PSNR of the decoded frames (in [0, 1], peak 1) vs cache off",
            "cacheBytesMeasured": "bytes of the tensors the cache holds at the end of the last step "
                                  "(reachable from the transformer and the cache handle, weights excluded)",
            "cacheBytesPlanned": "the planner's 'step cache' bytes for the same job (MemoryModel.estimate, "
                                 "the medium model's catalog facts, float32)",
        },
        "families": families,
        "sequenceParallel": sp,
        "plot": str(png),
        "wallSeconds": round(time.perf_counter() - started, 1),
    }
    written = write_result(out.name, result, out)
    summary(families, sp)
    print(f"wrote {written} and {png} in {result['wallSeconds']} s")
    return 0


def summary(families: list[dict], sp: dict | None) -> None:
    print(f"{'model':18s} {'policy':8s} {'thr':>5s} {'speedup':>7s} {'cpu x':>6s} {'skip%':>6s} {'PSNR lat':>8s} "
          f"{'PSNR frm':>8s} {'cache MB':>8s} {'plan MB':>8s}")
    for fam in families:
        for r in fam["rows"]:
            def db(q):
                return "same" if q["bitIdentical"] else f"{q['psnrDb']:.1f}"
            meas = r["cacheBytesMeasured"] or 0
            print(f"{fam['model']:18s} {r['policy']:8s} {'' if r['threshold'] is None else r['threshold']:>5} "
                  f"{r['speedup']:7.2f} {r['speedupCpuTime']:6.2f} {100 * r['skippedFraction']:6.1f} "
                  f"{db(r['latents']):>8s} "
                  f"{db(r['frames']):>8s} {meas / 2**20:8.2f} {r['cacheBytesPlanned'] / 2**20:8.2f}")
        print(f"  auto: {json.dumps(fam['auto']['benchChoice'])}; runtime today: "
              f"{json.dumps(fam['auto']['runtimeToday'])}")
    if sp:
        for r in sp["rows"]:
            print(f"SP{sp['ranks']} {sp['model']} {r['policy']} {r['threshold']}: "
                  f"x{r['speedupVsSpCacheOff']} vs SP off, ranks agree {r['ranksAgree']}, "
                  f"patterns {r['skipPatternPerRank']}")


if __name__ == "__main__":
    raise SystemExit(main())
