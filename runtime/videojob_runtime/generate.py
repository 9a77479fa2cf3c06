"""One pipeline call: the arguments, the prompt encoding, the per-step hooks, stage times.

The worker hands in a ``gate``: an object with ``enter(stage)`` (called at
each stage boundary) and ``step_done(index)`` (after every denoising step),
and optionally ``use_checkpoints(hooks)`` (the checkpoint hooks for the
pipeline call, then None: a preemption saves the step it stops at).
The gate reports progress, fires injected faults and takes the ranks' agreed
cancel vote; this module only decides where the boundaries are, which is the
same on every rank, so the votes line up.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any, Protocol

from videojob.catalog import get_model

from .pipelines import inner_pipeline
from .request import JobRequest


class StageGate(Protocol):
    def enter(self, stage: str) -> None: ...

    def step_done(self, index: int) -> None: ...


def call_parameters(pipe) -> set[str]:
    """The named keyword arguments ``pipe(...)`` accepts. An xfuser wrapper
    taking ``**kwargs`` forwards them: the pipeline it wraps decides. (A
    diffusers pipeline's own ``**kwargs`` only takes deprecated callbacks.)"""
    params = inspect.signature(type(pipe).__call__).parameters
    inner = getattr(pipe, "module", None)
    if inner is not None and inner is not pipe and any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return call_parameters(inner)
    return {name for name, p in params.items()
            if name != "self" and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}


@contextlib.contextmanager
def scheduler_step_callback(pipe, on_step_end):
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

    had, previous = "step" in vars(scheduler), vars(scheduler).get("step")
    scheduler.step = step
    try:
        yield
    finally:  # what was there before: the checkpoint hook's wrapper, or the class method
        if had:
            scheduler.step = previous
        else:
            del scheduler.step


def pipeline_kwargs(pipe, req: JobRequest, conditioning: dict[str, Any], on_step_end) -> dict[str, Any]:
    """The call's arguments, restricted to what this pipeline takes."""
    import torch

    if req.size == "medium":  # the benchmarks' size: its own (short) prompt length
        from .configs import medium_model

        model = medium_model(req.model_id)
    else:
        model = get_model(req.model_id)
    kwargs: dict[str, Any] = dict(
        prompt=req.prompt, negative_prompt=req.negative_prompt, height=req.height, width=req.width,
        num_frames=req.frames, num_inference_steps=req.steps, guidance_scale=req.guidance,
        generator=torch.Generator(device="cpu").manual_seed(req.seed), output_type="np",
        callback_on_step_end=on_step_end,
        # The length the pipeline pads prompts to (Wan 512, CogVideoX 226): one fact, in the catalog.
        max_sequence_length=model.arch.text_tokens,
        target_fps=req.fps,  # I2VGen-XL conditions on the frame rate
        **conditioning,
    )
    accepted = call_parameters(pipe)
    return {k: v for k, v in kwargs.items() if k in accepted}


def encode_and_park(pipe, req: JobRequest, kwargs: dict[str, Any], device: str) -> dict[str, Any]:
    """Encode the prompt, then park the text encoder on the host for the rest
    of the job (the planner counts it only in the encode stage). It comes back
    to the device for the next job's prompt. DiT pipelines without offload
    only: the UNet pipelines' encode_prompt depends on state set inside their
    __call__, and offload hooks already park the encoder."""
    import torch

    from .strategies import TextEncoderConfig, encode_and_release

    inner = inner_pipeline(pipe)
    if (req.offload != "none" or "prompt_embeds" not in call_parameters(pipe)
            or getattr(inner, "text_encoder", None) is None or getattr(inner, "transformer", None) is None):
        return kwargs
    target = torch.device("cpu" if device == "cpu" else "cuda")
    inner.text_encoder.to(target)
    with torch.inference_mode():
        embeds = encode_and_release(
            inner, TextEncoderConfig(release="cpu"), kwargs.pop("prompt"), kwargs.pop("negative_prompt", None),
            do_classifier_free_guidance=req.guidance > 1.0,
            max_sequence_length=kwargs.get("max_sequence_length", get_model(req.model_id).arch.text_tokens),
            device=target,
        )
    return {**kwargs, **embeds.pipeline_kwargs()}


def generate(pipe, req: JobRequest, conditioning: dict[str, Any], gate: StageGate, device: str, tracker=None,
             checkpoints=None):
    """Encode, denoise and decode one video; returns (frames or None, stage seconds).

    Frames are float32 [T, H, W, 3] in [0, 1] on the rank that decodes (under
    xfuser's CogVideoX only the last rank returns them), None elsewhere."""
    import numpy as np
    import torch

    marks: list[float] = []

    def on_step_end(_pipe, index, _timestep, _kwargs):
        marks.append(time.perf_counter())
        gate.step_done(index)
        return {}

    # Some pipelines also draw from the global RNG (I2VGen-XL samples the image
    # latents without the generator): seed it too, or a warm pipeline's second
    # job would differ from its first.
    torch.manual_seed(req.seed)
    gate.enter("encode")
    kwargs = pipeline_kwargs(pipe, req, conditioning, on_step_end)
    start = time.perf_counter()
    with (tracker if tracker is not None else contextlib.nullcontext()):
        kwargs = encode_and_park(pipe, req, kwargs, device)
    encoded = "prompt_embeds" in kwargs
    if encoded:
        gate.enter("denoise")  # a boundary: the prompt is encoded, no step has run
    step_hook = contextlib.nullcontext()
    if "callback_on_step_end" not in kwargs:
        # I2VGenXLPipeline has no step callback: run it after each scheduler step.
        step_hook = scheduler_step_callback(inner_pipeline(pipe), on_step_end)
    from .resume import checkpointing

    use_checkpoints = getattr(gate, "use_checkpoints", None)
    call_start = time.perf_counter()
    # The checkpoint hook goes on first, so the step callback (I2VGen-XL's) wraps it: the
    # step's outputs are kept before the gate votes, and a preemption there can save them.
    with torch.inference_mode(), (tracker if tracker is not None else contextlib.nullcontext()), \
            checkpointing(checkpoints, pipe, kwargs.get("generator"), device) as hooks, step_hook:
        if use_checkpoints is not None:
            use_checkpoints(hooks)
        try:
            output = pipe(**kwargs)
        finally:
            if use_checkpoints is not None:
                use_checkpoints(None)  # after the call no step's outputs are there to save
    end = time.perf_counter()
    frames = output.frames[0] if output.frames is not None else None
    if frames is not None and not (isinstance(frames, (list, tuple)) and frames and frames[0] is None):
        frames = np.asarray(frames, dtype=np.float32)
    else:
        frames = None  # xfuser: only the last rank decodes
    resumed = checkpoints.resume_step if checkpoints is not None else 0
    if resumed:
        marks = marks[resumed - 1:]  # the replayed steps took no model time
    step = (marks[-1] - marks[0]) / max(len(marks) - 1, 1) if marks else 0.0
    first = marks[0] if marks else end
    encode = (call_start - start) if encoded else max(first - call_start - step, 0.0)
    stage_times = {
        "encode": encode,
        "denoise": (marks[-1] - first + step) if marks else 0.0,
        "decode": end - (marks[-1] if marks else call_start),
    }
    return frames, stage_times
