"""Step-cache reuse: skip most transformer blocks on steps that barely change.

Both policies decide per denoiser call from the first block's output: if its
residual moved less than ``threshold`` (relative mean absolute change since
the last fully computed call), the remaining blocks are skipped and their
cached residual is added instead.

* ``dbcache``: cache-dit DBCache with ``Fn_compute_blocks=1,
  Bn_compute_blocks=0`` (first block always computed, no trailing blocks),
  the same decision rule as FirstBlockCache, plus ``max_warmup_steps`` fully
  computed steps first. Thresholds <= 0 never cache (bit-identical to off);
  >= 1.0 always cache after warmup.
* ``fbcache``: diffusers FirstBlockCache (no warmup). Threshold 0 never
  caches; a huge threshold caches every call after the first per context.
* ``teacache``: a separate hook, ``teacache.py`` (it reuses the whole
  denoiser output and needs no block layout, so it also serves ConsisID).

Why cache-dit in transformer-only mode, for every target (justification):
  - it is the only one that keeps ranks in step under sequence parallel: with
    torch.distributed initialised at world > 1 it all-reduces the decision
    statistics, so every rank skips the same calls (shard-local decisions
    disagreed on 2-4 of 15 steps and deadlocked the collectives, DESIGN.md);
  - xfuser's CogVideoX wrapper never runs ``CogVideoXPipeline.__call__``, so
    cache-dit's pipeline mode (which resets its context by wrapping
    ``__call__``) cannot work there; transformer-only mode can, with an
    explicit refresh per job;
  - pipeline mode patches ``pipe.__class__.__call__``: every pipeline of that
    class in the process goes through it, and ``disable_cache`` on one puts
    back the class attribute it saved, unwrapping the others. Transformer-only
    mode touches only the transformer instance;
  - one code path then serves plain diffusers pipelines and xfuser wrappers.
  Checked on the tiny CogVideoX and Wan: transformer-only mode (Wan with
  separate CFG contexts, as cache-dit's Wan pipeline adapter sets) caches the
  same steps and gives the same frames as the pipeline adapters.
FirstBlockCache is kept for single-process jobs: its per-rank decisions are
not synchronised, so it is refused when torch.distributed runs world > 1, and
it needs the diffusers pipeline's ``__call__`` (which opens the cache
contexts it keys its state by), so an xfuser wrapper is refused too.

Neither works on ConsisID: cache-dit swaps the block list for one fused
cached block while the transformer runs, and ConsisID's forward applies its
face cross-attention by block index inside that loop (so it runs once instead
of every ``cross_attn_interval`` blocks: frames differ by up to 1.0 from
cache-off even at threshold 0, checked on tiny-consisid); FirstBlockCache
does not run on it as shipped (DESIGN.md). Both are refused there.

Evaluations are counted with forward hooks on each block's feed-forward
module (cache hooks replace the block's forward, so a hook on the block
would count skipped blocks too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["CACHE_POLICIES", "DEFAULT_THRESHOLDS", "StepCacheConfig", "StepCacheHandle", "apply_step_cache"]

CACHE_POLICIES = ("off", "dbcache", "fbcache", "teacache")
# The libraries' defaults, tuned on real models (cache-dit DBCacheConfig
# residual_diff_threshold, diffusers FirstBlockCacheConfig threshold). Tiny
# random-weight models move much more per step and need higher thresholds.
DEFAULT_THRESHOLDS = {"dbcache": 0.08, "fbcache": 0.05}
# cache-dit's default warmup, for 28-50 step schedules.
MAX_AUTO_WARMUP = 8

_APPLIED_ATTR = "_videojob_stepcache"


@dataclass(frozen=True)
class _Layout:
    blocks_name: str
    pattern: str          # cache-dit ForwardPattern: what a block takes and returns
    separate_cfg: bool    # the pipeline calls the denoiser once per CFG branch
    ff_names: tuple[str, ...]


# By block class: xfuser's CogVideoX wrapper is not a CogVideoX subclass
# (it forwards attributes to the wrapped model), but its blocks are.
_LAYOUTS = {
    "CogVideoXBlock": _Layout("transformer_blocks", "Pattern_0", False, ("ff",)),
    "WanTransformerBlock": _Layout("blocks", "Pattern_2", True, ("ffn",)),
}
_REFUSED = {
    "ConsisIDBlock": "ConsisID applies its face cross-attention by block index inside the block "
                     "loop, which step caches replace (cache-dit output differs from cache-off "
                     "even at threshold 0)",
}


@dataclass(frozen=True)
class StepCacheConfig:
    """One job's step-cache choice ("auto" is resolved by the caller).

    ``threshold`` None takes ``DEFAULT_THRESHOLDS``; it is ignored for "off".
    ``warmup_steps`` (dbcache only) None means ``min(8, max(1, steps // 6))``:
    cache-dit's 8 for a 50-step job, 1 for an 8-step one.
    teacache is ``teacache.apply_teacache`` (``strategies.order`` picks it).
    """

    policy: str = "off"
    threshold: float | None = None
    num_inference_steps: int = 50
    warmup_steps: int | None = None

    def __post_init__(self) -> None:
        if self.policy == "teacache":
            raise ValueError("StepCacheConfig.policy: teacache is teacache.apply_teacache, "
                             "not a block cache; use strategies.order.apply_step_cache_for")
        if self.policy == "auto":
            raise ValueError("StepCacheConfig.policy 'auto' must be resolved by the caller "
                             "(to off, dbcache or fbcache)")
        if self.policy not in CACHE_POLICIES:
            raise ValueError(f"StepCacheConfig.policy must be one of {CACHE_POLICIES}, got {self.policy!r}")
        if self.threshold is not None:
            if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
                raise ValueError(f"StepCacheConfig.threshold must be a number, got {self.threshold!r}")
            if not math.isfinite(self.threshold):
                raise ValueError(f"StepCacheConfig.threshold must be finite, got {self.threshold!r}")
            if self.threshold < 0:
                raise ValueError(f"StepCacheConfig.threshold must be >= 0, got {self.threshold!r}")
        _check_steps(self.num_inference_steps)
        if self.warmup_steps is not None:
            if self.policy == "fbcache":
                raise ValueError("StepCacheConfig.warmup_steps: fbcache has no warmup (leave it None)")
            if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                    or self.warmup_steps < 0:
                raise ValueError(f"StepCacheConfig.warmup_steps must be an int >= 0, "
                                 f"got {self.warmup_steps!r}")

    def resolved_threshold(self) -> float | None:
        if self.policy == "off":
            return None
        return float(self.threshold) if self.threshold is not None else DEFAULT_THRESHOLDS[self.policy]

    def resolved_warmup(self, num_inference_steps: int | None = None) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        steps = num_inference_steps or self.num_inference_steps
        return min(MAX_AUTO_WARMUP, max(1, steps // 6))


def _check_steps(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"StepCacheConfig.num_inference_steps must be an int >= 1, got {n!r}")


class StepCacheHandle:
    """The step cache on one pipeline: refresh before every job, read stats
    after it, remove to go back to cache-off."""

    def __init__(self, config: StepCacheConfig, transformers: list, layout: _Layout, blocks: list):
        self.config = config
        self._transformers = transformers
        self._layout = layout
        self._blocks = blocks            # one block list per transformer
        self._adapter = None             # cache-dit BlockAdapter (dbcache)
        self._hooks: list = []
        self._evaluations = 0
        self._calls = [0] * len(transformers)
        self._steps = config.num_inference_steps
        self._cfg = True
        self._removed = False
        for i, (tr, blist) in enumerate(zip(transformers, blocks)):
            self._hooks.append(tr.register_forward_pre_hook(self._make_call_counter(i)))
            ffs = [next((getattr(b, n) for n in layout.ff_names if hasattr(b, n)), None) for b in blist]
            if any(ff is None for ff in ffs):  # unknown layout ("off" only): count nothing
                self._blocks[i] = []
                continue
            for ff in ffs:
                self._hooks.append(ff.register_forward_hook(self._count_evaluation))

    # -- counting ---------------------------------------------------------
    def _count_evaluation(self, *_args) -> None:
        self._evaluations += 1

    def _make_call_counter(self, index: int):
        def count(*_args):
            self._calls[index] += 1
            if self.config.policy == "dbcache" and sum(self._calls) > self._expected_calls():
                # cache-dit's context persists across calls: a job that did not
                # refresh would reuse the previous job's residuals.
                raise RuntimeError("step cache: more denoiser calls than this job's "
                                   f"{self._steps} steps allow; call handle.refresh(num_inference_steps, "
                                   "cfg=...) before every job")
        return count

    def _expected_calls(self) -> int:
        per_step = 2 if (self._layout.separate_cfg and self._cfg) else 1
        return self._steps * per_step

    def stats(self) -> dict[str, int]:
        """Real block evaluations since the last refresh, and the blocks the
        cache skipped (calls x blocks per call - evaluations)."""
        possible = sum(c * len(b) for c, b in zip(self._calls, self._blocks))
        return {"evaluations": self._evaluations, "skipped": possible - self._evaluations,
                "calls": sum(self._calls)}

    # -- lifecycle --------------------------------------------------------
    def refresh(self, num_inference_steps: int, *, cfg: bool = True) -> None:
        """Start a new job: fresh cache state and counters. ``cfg``: the job
        uses classifier-free guidance (Wan then calls the denoiser twice per
        step, and the cond/uncond calls keep separate cache contexts)."""
        self._check_live()
        _check_steps(num_inference_steps)
        self._steps, self._cfg = num_inference_steps, bool(cfg)
        self._evaluations = 0
        self._calls = [0] * len(self._transformers)
        if self.config.policy == "dbcache":
            import cache_dit

            for tr in self._transformers:
                cache_dit.refresh_context(tr, cache_config=self._db_config(num_inference_steps))
        elif self.config.policy == "fbcache":
            for tr in self._transformers:
                tr._reset_stateful_cache()

    def remove(self) -> None:
        """Back to cache-off (the counting hooks go too). Idempotent."""
        if self._removed:
            return
        if self.config.policy == "dbcache":
            import cache_dit

            cache_dit.disable_cache(self._adapter)
        elif self.config.policy == "fbcache":
            for tr in self._transformers:
                tr.disable_cache()
        for h in self._hooks:
            h.remove()
        for tr in self._transformers:
            if getattr(tr, _APPLIED_ATTR, None) is self:
                delattr(tr, _APPLIED_ATTR)
        self._removed = True

    def _check_live(self) -> None:
        if self._removed:
            raise RuntimeError("step cache handle was removed; apply_step_cache again")

    # -- policies ---------------------------------------------------------
    def _db_config(self, num_inference_steps: int):
        from cache_dit import DBCacheConfig

        return DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0,
            residual_diff_threshold=self.config.resolved_threshold(),
            max_warmup_steps=self.config.resolved_warmup(num_inference_steps),
            num_inference_steps=num_inference_steps,
            enable_separate_cfg=self._layout.separate_cfg and self._cfg,
        )

    def _enable_dbcache(self) -> None:
        import cache_dit
        from cache_dit import BlockAdapter, ForwardPattern

        trs, blocks = self._transformers, self._blocks
        pattern = getattr(ForwardPattern, self._layout.pattern)
        one = len(trs) == 1
        adapter = BlockAdapter(
            transformer=trs[0] if one else list(trs),
            blocks=blocks[0] if one else list(blocks),
            blocks_name=self._layout.blocks_name if one else [self._layout.blocks_name] * len(trs),
            forward_pattern=pattern if one else [pattern] * len(trs),
            # xfuser's wrapper forwards by *args: the signature check would fail.
            check_forward_pattern=False,
            has_separate_cfg=self._layout.separate_cfg,
        )
        self._adapter = cache_dit.enable_cache(adapter, cache_config=self._db_config(self._steps))
        # cache-dit returns the adapter untouched (no cache, no error) when it
        # does not accept it: fail loudly instead of running uncached.
        if not all(getattr(tr, "_is_cached", False) for tr in trs):
            raise RuntimeError(f"cache-dit did not apply DBCache to {type(trs[0]).__name__}")

    def _enable_fbcache(self) -> None:
        from diffusers.hooks import FirstBlockCacheConfig

        for tr in self._transformers:
            tr.enable_cache(FirstBlockCacheConfig(threshold=self.config.resolved_threshold()))


def apply_step_cache(target, config: StepCacheConfig) -> StepCacheHandle:
    """Apply ``config`` to ``target``: a diffusers pipeline, or any object
    exposing ``.transformer`` (xfuser's pipeline wrapper). Wan 2.2's
    ``transformer_2`` is cached too when present. Call ``handle.refresh``
    before every job, including the first one on a warm pipeline."""
    if not isinstance(config, StepCacheConfig):
        raise ValueError(f"config must be a StepCacheConfig, got {type(config).__name__}")
    transformer = getattr(target, "transformer", None)
    if not isinstance(transformer, torch.nn.Module):
        raise ValueError(f"apply_step_cache needs an object with a .transformer module, "
                         f"got {type(target).__name__}")
    transformers = [transformer]
    second = getattr(target, "transformer_2", None)
    if isinstance(second, torch.nn.Module):
        transformers.append(second)
    for tr in transformers:
        if getattr(tr, _APPLIED_ATTR, None) is not None:
            raise ValueError("StepCacheConfig: this transformer already has a step cache; "
                             "call its handle's remove() first")
    if config.policy == "dbcache" and any(
            type(getattr(tr, "_hf_hook", None)).__name__ == "CpuOffload" for tr in transformers):
        # diffusers re-installs model offload after every call; removing the
        # old accelerate hook puts back the forward it wrapped, the one from
        # before cache-dit, so the cache would silently stop after one job.
        raise ValueError("StepCacheConfig.policy dbcache: apply the step cache before model offload "
                         "(strategies.order: step cache, fp8, offload, VAE; enable_model_cpu_offload "
                         "re-arms its hooks after every call and would drop a cache installed after it)")
    layout, blocks = None, []
    for tr in transformers:
        lay, blist = _layout_of(tr, config.policy)
        if layout is not None and lay != layout:
            raise ValueError("StepCacheConfig.policy: the two transformers have different block layouts")
        layout = lay
        blocks.append(blist)

    if config.policy == "fbcache":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ValueError("StepCacheConfig.policy fbcache: FirstBlockCache decides per rank, and "
                             "ranks that disagree deadlock the collectives; use dbcache under xfuser")
        from diffusers import DiffusionPipeline

        if not isinstance(target, DiffusionPipeline):
            raise ValueError(f"StepCacheConfig.policy fbcache needs a diffusers pipeline (its __call__ "
                             f"opens the cache contexts), got {type(target).__name__}; use dbcache")
        if not all(hasattr(tr, "enable_cache") for tr in transformers):
            raise ValueError("StepCacheConfig.policy fbcache needs a diffusers transformer")

    handle = StepCacheHandle(config, transformers, layout, blocks)
    try:
        if config.policy == "dbcache":
            handle._enable_dbcache()
        elif config.policy == "fbcache":
            handle._enable_fbcache()
    except BaseException:
        for h in handle._hooks:
            h.remove()
        raise
    for tr in transformers:
        setattr(tr, _APPLIED_ATTR, handle)
    handle.refresh(config.num_inference_steps)
    return handle


def _layout_of(transformer, policy: str) -> tuple[_Layout, list]:
    for name in ("transformer_blocks", "blocks"):
        blist = getattr(transformer, name, None)
        if not (isinstance(blist, torch.nn.ModuleList) and len(blist) > 0):
            continue
        cls = type(blist[0]).__name__
        if policy == "off":  # only counting: any block with a feed-forward will do
            lay = _LAYOUTS.get(cls) or _Layout(name, "", False, ("ff", "ffn"))
            return lay, blist
        if cls in _REFUSED:
            raise ValueError(f"StepCacheConfig.policy {policy}: not for {cls}: {_REFUSED[cls]}")
        if cls not in _LAYOUTS or _LAYOUTS[cls].blocks_name != name:
            raise ValueError(f"StepCacheConfig.policy {policy}: no step-cache layout for {cls} blocks "
                             f"(known: {', '.join(_LAYOUTS)})")
        return _LAYOUTS[cls], blist  # the ModuleList itself: cache-dit rejects a plain list
    if policy == "off":
        return _Layout("", "", False, ()), []
    raise ValueError(f"StepCacheConfig.policy {policy}: {type(transformer).__name__} has no "
                     "transformer_blocks/blocks list")
