"""One rank of an actor group: distributed setup, a warm pipeline, one job at a time.

``RankWorker`` is plain Python (the Ray actor in ``group.py`` wraps it), so
the same code runs a world of one in-process. Everything crossing the actor
boundary is a plain dict. Progress is readable while a job runs (the actor
has spare threads); cancellation is decided by all ranks together at each
step end, because one rank leaving early would deadlock the others in the
next collective.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from . import collectives
from .errors import Cancelled, InjectedOOM, JobFailure, OutOfMemory, is_out_of_memory

GiB = 1024**3


@dataclass
class JobRequest:
    """Everything a rank needs for one job (built by the driver from spec + plan)."""

    job_id: str
    model_id: str
    task: str
    prompt: str
    width: int
    height: int
    frames: int
    fps: int
    steps: int
    guidance: float
    seed: int = 0
    dtype: str = "float32"
    source: str | None = None
    negative_prompt: str = ""
    image: str | None = None  # i2v conditioning image uri
    face_image: str | None = None  # identity (ConsisID): face image uri, embeddings at <uri>.npz
    offload: str = "none"
    vae_tiling: bool = False
    vae_slicing: bool = False
    fp8_weights: bool = False
    cache: str = "off"
    cache_threshold: float | None = None
    output_dir: str | None = None
    output_name: str = "video"
    # Without output_dir the frames come back: "uint8" (video) or "float32" (tests compare these).
    frames_dtype: str = "uint8"
    result_extra: dict[str, Any] = field(default_factory=dict)
    # CPU only: count live tensor bytes (a dispatch-mode tracker; costs ~10% on tiny models).
    track_memory: bool = True
    # Test hook: raise an out-of-memory error in this stage (load, encode, denoise, decode).
    inject_oom: str | None = None


@dataclass
class Progress:
    job_id: str = ""
    state: str = "idle"  # idle, loading, running, writing, done, failed, cancelled
    step: int = 0
    steps: int = 0
    stage: str = ""

    @property
    def percent(self) -> int:
        return int(100 * self.step / self.steps) if self.steps else 0


def _call_parameters(pipe) -> set[str]:
    """The named keyword arguments ``pipe(...)`` accepts. An xfuser wrapper
    taking ``**kwargs`` forwards them: the pipeline it wraps decides. (A
    diffusers pipeline's own ``**kwargs`` only takes deprecated callbacks.)"""
    import inspect

    params = inspect.signature(type(pipe).__call__).parameters
    inner = getattr(pipe, "module", None)
    if inner is not None and inner is not pipe and any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return _call_parameters(inner)
    return {name for name, p in params.items()
            if name != "self" and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}


@contextmanager
def _scheduler_step_callback(pipe, on_step_end):
    """Call ``on_step_end(pipe, index, timestep, {})`` after every ``scheduler.step``
    of the denoising loop (one per step), for pipelines without
    ``callback_on_step_end``; the scheduler is restored afterwards."""
    scheduler = pipe.scheduler
    original = scheduler.step
    count = [0]

    def step(model_output, timestep, *args, **kwargs):
        out = original(model_output, timestep, *args, **kwargs)
        index = count[0]
        count[0] += 1
        on_step_end(pipe, index, timestep, {})
        return out

    scheduler.step = step
    try:
        yield
    finally:
        del scheduler.step  # the instance attribute; the class method shows again


class RankWorker:
    def __init__(self, rank: int, world_size: int, ulysses: int = 1, ring: int = 1, cfg: int = 1,
                 device: str = "cpu"):
        if ulysses * ring * cfg != world_size:
            raise ValueError(f"ulysses {ulysses} x ring {ring} x cfg {cfg} != world size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.ulysses, self.ring, self.cfg = ulysses, ring, cfg
        self.device = device
        if device == "cpu":
            # Several ranks share few cores: oversubscribed threads were 60x slower (DESIGN.md).
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        collectives.install()  # before xfuser imports torch.distributed names
        self.pipe = None
        self.cache = None  # StepCacheHandle when the job's plan has a step cache
        self.pipe_key: tuple | None = None
        self.loads = 0
        self.progress = Progress()
        self._cancel = threading.Event()
        self._distributed = False

    # -- group setup -------------------------------------------------------

    @staticmethod
    def free_port() -> tuple[str, int]:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return "127.0.0.1", s.getsockname()[1]

    def init_distributed(self, addr: str, port: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """torch.distributed + xfuser's parallel groups; a world of one needs neither."""
        if self.world_size == 1:
            return {"rank": 0, "world": 1, "backend": None}
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        backend = "gloo" if self.device == "cpu" else "nccl"
        if self.device == "cpu":
            from .xfuser_cpu import apply_cpu_patches

            apply_cpu_patches()
        from xfuser.core.distributed import init_distributed_environment

        # xfuser and yunchang build subgroups with the default timeout (30 min):
        # bound every group, so a lost rank fails a job instead of hanging it.
        timeout = datetime.timedelta(seconds=timeout_s)
        c10d.default_pg_timeout = timeout
        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(self.rank),
                          WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        dist.init_process_group(backend, init_method="env://", rank=self.rank, world_size=self.world_size,
                                timeout=timeout)
        init_distributed_environment(rank=self.rank, world_size=self.world_size, local_rank=0, backend=backend)
        self._distributed = True
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": backend}

    def health(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "loaded": self.pipe_key is not None,
                "state": self.progress.state, "distributed": self._distributed}

    # -- pipeline ----------------------------------------------------------

    def _torch_dtype(self, name: str):
        from .pipelines import torch_dtype

        return torch_dtype(name)

    def load(self, req: JobRequest) -> dict[str, Any]:
        """Build (or keep) the pipeline for this job; returns whether it was reused."""
        key = (req.model_id, req.task, req.dtype, req.source, req.seed if req.model_id.startswith("tiny-") else None,
               req.offload, req.fp8_weights, req.cache, req.cache_threshold)
        if self.pipe_key == key:
            return {"reused": True, "load_seconds": 0.0}
        start = time.perf_counter()
        self.pipe, self.cache = None, None
        self._release_memory()
        self.pipe = self._build(req)
        self.cache = self._apply_step_cache(req)
        self.pipe_key = key
        self.loads += 1
        return {"reused": False, "load_seconds": time.perf_counter() - start}

    def _build(self, req: JobRequest):
        from videojob.catalog import Family, get_model

        from .pipelines import load_pipeline

        family = get_model(req.model_id).family
        if self.world_size == 1:
            return self._apply_memory_strategies(
                load_pipeline(req.model_id, req.task, req.dtype, req.source, req.seed), req)
        if req.offload != "none":
            raise JobFailure(f"offload {req.offload!r} with sequence parallel is not supported by the runtime: "
                             "plan it on one GPU, or with GPUs that fit it without offload", stage="load")
        from xfuser import xFuserArgs

        from .xfuser_cpu import attention_backend

        engine_config, _ = xFuserArgs(
            model=req.model_id, ulysses_degree=self.ulysses, ring_degree=self.ring,
            use_cfg_parallel=self.cfg == 2, attention_backend=attention_backend(self.ring, self.device == "cpu"),
            height=req.height, width=req.width, num_frames=req.frames, num_inference_steps=req.steps,
        ).create_config()
        engine_config.runtime_config.dtype = self._torch_dtype(req.dtype)
        if family == Family.COGVIDEOX and req.task == "t2v":
            from xfuser import xFuserCogVideoXPipeline

            pipe = load_pipeline(req.model_id, req.task, req.dtype, req.source, req.seed)
            return xFuserCogVideoXPipeline(self._apply_memory_strategies(pipe, req), engine_config)
        if family == Family.CONSISID:
            from xfuser import xFuserConsisIDPipeline

            pipe = load_pipeline(req.model_id, req.task, req.dtype, req.source, req.seed)
            return xFuserConsisIDPipeline(self._apply_memory_strategies(pipe, req), engine_config)
        if family == Family.WAN:
            # xfuser 0.7.0 has no Wan pipeline wrapper: its Wan runner uses the
            # plain WanPipeline with xfuser's sequence-sharding transformer.
            from xfuser.core.distributed import initialize_runtime_state
            from xfuser.model_executor.models.transformers.transformer_wan import xFuserWanTransformer3DWrapper

            pipe = load_pipeline(req.model_id, req.task, req.dtype, req.source, req.seed,
                                 transformer_class=xFuserWanTransformer3DWrapper)
            self._apply_memory_strategies(pipe, req)
            initialize_runtime_state(pipe, engine_config)
            return pipe
        raise JobFailure(f"{req.model_id} cannot run sequence-parallel; plan it on one GPU", stage="load")

    def _apply_memory_strategies(self, pipe, req: JobRequest):
        """fp8 storage, then offload (placement on the device included)."""
        from .strategies import Fp8Config, OffloadConfig, apply_fp8_storage, apply_offload

        if req.fp8_weights:
            denoiser = getattr(pipe, "transformer", None) or pipe.unet
            apply_fp8_storage(denoiser, Fp8Config(enabled=True), self._torch_dtype(req.dtype))
        device = "cpu" if self.device == "cpu" else "cuda"
        apply_offload(pipe, OffloadConfig(mode=req.offload, device=device, use_stream=device == "cuda"))
        return pipe

    def _apply_step_cache(self, req: JobRequest):
        """cache-dit DBCache (or diffusers FBCache on one rank) on the denoiser.

        Applied after offload placement and on xfuser's wrapped transformer:
        xfuser calls its own forward, so a cache on the unwrapped module would
        never run. Under sequence parallel cache-dit all-reduces its decision
        statistics, so every rank skips the same steps."""
        if req.cache == "off":
            return None
        if req.cache == "teacache":
            from .teacache import DEFAULT_THRESHOLD, TeaCacheConfig, apply_teacache

            inner = getattr(self.pipe, "module", self.pipe)
            return apply_teacache(inner.transformer, TeaCacheConfig(threshold=req.cache_threshold or DEFAULT_THRESHOLD))
        from .stepcache import StepCacheConfig, apply_step_cache

        return apply_step_cache(self.pipe, StepCacheConfig(policy=req.cache, threshold=req.cache_threshold,
                                                           num_inference_steps=req.steps))

    def _release_memory(self) -> None:
        """Drop what the previous pipeline held before loading another."""
        import gc

        gc.collect()
        if self.device != "cpu":
            import torch

            torch.cuda.empty_cache()

    # -- one job -----------------------------------------------------------

    def cancel(self) -> None:
        self._cancel.set()

    def get_progress(self) -> dict[str, Any]:
        return {**asdict(self.progress), "percent": self.progress.percent}

    def _agree_cancel(self) -> bool:
        """Every rank's vote, reduced: all ranks stop at the same step or none does."""
        wanted = self._cancel.is_set()
        if self.world_size == 1:
            return wanted
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if wanted else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def run(self, request: dict[str, Any] | JobRequest) -> dict[str, Any]:
        """Run one job; always returns a dict (``ok`` or a structured ``error``)."""
        req = request if isinstance(request, JobRequest) else JobRequest(**request)
        self._cancel.clear()
        self.progress = Progress(job_id=req.job_id, state="loading", steps=req.steps, stage="load")
        timings: dict[str, float] = {}
        tracker = None
        stage = "load"
        try:
            if req.inject_oom == "load":
                raise InjectedOOM("injected out of memory (load)")
            loaded = self.load(req)
            timings["load"] = loaded["load_seconds"]
            self._prepare_job(req)
            tracker = self._memory_tracker(req.track_memory)
            counts_before = collectives.total()
            frames, stage_times = self._generate(req, tracker)
            if frames is not None and req.frames_dtype == "uint8":
                frames = (frames.clip(0.0, 1.0) * 255).round().astype("uint8")
            timings.update(stage_times)
            result: dict[str, Any] = {
                "ok": True,
                "rank": self.rank,
                "job_id": req.job_id,
                "reused": loaded["reused"],
                "loads": self.loads,
                "collectives": collectives.total() - counts_before,
                "peak_bytes": self._peak_bytes(tracker),
                "timings": timings,
                "frames": None,
                "cache": self.cache.stats() if self.cache is not None else None,
            }
            if frames is not None:
                result["frames_shape"] = list(frames.shape)
                if req.output_dir:
                    stage = "write"
                    self.progress.state, self.progress.stage = "writing", "write"
                    start = time.perf_counter()
                    from pathlib import Path

                    from .output import write_outputs

                    summary = {**req.result_extra, "job": req.job_id, "model": req.model_id,
                               "measured": {"peakGiB": round(result["peak_bytes"] / GiB, 4),
                                            **{f"{k}Seconds": round(v, 3) for k, v in timings.items()}}}
                    video = frames if frames.dtype.name == "uint8" else (frames.clip(0, 1) * 255).round().astype("uint8")
                    written = write_outputs(video, Path(req.output_dir), req.output_name, req.fps, summary)
                    timings["write"] = time.perf_counter() - start
                    result["output"] = {"video": str(written.video), "poster": str(written.poster),
                                        "result": str(written.result), "bytes": written.video_bytes}
                else:
                    result["frames"] = frames
            self.progress.state, self.progress.stage = "done", ""
            return result
        except Cancelled as exc:
            self.progress.state = "cancelled"
            return {"ok": False, "rank": self.rank, "error": exc.to_dict()}
        except Exception as exc:  # noqa: BLE001 - every failure becomes data for the operator
            stage = self.progress.stage or stage
            self.progress.state = "failed"
            if is_out_of_memory(exc):
                failure: JobFailure = OutOfMemory(stage, self._peak_bytes(tracker), str(exc))
            elif isinstance(exc, JobFailure):
                failure = exc
            else:
                failure = JobFailure(f"{type(exc).__name__}: {exc}", stage=stage)
            return {"ok": False, "rank": self.rank, "error": failure.to_dict()}
        finally:
            self._release_memory()  # the next job starts from the weights alone

    def _prepare_job(self, req: JobRequest) -> None:
        """Per-job settings on a warm pipeline: VAE tiling/slicing, a fresh cache context."""
        from .strategies import VaeConfig, apply_vae

        inner = getattr(self.pipe, "module", self.pipe)  # xfuser wraps the diffusers pipeline
        apply_vae(inner, VaeConfig(tiling=req.vae_tiling, slicing=req.vae_slicing))
        if self.cache is not None:
            self.cache.refresh(req.steps, cfg=req.guidance > 1.0)

    def _memory_tracker(self, enabled: bool = True):
        """GPU: the allocator's peak. CPU: live tensor bytes plus the resident weights."""
        if self.device != "cpu":
            import torch

            torch.cuda.reset_peak_memory_stats()
            return None
        if not enabled:
            return None
        from .profiling.memtrack import LiveBytes

        return LiveBytes()

    def _peak_bytes(self, tracker) -> int:
        if self.device != "cpu":
            import torch

            return int(torch.cuda.max_memory_allocated())
        weights = 0
        if self.pipe is not None:
            for module in self._modules():
                weights += sum(p.numel() * p.element_size() for p in module.parameters())
                weights += sum(b.numel() * b.element_size() for b in module.buffers())
        return weights + (tracker.peak if tracker is not None else 0)

    def _modules(self):
        import torch

        components = getattr(self.pipe, "components", None)
        if components is None:  # xfuser wrapper
            components = getattr(getattr(self.pipe, "module", None), "components", {})
        return [m for m in components.values() if isinstance(m, torch.nn.Module)]

    def _encode_and_release(self, req: JobRequest, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Encode the prompt, then park the text encoder on the host for the rest
        of the job (the planner counts it only in the encode stage). It comes
        back to the GPU for the next job's prompt. DiT pipelines only: the UNet
        pipelines' encode_prompt depends on state set inside their __call__."""
        import torch

        from .strategies import TextEncoderConfig, encode_and_release

        inner = getattr(self.pipe, "module", self.pipe)
        if getattr(inner, "text_encoder", None) is None or getattr(inner, "transformer", None) is None:
            return kwargs
        device = torch.device("cpu" if self.device == "cpu" else "cuda")
        inner.text_encoder.to(device)
        with torch.inference_mode():
            embeds = encode_and_release(
                inner, TextEncoderConfig(release="cpu"), kwargs.pop("prompt"), kwargs.pop("negative_prompt", None),
                do_classifier_free_guidance=req.guidance > 1.0,
                max_sequence_length=kwargs.get("max_sequence_length", 226), device=device,
            )
        return {**kwargs, **embeds.pipeline_kwargs()}

    def _conditioning(self, req: JobRequest) -> dict[str, Any]:
        """The task's extra pipeline inputs: an image (i2v), a face and its embeddings (identity)."""
        from .inputs import load_face_embeddings, load_image

        if req.task == "i2v":
            if not req.image:
                raise JobFailure("task i2v needs spec.image", stage="inputs")
            return {"image": load_image(req.image, req.width, req.height)}
        if req.task == "identity":
            if not req.face_image:
                raise JobFailure("task identity needs spec.faceImage", stage="inputs")
            id_cond, id_vit_hidden = load_face_embeddings(req.face_image, self._torch_dtype(req.dtype))
            return {"image": load_image(req.face_image, req.width, req.height), "id_cond": id_cond,
                    "id_vit_hidden": id_vit_hidden}
        return {}

    def _generate(self, req: JobRequest, tracker):
        """Call the pipeline; stage times come from the step callbacks."""
        import contextlib

        import numpy as np
        import torch

        marks: list[float] = []
        self.progress.state, self.progress.stage = "running", "encode"
        if req.inject_oom == "encode":
            raise InjectedOOM("injected out of memory (encode)")

        def on_step_end(pipe, index, timestep, kwargs):
            marks.append(time.perf_counter())
            self.progress.step, self.progress.stage = index + 1, "denoise"
            if req.inject_oom == "denoise" and index == req.steps // 2:
                raise InjectedOOM("injected out of memory (denoise)")
            if self._agree_cancel():
                raise Cancelled(f"cancelled after step {index + 1} of {req.steps}", stage="denoise",
                                step=index + 1)
            if index + 1 == req.steps:
                self.progress.stage = "decode"
                if req.inject_oom == "decode":
                    raise InjectedOOM("injected out of memory (decode)")
            return {}

        generator = torch.Generator(device="cpu").manual_seed(req.seed)
        # Some pipelines also draw from the global RNG (I2VGen-XL samples the image
        # latents without the generator): seed it too, or a warm pipeline's second
        # job would differ from its first.
        torch.manual_seed(req.seed)
        kwargs = dict(prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
                      num_frames=req.frames, num_inference_steps=req.steps, guidance_scale=req.guidance,
                      generator=generator, output_type="np", callback_on_step_end=on_step_end)
        if req.model_id.startswith("tiny-"):
            kwargs["max_sequence_length"] = 16
        kwargs["target_fps"] = req.fps  # I2VGen-XL conditions on the frame rate
        kwargs.update(self._conditioning(req))
        # Drop what this pipeline does not take (UNet pipelines: max_sequence_length;
        # all but I2VGen-XL: target_fps).
        accepted = _call_parameters(self.pipe)
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        if req.offload == "none" and "prompt_embeds" in accepted:
            kwargs = self._encode_and_release(req, kwargs)
        step_hook = contextlib.nullcontext()
        if "callback_on_step_end" not in kwargs:
            # I2VGenXLPipeline has no step callback: run it after each scheduler step.
            step_hook = _scheduler_step_callback(getattr(self.pipe, "module", self.pipe), on_step_end)
        start = time.perf_counter()
        with torch.inference_mode(), (tracker if tracker is not None else contextlib.nullcontext()), step_hook:
            output = self.pipe(**kwargs)
        end = time.perf_counter()
        frames = output.frames[0] if output.frames is not None else None
        if frames is not None and not (isinstance(frames, (list, tuple)) and frames and frames[0] is None):
            frames = np.asarray(frames, dtype=np.float32)
        else:
            frames = None  # xfuser: only the last rank decodes
        step = (marks[-1] - marks[0]) / max(len(marks) - 1, 1) if marks else 0.0
        first = marks[0] if marks else end
        stage_times = {
            "encode": max(first - start - step, 0.0),
            "denoise": (marks[-1] - first + step) if marks else 0.0,
            "decode": end - (marks[-1] if marks else start),
        }
        return frames, stage_times

    def shutdown(self) -> None:
        if self._distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._distributed = False
