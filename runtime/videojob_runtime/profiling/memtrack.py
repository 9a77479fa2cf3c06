"""Live tensor-storage bytes, counted at the dispatcher.

``LiveBytes`` is a ``TorchDispatchMode``: every ATen op that runs under it
hands its outputs to ``__torch_dispatch__``; each output storage that did not
exist before (not a view of an argument, not seen already, not registered as
resident) adds its ``nbytes`` to ``live`` and gets a ``weakref.finalize`` on
its Python storage object that subtracts them again when the storage dies.
``peak`` is the high-water mark of ``live``.

It works the same on real tensors and on ``FakeTensor``s (whose storages are
meta storages with the right ``nbytes``), so a forward pass of a full-size
model under ``FakeTensorMode`` gives the activation peak a real run would
reach, without allocating it. Resident storages (weights, pre-built inputs)
are registered up front and never counted: ``peak`` is the activation
working set of the call, outputs included.

What it does not see: allocator rounding and fragmentation, cuDNN / cuBLAS
workspaces, the CUDA context. Those are added by the planner as calibrated
terms, not here.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "Allocation", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (shared by all its views)."""
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class Allocation:
    """One large allocation, kept for diagnostics."""

    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: str


class LiveBytes(TorchDispatchMode):
    """Count live bytes of storages created under this mode, with a peak.

    ``resident``: tensors (or modules' parameters and buffers, via
    :meth:`add_resident`) whose storages exist before the call and must not
    be counted even when an op returns a view of them.
    ``keep_largest``: how many of the largest single allocations to remember
    (``largest``), to spot a seq x seq attention matrix and the like.
    """

    def __init__(self, resident: Iterable[torch.Tensor] = (), keep_largest: int = 8):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.allocations = 0
        self.ops: Counter[str] = Counter()
        self.largest: list[Allocation] = []
        self.peak_op: str | None = None
        self._keep = keep_largest
        self._sizes: dict[int, int] = {}
        self._resident: set[int] = set()
        for t in resident:
            self.add_resident(t)

    # -- registration -------------------------------------------------
    def add_resident(self, obj) -> None:
        """Register a tensor, or every parameter and buffer of a module."""
        if isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                self.add_resident(t)
            return
        if isinstance(obj, torch.Tensor):
            key = storage_key(obj)
            if key not in self._resident:
                self._resident.add(key)
                # If a resident storage dies during the call its address may be
                # reused by a new storage: forget it then.
                weakref.finalize(obj.untyped_storage(), self._resident.discard, key)
            return
        for t in tree_flatten(obj)[0]:
            if isinstance(t, torch.Tensor):
                self.add_resident(t)

    # -- accounting ---------------------------------------------------
    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        self.ops[name] += 1
        arg_keys = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self._sizes or key in self._resident:
                continue
            if arg_keys is None:
                arg_keys = {
                    storage_key(a)
                    for a in tree_flatten((args, kwargs))[0]
                    if isinstance(a, torch.Tensor)
                }
            if key in arg_keys:  # a view of / in-place on an argument
                continue
            n = st.nbytes()
            self._sizes[key] = n
            self.live += n
            self.allocations += 1
            weakref.finalize(st, self._free, key)
            if self.live > self.peak:
                self.peak = self.live
                self.peak_op = name
            if self._keep and (len(self.largest) < self._keep or n > self.largest[-1].nbytes):
                self.largest.append(
                    Allocation(n, name, tuple(int(s) for s in t.shape), str(t.dtype).replace("torch.", ""))
                )
                self.largest.sort(key=lambda a: -a.nbytes)
                del self.largest[self._keep :]
        return out
