"""TeaCache-style step skipping for any denoiser, including ConsisID.

Why a second cache: cache-dit's DBCache reorders ConsisID's block list while
ConsisID applies face cross-attention by block index, which changes its
output even with caching off (measured; see stepcache.py). This cache never
enters the transformer: it watches the denoiser's input between steps and,
while the accumulated relative L1 change stays under the threshold, reuses
the previous output instead of calling the transformer (the idea of TeaCache,
Liu et al. 2024; simplified: the raw input instead of the timestep-modulated
one, so no per-model fitted polynomial, and the output reused instead of the
block residual, so it works on a wrapped transformer unchanged).

Under sequence parallel each rank sees a shard: the change is all-reduced
(mean) so every rank makes the same decision; one rank skipping alone would
deadlock the others in the next collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_THRESHOLD = 0.1


@dataclass(frozen=True)
class TeaCacheConfig:
    threshold: float = DEFAULT_THRESHOLD
    # Calls always computed at the start of a job (the first steps change most).
    warmup_calls: int = 1

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"TeaCacheConfig.threshold must be > 0, got {self.threshold!r}")
        if self.warmup_calls < 1:
            raise ValueError(f"TeaCacheConfig.warmup_calls must be >= 1, got {self.warmup_calls!r}")


class TeaCacheHandle:
    """Counts are in denoiser calls: ``evaluations`` ran, ``skipped`` reused."""

    def __init__(self, transformer, config: TeaCacheConfig):
        self.transformer, self.config = transformer, config
        self._original = transformer.forward
        self._state: dict[str, Any] = {}
        self.refresh()
        transformer.forward = self._forward

    def refresh(self, num_inference_steps: int | None = None, *, cfg: bool = True) -> None:
        """Forget the previous job: first calls compute, counters restart."""
        self._state = {"prev": None, "output": None, "acc": 0.0, "calls": 0, "evaluations": 0, "skipped": 0}

    def stats(self) -> dict[str, int]:
        s = self._state
        return {"evaluations": s["evaluations"], "skipped": s["skipped"], "calls": s["calls"]}

    def remove(self) -> None:
        self.transformer.forward = self._original

    def _change(self, current, previous) -> float:
        import torch
        import torch.distributed as dist

        num = (current - previous).abs().mean()
        den = previous.abs().mean()
        values = torch.stack([num, den]).float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values)  # sums over ranks: the same ratio everywhere
        return float(values[0] / values[1].clamp_min(1e-12))

    def _forward(self, hidden_states, *args, **kwargs):
        s = self._state
        s["calls"] += 1
        current = hidden_states.detach()
        previous = s["prev"]
        s["prev"] = current
        if previous is not None and s["output"] is not None and s["calls"] > self.config.warmup_calls:
            s["acc"] += self._change(current, previous)
            if s["acc"] < self.config.threshold:
                s["skipped"] += 1
                return s["output"]
        output = self._original(hidden_states, *args, **kwargs)
        s["acc"] = 0.0
        s["output"] = output
        s["evaluations"] += 1
        return output


def apply_teacache(transformer, config: TeaCacheConfig) -> TeaCacheHandle:
    if not isinstance(config, TeaCacheConfig):
        raise ValueError(f"config must be a TeaCacheConfig, got {type(config).__name__}")
    return TeaCacheHandle(transformer, config)
