"""One rank of an actor group: a warm pipeline, one job at a time, clean failures.

``RankWorker`` is plain Python (the Ray actor in ``group.py`` wraps it), so
the same code runs a world of one in-process. Everything crossing the actor
boundary is a plain dict. Its promises:

* Warm state is all-or-nothing: a pipeline is built into locals and published
  with its key only when every load-time strategy applied; a failed load
  leaves the worker empty, never half-built and "reused".
* One job at a time: a second ``run`` while one runs is refused (``Busy``).
* Cancel is per job (``cancel(job_id)``), counts even when it arrives before
  the job starts, and is honoured at every stage boundary (start, after load,
  after inputs, after encode, after each step, after decode) by a vote all
  ranks take together, so every rank stops at the same point. A cancel that
  asks for a checkpoint (``cancel(job_id, checkpoint=True)``) is a preemption:
  the ranks save the step's checkpoint and stop as ``Preempted`` (``gate.py``).
* A failure under sequence parallel aborts this rank's process groups, so
  peers blocked in a collective fail within a second instead of waiting for
  the group timeout; the worker is then ``broken`` and its group must be torn
  down. Only agreed stops (cancel, preemption) and refusals before the job starts leave
  the group usable (``consistent`` in the result).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import Any

from . import collectives, distributed
from .errors import Cancelled, JobFailure, OutOfMemory, is_out_of_memory
from .gate import JobGate as _JobGate
from .progress import CancelTokens, Progress
from .request import JobRequest

GiB = 1024**3
log = logging.getLogger("videojob.runtime.worker")


class Busy(JobFailure):
    reason = "Busy"


class GroupBroken(JobFailure):
    reason = "GroupBroken"


class PeerFailed(JobFailure):
    reason = "PeerFailed"


def short_traceback(exc: BaseException, limit_chars: int = 4000) -> str:
    """The end of the traceback (where it failed), bounded for JSON and status."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text if len(text) <= limit_chars else "...\n" + text[-limit_chars:]


class RankWorker:
    def __init__(self, rank: int, world_size: int, ulysses: int = 1, ring: int = 1, cfg: int = 1,
                 device: str = "cpu"):
        if ulysses * ring * cfg != world_size:
            raise ValueError(f"ulysses {ulysses} x ring {ring} x cfg {cfg} != world size {world_size}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"RankWorker.device must be 'cpu' or 'cuda', got {device!r}")
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
        self.strategies = None  # AppliedStrategies of the warm pipeline (its step cache among them)
        self.pipe_key: tuple | None = None
        self.loads = 0
        self.progress = Progress()
        self.tokens = CancelTokens()
        self._run_lock = threading.Lock()
        self._distributed = False
        self.rendezvous: str | None = None
        self._store: Any = None  # rank 0's rendezvous store (distributed.master_store)
        self.broken: str | None = None  # why this rank can no longer run jobs

    # -- group setup -------------------------------------------------------

    def rendezvous_address(self, host: str, timeout_s: float = 300.0) -> tuple[str, int]:
        """(host, port) of the rendezvous rank 0 now listens on, on its node's address."""
        if self.world_size == 1:
            return host, 0
        self._store = distributed.master_store(host, self.world_size, timeout_s)
        return host, int(self._store.port)

    def init_distributed(self, addr: str, port: int, timeout_s: float = 300.0) -> dict[str, Any]:
        """torch.distributed + xfuser's parallel groups; a world of one needs neither."""
        if self.world_size == 1:
            return {"rank": 0, "world": 1, "backend": None}
        if self.device == "cpu":
            from .xfuser_cpu import apply_cpu_patches

            apply_cpu_patches()
        else:
            import torch

            torch.cuda.set_device(0)  # Ray shows each rank exactly its own GPU
        info = distributed.init_process_group(self.rank, self.world_size, addr, port, self.device, timeout_s,
                                              store=self._store)
        self._distributed = True
        self.rendezvous = info["rendezvous"]
        return info

    def health(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "loaded": self.pipe_key is not None,
                "state": self.progress.state, "distributed": self._distributed,
                "rendezvous": self.rendezvous, "broken": self.broken, "busy": self._run_lock.locked()}

    # -- pipeline ----------------------------------------------------------

    def _key(self, req: JobRequest) -> tuple:
        # Random weights (tiny models, the medium size) depend on the seed: a new seed is a new pipeline.
        seeded = req.model_id.startswith("tiny-") or req.size != "full"
        return (req.model_id, req.task, req.dtype, req.source, req.namespace, req.seed if seeded else None,
                req.size, req.offload, req.fp8_weights, req.cache, req.cache_threshold)

    def load(self, req: JobRequest) -> dict[str, Any]:
        """Build (or keep) the pipeline for this job; returns whether it was reused.

        All or nothing: the previous pipeline is dropped first (memory), the new
        one is built and configured in locals and published with its key only
        when complete. A failure leaves the worker empty."""
        key = self._key(req)
        if self.pipe is not None and self.pipe_key == key:
            return {"reused": True, "load_seconds": 0.0}
        start = time.perf_counter()
        self.pipe, self.strategies, self.pipe_key = None, None, None
        self._release_memory()
        pipe = self._build(req)
        from .strategies import LoadStrategies, apply_load_strategies

        if req.offload != "none" and self.world_size > 1:
            raise JobFailure(f"offload {req.offload!r} with sequence parallel is not supported by the runtime: "
                             "plan it on one GPU, or with GPUs that fit it without offload", stage="load")
        applied = apply_load_strategies(pipe, LoadStrategies(
            model_id=req.model_id, cache=req.cache, cache_threshold=req.cache_threshold, steps=req.steps,
            fp8_weights=req.fp8_weights, offload=req.offload, device=self.device, dtype=req.dtype))
        self.pipe, self.strategies, self.pipe_key = pipe, applied, key
        self.loads += 1
        return {"reused": False, "load_seconds": time.perf_counter() - start}

    @property
    def cache(self):
        return self.strategies.cache if self.strategies is not None else None

    def _build(self, req: JobRequest):
        from .pipelines import build_parallel_pipeline, load_pipeline

        if self.world_size == 1:
            pipe = load_pipeline(req.model_id, req.task, req.dtype, req.source, req.seed, size=req.size,
                                 namespace=req.namespace)
        else:
            pipe = build_parallel_pipeline(
                req.model_id, req.task, req.dtype, req.source, req.seed, ulysses=self.ulysses, ring=self.ring,
                cfg=self.cfg, on_cpu=self.device == "cpu", width=req.width, height=req.height, frames=req.frames,
                steps=req.steps, size=req.size, namespace=req.namespace)
        from .pipelines import inner_pipeline

        inner_pipeline(pipe).set_progress_bar_config(disable=True)  # progress is reported, not printed
        return pipe

    def _release_memory(self, full: bool = True) -> None:
        """Drop what the previous pipeline (``full``) or job held. After a job on a
        CPU only the young generations are collected: what the job created lives
        there, and a full collection of this process's heap costs ~0.25 s, as
        long as a tiny test job itself."""
        import gc

        if full or self.device != "cpu":
            gc.collect()
        else:
            gc.collect(1)
        if self.device != "cpu":
            import torch

            torch.cuda.empty_cache()

    # -- cancel and progress -----------------------------------------------

    def cancel(self, job_id: str | None = None, checkpoint: bool = False) -> str | None:
        """Stop ``job_id`` (None: the job running now) at its next stage boundary;
        ``checkpoint``: save the denoising checkpoint there first (a preemption, ``gate.py``)."""
        return self.tokens.cancel(job_id, checkpoint=checkpoint)

    def get_progress(self) -> dict[str, Any]:
        return self.progress.to_dict()

    def agree_cancel(self, job_id: str) -> int:
        """Every rank's cancel level (0 go on, 1 stop, 2 checkpoint and stop), the MAX
        reduced on the rank's device: all ranks stop at the same boundary or none does,
        and all agree whether to save."""
        wanted = self.tokens.level(job_id)
        if self.world_size == 1:
            return wanted
        return distributed.agree_max(wanted, self.device)

    # -- one job -----------------------------------------------------------

    def run(self, request: dict[str, Any] | JobRequest) -> dict[str, Any]:
        """Run one job; always returns a dict (``ok``, or a structured ``error``)."""
        try:
            req = JobRequest.from_dict(request)
        except (TypeError, ValueError) as exc:
            return self._refusal(JobFailure(f"bad job request: {exc}", stage="request"))
        if self.broken:
            return self._refusal(GroupBroken(f"rank {self.rank} cannot run jobs: {self.broken}; "
                                             "tear the group down and start a new one", stage="request"),
                                 consistent=False)
        if not self._run_lock.acquire(blocking=False):
            return self._refusal(Busy(f"rank {self.rank} is running job {self.progress.job_id}; "
                                      "one job at a time per group", stage="request"))
        try:
            return self._run(req)
        finally:
            self._run_lock.release()

    def _refusal(self, failure: JobFailure, consistent: bool = True) -> dict[str, Any]:
        return {"ok": False, "rank": self.rank, "consistent": consistent,
                "error": {**failure.to_dict(), "rank": self.rank}}

    def _run(self, req: JobRequest) -> dict[str, Any]:
        self.tokens.begin(req.job_id)
        self.progress = Progress(job_id=req.job_id, state="loading", steps=req.steps, stage="load")
        gate = _JobGate(self, req)
        timings: dict[str, float] = {}
        tracker = None
        try:
            gate.enter("load")  # a cancel sent before the job started stops it here
            loaded = self.load(req)
            timings["load"] = loaded["load_seconds"]
            gate.enter("inputs")
            conditioning = self._conditioning(req)
            self._prepare_job(req)
            tracker = self._memory_tracker(req.track_memory)
            counts_before = collectives.total()
            from .generate import generate

            checkpoints, refused = self._checkpoint_plan(req)
            gate.plan, gate.resumed_from = checkpoints, checkpoints.resume_step if checkpoints is not None else 0
            frames, stage_times = generate(self.pipe, req, conditioning, gate, self.device, tracker, checkpoints)
            timings.update(stage_times)
            gate.enter("write")  # after decode: a cancel here leaves nothing written
            result: dict[str, Any] = {
                "ok": True,
                "rank": self.rank,
                "job_id": req.job_id,
                "seed": req.seed,
                "reused": loaded["reused"],
                "loads": self.loads,
                "collectives": collectives.total() - counts_before,
                "peak_bytes": self._peak_bytes(tracker),
                "timings": timings,
                "frames": None,
                "cache": self.cache.stats() if self.cache is not None else None,
                "decode_offload": self._decode_offload_report(),
                "checkpoints": {**checkpoints.report(), "refused": refused} if checkpoints is not None else None,
            }
            if frames is not None:
                result.update(self._deliver(req, frames, result, timings, gate))
                if checkpoints is not None:
                    checkpoints.store.remove()  # the outputs are written: nothing left to resume
            self.progress.state, self.progress.stage = "done", ""
            return result
        except Cancelled as exc:
            self.progress.state = "cancelled"
            resumed = {"resumedFromStep": gate.resumed_from} if gate.resumed_from else {}
            return {"ok": False, "rank": self.rank, "consistent": True,
                    "error": {**exc.to_dict(), "rank": self.rank, **resumed}}
        except Exception as exc:  # noqa: BLE001 - every failure becomes data for the operator
            return self._failed(exc, gate, tracker)
        finally:
            self.tokens.end()
            self._release_memory(full=False)  # the next job starts from the weights alone

    def _failed(self, exc: Exception, gate: _JobGate, tracker) -> dict[str, Any]:
        stage = gate.stage
        self.progress.state = "failed"
        details: dict[str, Any] = {"rank": self.rank, "time": time.time()}
        if stage == "denoise" and gate.step:
            details["step"] = gate.step
        if gate.resumed_from:
            details["resumedFromStep"] = gate.resumed_from
        if is_out_of_memory(exc):
            failure: JobFailure = OutOfMemory(stage, self._peak_bytes(tracker), str(exc), **details)
        elif isinstance(exc, JobFailure):
            failure = exc
            failure.details.update(details)
            failure.stage = failure.stage or stage
        elif self.world_size > 1 and distributed.is_peer_failure(exc):
            failure = PeerFailed(f"stopped in {stage}: another rank of the group failed ({exc})",
                                 stage=stage, **details)
        else:
            failure = JobFailure(f"{type(exc).__name__}: {exc}", stage=stage, **details)
            failure.details["traceback"] = short_traceback(exc)
        log.error("rank %d failed in %s: %s", self.rank, stage, failure.message,
                  exc_info=(type(exc), exc, exc.__traceback__))
        consistent = self.world_size == 1
        if not consistent:
            # Peers may be blocked in a collective this rank will never join.
            distributed.abort()
            self.broken = f"failed in {stage} ({failure.reason}); its process groups were aborted"
        return {"ok": False, "rank": self.rank, "consistent": consistent, "error": failure.to_dict()}

    def _deliver(self, req: JobRequest, frames, result: dict[str, Any], timings: dict[str, float],
                 gate: _JobGate) -> dict[str, Any]:
        """The decoded frames: written to the output directory, or returned (tests)."""
        from .output import frames_digest, to_uint8

        video = to_uint8(frames)
        digest = frames_digest(video)
        if not req.output_dir:
            returned = video if req.frames_dtype == "uint8" else frames
            return {"frames": returned, "frames_shape": list(frames.shape), "frames_digest": digest}
        from pathlib import Path

        from .output import write_outputs

        self.progress.state, self.progress.stage = "writing", "write"
        start = time.perf_counter()
        summary = {**req.result_extra, "job": req.job_id, "model": req.model_id, "seed": req.seed,
                   "framesDigest": digest,
                   "measured": {"peakGiB": round(result["peak_bytes"] / GiB, 4),
                                **{f"{k}Seconds": round(v, 3) for k, v in timings.items()}},
                   "cache": result["cache"]}
        written = write_outputs(video, Path(req.output_dir), req.output_name, req.fps, summary,
                                between_files=lambda: gate._inject("write"), root=req.output_root)
        output = {"video": str(written.video), "poster": str(written.poster), "result": str(written.result),
                  "bytes": written.video_bytes}
        if req.output_object:  # s3://: staged here, uploaded with the result JSON last
            from .s3outputs import upload_outputs

            uploaded = upload_outputs(written, req.output_object, req.namespace,
                                      between=lambda _name: gate._inject("upload"))
            output = {k: uploaded[k] for k in ("video", "poster", "result", "bytes", "uploadSeconds",
                                                "videoUrl", "videoUrlExpires") if k in uploaded}
        timings["write"] = time.perf_counter() - start
        return {"frames_shape": list(frames.shape), "frames_digest": digest, "output": output}

    def _checkpoint_plan(self, req: JobRequest):
        """(plan, refused checkpoints): the ranks agree on the step they resume from."""
        from .resume import plan_for

        agree = None
        if self.world_size > 1:
            agree = lambda value: distributed.agree_min(value, self.device)  # noqa: E731
        return plan_for(req, self.rank, self.world_size, self.device, self.pipe, agree)

    def _prepare_job(self, req: JobRequest) -> None:
        """Per-job settings on a warm pipeline: the VAE's (tiling, slicing, unread
        conv cache), the decode offload (a denoiser the last job left on the host
        comes back first), a fresh cache context."""
        from .strategies import apply_job_strategies

        self.job_strategies = apply_job_strategies(
            self.pipe, req.vae_tiling, req.vae_slicing, skip_unread_conv_cache=req.skip_unread_conv_cache,
            decode_offload=req.decode_offload, offload=req.offload, device=self.device)
        if self.cache is not None:
            self.cache.refresh(req.steps, cfg=req.guidance > 1.0)

    def _decode_offload_report(self) -> dict[str, Any] | None:
        moved = getattr(getattr(self, "job_strategies", None), "decode_offload", None)
        return moved.report() if moved is not None else None

    def _conditioning(self, req: JobRequest) -> dict[str, Any]:
        """The task's extra pipeline inputs: an image (i2v), a face and its embeddings (identity).
        Read from local files only, contained in their roots; https inputs were fetched by the driver
        (``inputs.staged_inputs``), once for all ranks, into ``req.local_inputs_dir``."""
        from .inputs import load_face_embeddings, load_image
        from .pipelines import torch_dtype

        if req.task == "i2v":
            if not req.image:
                raise JobFailure("task i2v needs spec.image", stage="inputs")
            return {"image": load_image(req.image, req.width, req.height, "spec.image", req.local_inputs_dir,
                                        req.namespace)}
        if req.task == "identity":
            if not req.face_image:
                raise JobFailure("task identity needs spec.faceImage", stage="inputs")
            id_cond, id_vit_hidden = load_face_embeddings(req.face_image, torch_dtype(req.dtype), "spec.faceImage",
                                                          req.local_inputs_dir, req.namespace)
            return {"image": load_image(req.face_image, req.width, req.height, "spec.faceImage",
                                        req.local_inputs_dir, req.namespace),
                    "id_cond": id_cond, "id_vit_hidden": id_vit_hidden}
        return {}

    # -- memory ------------------------------------------------------------

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

        from .pipelines import inner_pipeline

        components = getattr(inner_pipeline(self.pipe), "components", {})
        return [m for m in components.values() if isinstance(m, torch.nn.Module)]

    def shutdown(self) -> None:
        if self._distributed:
            distributed.shutdown()
            self._distributed = False
