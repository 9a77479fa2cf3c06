"""TeaCache-style step skipping for any denoiser, including ConsisID.

Why a second cache: cache-dit's DBCache reorders ConsisID's block list while
ConsisID applies face cross-attention by block index, which changes its
output even with caching off (measured; see stepcache.py). This cache never
enters the transformer: it watches the denoiser's input between calls and,
while the accumulated relative L1 change stays under the threshold, reuses
the previous output instead of calling the transformer (the idea of TeaCache,
Liu et al. 2024; simplified: the raw input instead of the timestep-modulated
one, so no per-model fitted polynomial, and the output reused instead of the
block residual, so it works on a wrapped transformer unchanged).

It is a diffusers ``ModelHook`` in the transformer's ``HookRegistry``, so
model offload, which re-installs its accelerate hooks after every pipeline
call, puts it back with the forward it wrapped instead of dropping it (the
cache must be applied before offload: ``strategies.order``).

State is kept per CFG branch: a pipeline that calls the denoiser twice per
step (Wan: cond, then uncond) gets two independent histories, keyed by the
pipeline's cache context ("cond"/"uncond") when it sets one and by the call's
position within the step otherwise. One shared history would see the uncond
call's input equal to the cond call's, reuse the cond output, and silently
drop guidance.

Under sequence parallel each rank sees a shard: the change is all-reduced
(sum of numerator and denominator) so every rank makes the same decision;
one rank skipping alone would deadlock the others in the next collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.hooks import BaseState, StateManager

DEFAULT_THRESHOLD = 0.1
HOOK_NAME = "videojob_teacache"


@dataclass(frozen=True)
class TeaCacheConfig:
    threshold: float = DEFAULT_THRESHOLD
    # Calls always computed at the start of a job, per branch (the first steps change most).
    warmup_calls: int = 1
    # Denoiser calls per step with guidance on (2 for pipelines that run cond and uncond separately).
    calls_per_step: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not self.threshold > 0:
            raise ValueError(f"TeaCacheConfig.threshold must be a number > 0, got {self.threshold!r}")
        if self.warmup_calls < 1:
            raise ValueError(f"TeaCacheConfig.warmup_calls must be >= 1, got {self.warmup_calls!r}")
        if self.calls_per_step not in (1, 2):
            raise ValueError(f"TeaCacheConfig.calls_per_step must be 1 or 2, got {self.calls_per_step!r}")


class _Branch(BaseState):
    """One CFG branch's history: the last input, the last computed output, the accumulated change."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, *args, **kwargs) -> None:
        self.previous = None
        self.output = None
        self.accumulated = 0.0
        self.calls = 0


class _TeaCacheHook(ModelHook):
    _is_stateful = True

    def __init__(self, handle: "TeaCacheHandle"):
        super().__init__()
        self.handle = handle
        # Receives the pipeline's cache_context("cond"/"uncond") (diffusers sets it on StateManagers).
        self.contexts = StateManager(_Branch)

    def reset_state(self, module):
        # Called by the pipeline after every call: drop the cached outputs; counters live on the handle.
        self.handle._branches.clear()
        return module

    def new_forward(self, module, *args, **kwargs):
        return self.handle._forward(self.fn_ref.original_forward, self.contexts, args, kwargs)


class TeaCacheHandle:
    """Counts are in denoiser calls: ``evaluations`` ran, ``skipped`` reused."""

    def __init__(self, transformer, config: TeaCacheConfig):
        self.transformer, self.config = transformer, config
        self._branches: dict[str, _Branch] = {}
        self._calls_per_step = config.calls_per_step
        self._counts = {"calls": 0, "evaluations": 0, "skipped": 0}
        self._removed = False
        registry = _own_registry(transformer)
        if registry.get_hook(HOOK_NAME) is not None:
            raise ValueError("TeaCacheConfig: this transformer already has a TeaCache; remove it first")
        self._hook = _TeaCacheHook(self)
        registry.register_hook(self._hook, HOOK_NAME)

    def refresh(self, num_inference_steps: int | None = None, *, cfg: bool = True) -> None:
        """Forget the previous job: first calls compute, counters restart. ``cfg``:
        the job uses guidance (a two-call pipeline then alternates branches)."""
        self._branches = {}
        self._calls_per_step = self.config.calls_per_step if cfg else 1
        self._counts = {"calls": 0, "evaluations": 0, "skipped": 0}

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def remove(self) -> None:
        if self._removed:
            return
        _own_registry(self.transformer).remove_hook(HOOK_NAME, recurse=False)
        self._removed = True

    def _branch_key(self, contexts: StateManager) -> str:
        context = getattr(contexts, "_context", None)
        if context is not None:
            return f"context:{context.name}"
        return f"call:{self._counts['calls'] % self._calls_per_step}"

    def _change(self, current, previous) -> float:
        import torch
        import torch.distributed as dist

        num = (current - previous).abs().mean()
        den = previous.abs().mean()
        values = torch.stack([num, den]).float()  # on the hidden states' device (NCCL needs that)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values)  # sums over ranks: the same ratio everywhere
        return float(values[0] / values[1].clamp_min(1e-12))

    def _forward(self, original, contexts: StateManager, args: tuple, kwargs: dict[str, Any]):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        key = self._branch_key(contexts)
        self._counts["calls"] += 1
        branch = self._branches.setdefault(key, _Branch())
        branch.calls += 1
        current = hidden_states.detach()
        previous, branch.previous = branch.previous, current
        if previous is not None and branch.output is not None and branch.calls > self.config.warmup_calls:
            branch.accumulated += self._change(current, previous)
            if branch.accumulated < self.config.threshold:
                self._counts["skipped"] += 1
                return branch.output
        output = original(*args, **kwargs)
        branch.accumulated = 0.0
        branch.output = output
        self._counts["evaluations"] += 1
        return output


def _own_registry(module) -> HookRegistry:
    """``module``'s own hook registry. Not ``HookRegistry.check_if_exists_or_initialize``:
    xfuser's wrappers forward unknown attributes to the model they wrap, so on a
    wrapper whose pipeline has run a job (diffusers' cache contexts then gave
    the wrapped model a registry) it returns the wrapped model's registry, and
    the hook wraps a ``forward`` the wrapper never calls: the cache silently
    does nothing (measured on xfuser's CogVideoX wrapper, stepcache_bench)."""
    registry = module.__dict__.get("_diffusers_hook")
    if registry is None:
        registry = HookRegistry(module)
        module._diffusers_hook = registry
    return registry


def apply_teacache(transformer, config: TeaCacheConfig) -> TeaCacheHandle:
    if not isinstance(config, TeaCacheConfig):
        raise ValueError(f"config must be a TeaCacheConfig, got {type(config).__name__}")
    if type(getattr(transformer, "_hf_hook", None)).__name__ == "CpuOffload":
        raise ValueError("TeaCacheConfig: apply the step cache before model offload "
                         "(strategies.order: step cache, fp8, offload, VAE)")
    return TeaCacheHandle(transformer, config)
