"""Count collective calls, so a run that silently fell back to one rank's
plain diffusers path cannot pass for a parallel one.

xfuser's USP attention uses the functional collectives
(``_functional_collectives.all_to_all_single``; torch's ring attention
``all_gather_single``), its group coordinator plain ``torch.distributed``:
both are wrapped. Install before xfuser is imported.
"""

from __future__ import annotations

import collections
import functools

_DIST = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
         "broadcast", "reduce_scatter_tensor", "send", "recv", "isend", "irecv", "gather", "scatter")
_FUNCTIONAL = ("all_to_all_single", "all_gather_tensor", "all_gather_single", "all_reduce",
               "reduce_scatter_tensor", "permute_tensor", "broadcast")

COUNTS: collections.Counter = collections.Counter()
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    import torch.distributed._functional_collectives as ftc

    for module, names, prefix in ((dist, _DIST, "dist."), (ftc, _FUNCTIONAL, "ftc.")):
        for name in names:
            original = getattr(module, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def counted(*args, __original=original, __key=prefix + name, **kwargs):
                COUNTS[__key] += 1
                return __original(*args, **kwargs)

            setattr(module, name, counted)
    _installed = True


def snapshot() -> dict[str, int]:
    return dict(COUNTS)


def total() -> int:
    return sum(COUNTS.values())
