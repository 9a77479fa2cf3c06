"""Save and resume a denoising loop at step boundaries, around an unmodified pipeline call.

The pipelines' loops (diffusers' and xfuser's) are not changed. Two hooks
are put on for one call and taken off after it:

- the scheduler's ``step``: after step k it snapshots the step's outputs
  (the new latents and, for CogVideoX's DPM scheduler, the
  ``old_pred_original_sample`` the loop carries), the scheduler's dynamic
  state (step index, the multistep history of DPM/UniPC solvers), the
  generator's and torch's RNG states: a checkpoint. When resuming from step
  k it lets steps 1..k run on dummy inputs and, at step k, puts back what
  the checkpoint holds, so the loop goes on from step k+1 exactly as the
  interrupted run would have. It keeps the last step's outputs, so a
  preemption at that step's boundary can save it off the schedule
  (``save_now``);
- the denoiser's ``forward``: for steps 1..k of a resume it returns zeros
  shaped like its input instead of running the model (the scheduler hook
  throws those steps' results away).

Layouts: under xfuser's CogVideoX/ConsisID wrappers with sequence parallel,
the loop's latents are the rank's slice of the height (dim -2); tensors of
that shape are all-gathered along it before saving and sliced again on
resume, so a checkpoint is layout-independent (Wan shards inside its
transformer: its loop holds the whole latents). Step caches (DBCache,
TeaCache) are not saved: after a resume they start fresh at step k+1 (their
warm-up runs again), so with a cache on the frames differ a little from an
uninterrupted run; with the cache off they are bit-identical on one layout.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .checkpoint import Checkpoint, CheckpointStore, job_key

_PLAIN = (int, float, bool, str, type(None))


@dataclass
class Shard:
    """How this rank's loop tensors relate to the whole (None: they are whole)."""

    world: int
    rank: int
    gather: Callable[[Any], Any]  # tensor slice -> whole tensor (a collective: every rank calls it)


@dataclass
class StepCheckpointing:
    """One job's checkpoint plan on one rank."""

    store: CheckpointStore
    every_steps: int  # 0: never save
    writer: bool  # this rank writes (rank 0); every rank gathers
    resume_from: Checkpoint | None = None
    shard: Shard | None = None
    written: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"StepCheckpointing.every_steps must be >= 0, got {self.every_steps}")

    @property
    def resume_step(self) -> int:
        return self.resume_from.step if self.resume_from is not None else 0

    def due(self, step: int) -> bool:
        """Save after ``step`` (1-based)? Never after the last step: decode follows at once."""
        return self.every_steps > 0 and step % self.every_steps == 0 and step < self.store.steps

    def report(self) -> dict[str, Any]:
        return {"resumedFromStep": self.resume_step, "written": len(self.written),
                "seconds": round(sum(w["seconds"] for w in self.written), 4),
                "bytes": max((w["bytes"] for w in self.written), default=0)}


def _base(scheduler):
    return getattr(scheduler, "module", scheduler)  # xfuser's wrapper keeps the diffusers scheduler


def _kept(name: str, value) -> str | None:
    """What kind of scheduler attribute ``scheduler_state`` keeps (tensor, plain, list), or None."""
    import torch

    if name in ("config", "_internal_dict") or name.startswith("__"):
        return None
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, _PLAIN):
        return "plain"
    if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) or isinstance(v, _PLAIN) for v in value):
        return "list"
    return None


def scheduler_state(scheduler) -> dict[str, Any]:
    """The scheduler's instance attributes that are numbers, strings, tensors or lists of them."""
    out: dict[str, Any] = {}
    for name, value in vars(_base(scheduler)).items():
        kind = _kept(name, value)
        if kind is not None:
            out[name] = list(value) if kind == "list" else value
    return out


def restore_scheduler_state(scheduler, state: dict[str, Any], device) -> None:
    """Set the saved attributes back: only data attributes of the kinds ``scheduler_state`` keeps,
    each of the kind this scheduler has now where it has it (a None stands for any: schedulers
    start some at None), never a name its class defines (a method, a property) or the config. A
    checkpoint naming any other is refused whole (ValueError) before anything is set: a rank's
    scheduler outlives the job when its group is reused by the next one (issue 36)."""
    import torch

    base = _base(scheduler)
    now = vars(base)
    for name, value in state.items():
        if not isinstance(name, str) or not name.isidentifier() or hasattr(type(base), name):
            raise ValueError(f"checkpoint names scheduler attribute {name!r}, which is not a data attribute "
                             "a checkpoint keeps")
        saved = _kept(name, value)
        current = _kept(name, now[name]) if name in now else saved  # (made during steps: not there yet)
        if saved is None or current is None:
            raise ValueError(f"checkpoint's scheduler attribute {name!r} is not one a checkpoint keeps")
        if saved != current and value is not None and now[name] is not None:
            raise ValueError(f"checkpoint's scheduler attribute {name!r} is a {saved}, this scheduler's a {current}")

    def place(name: str, value):
        if not isinstance(value, torch.Tensor):
            return value
        current = getattr(base, name, None)
        return value.to(current.device if isinstance(current, torch.Tensor) else device)

    for name, value in state.items():
        if isinstance(value, list):
            was = getattr(base, name, None)
            value = [v.to(device) if isinstance(v, torch.Tensor) else v for v in value]
            setattr(base, name, tuple(value) if isinstance(was, tuple) else value)
        else:
            setattr(base, name, place(name, value))


def _map_tensors(obj, fn):
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_map_tensors(v, fn) for v in obj]
    return obj


def _step_outputs(out) -> tuple[str, list]:
    """A scheduler step's result as (kind, tensors): a tuple, or an output object's fields."""
    if isinstance(out, tuple):
        return "tuple", list(out)
    return "fields", [getattr(out, "prev_sample", None), getattr(out, "pred_original_sample", None)]


def _with_outputs(out, kind: str, values: list):
    """A step's result rebuilt: a tuple, or an object with the fields the loops read."""
    if kind == "tuple":
        return tuple(values)
    from types import SimpleNamespace

    return SimpleNamespace(prev_sample=values[0], pred_original_sample=values[1] if len(values) > 1 else None)


class _Hooks:
    def __init__(self, plan: StepCheckpointing, pipe, generator, device):
        from .pipelines import inner_pipeline

        self.plan, self.device, self.generator = plan, device, generator
        self.inner = inner_pipeline(pipe)
        self.scheduler = self.inner.scheduler
        self.denoisers = [m for m in (getattr(self.inner, "transformer", None), getattr(self.inner, "transformer_2", None),
                                      getattr(self.inner, "unet", None)) if m is not None]
        self.step_signature = inspect.signature(type(_base(self.scheduler)).step)
        self.calls = 0  # scheduler steps taken in this call (the loop's index)
        self.slice_shape = None
        self.last: tuple[int, Any] | None = None  # (step, its scheduler outputs): what save_now saves

    # -- the whole <-> this rank's slice --------------------------------------
    def _whole(self, t):
        shard = self.plan.shard
        if shard is None or self.slice_shape is None or tuple(t.shape) != self.slice_shape:
            return t.detach().to("cpu", copy=True)
        return shard.gather(t.detach().contiguous()).to("cpu")

    def _slice(self, t):
        """A whole tensor of the loop's latents shape -> this rank's slice (others as they are)."""
        import torch

        shard, want = self.plan.shard, self.slice_shape
        if (shard is not None and want is not None and t.dim() == len(want) and t.shape[-2] == want[-2] * shard.world
                and tuple(t.shape[:-2]) == want[:-2] and t.shape[-1] == want[-1]):
            t = torch.chunk(t, shard.world, dim=-2)[shard.rank]
        return t.to(self.device)

    # -- the hooks -----------------------------------------------------------
    def step(self, original, *args, **kwargs):
        import torch

        index = self.calls
        self.calls += 1
        # By name: CogVideoX's DPM step takes (model_output, old_pred_original_sample, timestep,
        # timestep_back, sample), the others (model_output, timestep, sample).
        # The scheduler class's own signature: ``original`` may be another hook's (*args, **kwargs).
        sample = self.step_signature.bind_partial(None, *args, **kwargs).arguments.get("sample")
        if isinstance(sample, torch.Tensor) and self.slice_shape is None:
            self.slice_shape = tuple(sample.shape)
        step = index + 1
        resume = self.plan.resume_from
        if resume is not None and step <= resume.step:
            # A replayed step: the model did not run (``forward``), so the scheduler is not
            # called; at step k the checkpoint's outputs and state come back.
            kind = "tuple" if kwargs.get("return_dict", True) is False else "fields"
            if step < resume.step:
                width = max(len(resume.state["outputs"]), 1) if kind == "tuple" else 2
                return _with_outputs(None, kind, [sample] + [None] * (width - 1))
            return self._restore(kind, resume.state)
        out = original(*args, **kwargs)
        self.last = (step, out)
        if self.plan.due(step):
            self._save(step, out)
        return out

    def save_now(self, step: int) -> None:
        """Save step ``step``'s checkpoint now, off the schedule (a preemption at the
        step's boundary). A collective under sequence parallel: every rank calls it."""
        if self.last is None or self.last[0] != step:
            have = self.last[0] if self.last is not None else None
            raise ValueError(f"save_now({step}): the last step taken is {have}")
        self._save(step, self.last[1])

    def _save(self, step: int, out) -> None:
        import torch

        start = time.perf_counter()
        kind, values = _step_outputs(out)
        state = {
            "outputs_kind": kind,
            "outputs": [self._whole(v) if isinstance(v, torch.Tensor) else None for v in values],
            "scheduler": _map_tensors(scheduler_state(self.scheduler), self._whole),
            "generator": self.generator.get_state() if self.generator is not None else None,
            "torch_rng": torch.get_rng_state(),
        }
        if self.plan.writer:
            path, nbytes, seconds = self.plan.store.save(step, state)
            self.plan.written.append({"step": step, "bytes": nbytes,
                                      "seconds": time.perf_counter() - start, "write_seconds": seconds})
        else:
            self.plan.written.append({"step": step, "bytes": 0, "seconds": time.perf_counter() - start})

    def _restore(self, kind: str, state: dict[str, Any]):
        import torch

        if kind != state["outputs_kind"]:
            raise ValueError(f"checkpoint step outputs are {state['outputs_kind']!r}, this loop's are {kind!r}")
        # Checkpoints hold whole tensors whatever layout wrote them: slice them for this one.
        values = [self._slice(v) if isinstance(v, torch.Tensor) else None for v in state["outputs"]]
        restore_scheduler_state(self.scheduler, _map_tensors(state["scheduler"], self._slice), self.device)
        if self.generator is not None and state.get("generator") is not None:
            self.generator.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        return _with_outputs(None, kind, values)

    def forward(self, original, *args, **kwargs):
        import torch

        resume = self.plan.resume_from
        if resume is None or self.calls >= resume.step:
            return original(*args, **kwargs)
        # The scheduler hook ignores this output; guidance only chunks and mixes it.
        like = next((a for a in list(args) + [kwargs.get("hidden_states"), kwargs.get("sample")]
                     if isinstance(a, torch.Tensor)), None)
        if like is None:
            return original(*args, **kwargs)
        return _Skipped(torch.zeros_like(like))


class _Skipped(tuple):
    """A skipped model call's output: ``out[0]`` and ``out.sample`` are both zeros."""

    def __new__(cls, zeros):
        return super().__new__(cls, (zeros,))

    @property
    def sample(self):
        return self[0]


@contextlib.contextmanager
def checkpointing(plan: StepCheckpointing | None, pipe, generator, device: str):
    """Put the hooks on ``pipe`` for one call (nothing when ``plan`` is None). With a
    plan the step hook is on even when no save is scheduled: a preemption saves
    the step it stops at (``save_now``)."""
    if plan is None:
        yield None
        return
    hooks = _Hooks(plan, pipe, generator, device)
    patched: list[tuple[Any, str, bool, Any]] = []

    def patch(obj, name: str, hook):
        had = name in vars(obj)
        previous = vars(obj).get(name)
        original = getattr(obj, name)

        @functools.wraps(original)  # pipelines read step's signature (eta, generator)
        def wrapper(*args, **kwargs):
            return hook(original, *args, **kwargs)

        object.__setattr__(obj, name, wrapper)  # past xfuser's wrapper __setattr__
        patched.append((obj, name, had, previous))

    patch(hooks.scheduler, "step", hooks.step)
    if plan.resume_from is not None:
        for module in hooks.denoisers:
            patch(module, "forward", hooks.forward)
    try:
        yield hooks
    finally:
        for obj, name, had, previous in reversed(patched):
            if had:
                object.__setattr__(obj, name, previous)
            else:
                object.__delattr__(obj, name)


# -- one job's plan on one rank ------------------------------------------------

def job_fingerprint(req) -> str:
    """The fingerprint of everything in ``req`` that changes its frames, the input images' bytes included."""
    from .checkpoint import fingerprint
    from .inputs import resolve_input

    inputs: dict[str, bytes] = {}
    for name, uri in (("image", req.image), ("face_image", req.face_image)):
        if uri:
            inputs[name] = resolve_input(uri, f"spec.{name}", req.local_inputs_dir, req.namespace).read_bytes()
            if name == "face_image":
                inputs["face_embeddings"] = resolve_input(f"{uri}.npz", "spec.faceImage",
                                                          req.local_inputs_dir, req.namespace).read_bytes()
    return fingerprint(req.to_dict(), inputs)


def job_store(req) -> CheckpointStore:
    """``req``'s checkpoint store, its files signed with the job's key (``checkpoint.job_key``)."""
    fp = job_fingerprint(req)
    return CheckpointStore(req.checkpoint_dir, fp, req.steps, root=req.output_root, key=job_key(req.namespace, fp))


def plan_for(req, rank: int, world: int, device: str, pipe, agree_min=None) -> tuple[StepCheckpointing | None, list[str]]:
    """The rank's checkpoint plan for ``req`` and what it refused on disk.

    Every rank picks the newest checkpoint it can read; with ``agree_min``
    (an all-reduce MIN over the group) the ranks settle on a step all of them
    read, so no rank resumes from another step than its peers."""
    if not req.checkpoint_dir or req.steps < 2:
        return None, []
    store = job_store(req)
    found = store.newest()
    refused = list(found.refused)
    chosen = found.checkpoint
    for _ in range(len(store.steps_on_disk()) + 2):
        if agree_min is None:
            break
        mine = chosen.step if chosen is not None else 0
        agreed = agree_min(mine)
        all_have = 1
        if agreed != mine:
            try:
                chosen = store.load(agreed) if agreed else None
            except (OSError, ValueError, RuntimeError, EOFError) as exc:
                refused.append(f"step-{agreed:06d}.ckpt: {str(exc)[:200]}")
                again = store.newest(below=agreed)
                refused.extend(r for r in again.refused if r not in refused)
                chosen, all_have = again.checkpoint, 0
        if agree_min(-all_have) == -1:  # MIN of -1 (have it) and 0 (do not): -1 only when every rank has it
            break
    return StepCheckpointing(store=store, every_steps=req.checkpoint_every_steps, writer=rank == 0,
                             resume_from=chosen, shard=_shard(pipe, world)), refused


def _shard(pipe, world: int) -> Shard | None:
    """xfuser's CogVideoX/ConsisID wrappers slice the loop's latents by height per sequence-parallel rank."""
    if world == 1 or getattr(pipe, "module", None) is None:
        return None
    from xfuser.core.distributed import get_sequence_parallel_rank, get_sequence_parallel_world_size, get_sp_group

    sp = get_sequence_parallel_world_size()
    if sp == 1:
        return None
    return Shard(world=sp, rank=get_sequence_parallel_rank(),
                 gather=lambda t: get_sp_group().all_gather(t, dim=-2))
