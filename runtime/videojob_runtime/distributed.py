"""torch.distributed for one rank: backends, rendezvous, agreed decisions, abort.

* Backends: a CPU group runs gloo; a GPU group runs ``cpu:gloo,cuda:nccl``,
  so device tensors go over NCCL and any host tensor still has a backend
  (NCCL alone rejects CPU tensors: a CPU flag all-reduced on an NCCL group
  fails the job at its first step).
* Agreement: decisions every rank must take together (cancel at a stage
  boundary, and its level: stop, or save a checkpoint and stop) are all-reduced as tensors on the rank's own device.
* Abort: when a rank fails mid-job its peers may be blocked in a collective
  that will never complete; aborting this rank's groups makes theirs fail
  within a second (gloo: "Connection closed by peer"; NCCL: comm abort)
  instead of waiting for the group timeout. The group is then unusable and
  is torn down by its owner.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable

# Messages of collectives that failed because a peer left (gloo, NCCL, c10d).
_PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "nccl communicator was aborted",
    "process group was aborted",
    "has been aborted",
    "socket timeout",
    "ncclremoteerror",
)


def backend_for(device: str) -> str:
    """The process-group backend string for a rank on ``device``."""
    return "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"


def device_backend(device: str) -> str:
    """The single backend xfuser builds its device subgroups with."""
    return "gloo" if device == "cpu" else "nccl"


def master_store(host: str, world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store, listening on a port the kernel picks on ``host``.

    Bound here and held until the group forms: a port only probed free and bound
    later can be taken in between by any other process on a shared node (CI saw
    EADDRINUSE from exactly that)."""
    import torch.distributed as dist

    return dist.TCPStore(host, 0, world_size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_process_group(rank: int, world_size: int, addr: str, port: int, device: str,
                       timeout_s: float, store: Any = None) -> dict[str, Any]:
    """The default group and xfuser's parallel groups, every one with a bounded timeout.

    Rank 0 passes the ``master_store`` it already listens on; the others connect
    to ``addr:port``. Every rank hands its store to torch itself, so all see the
    same keys."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    # xfuser and yunchang build subgroups with the default timeout (30 min):
    # bound every group, so a lost rank fails a job instead of hanging it.
    timeout = datetime.timedelta(seconds=timeout_s)
    c10d.default_pg_timeout = timeout
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    if store is None:
        store = dist.TCPStore(addr, port, world_size, False, timeout)
    backend = backend_for(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    from xfuser.core.distributed import init_distributed_environment

    init_distributed_environment(rank=rank, world_size=world_size, local_rank=0,
                                 backend=device_backend(device))
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": backend,
            "rendezvous": f"{addr}:{port}"}


def agree(flag: bool, device: str, all_reduce: Callable | None = None) -> bool:
    """True on every rank if any rank says True. The tensor lives on ``device``."""
    import torch
    import torch.distributed as dist

    vote = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    (all_reduce or dist.all_reduce)(vote, op=dist.ReduceOp.MAX)
    return bool(vote.cpu()[0])


def agree_max(value: int, device: str, all_reduce: Callable | None = None) -> int:
    """The largest ``value`` any rank holds, on every rank (a cancel's level)."""
    import torch
    import torch.distributed as dist

    vote = torch.tensor([int(value)], dtype=torch.int32, device=device)
    (all_reduce or dist.all_reduce)(vote, op=dist.ReduceOp.MAX)
    return int(vote.cpu()[0])


def abort() -> None:
    """Abort this rank's process groups (peers blocked in a collective then fail fast)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not dist.is_initialized():
        return
    try:
        c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - fall back to destroying the groups
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - nothing more can be done from this rank
            pass


def shutdown() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def is_peer_failure(exc: BaseException) -> bool:
    """This rank's collective failed because another rank left or aborted."""
    text = str(exc).lower()
    return any(marker in text for marker in _PEER_FAILURE_MARKERS)


def agree_min(value: int, device: str, all_reduce: Callable | None = None) -> int:
    """The smallest ``value`` any rank holds, on every rank."""
    import torch
    import torch.distributed as dist

    vote = torch.tensor([int(value)], dtype=torch.int64, device=device)
    (all_reduce or dist.all_reduce)(vote, op=dist.ReduceOp.MIN)
    return int(vote.cpu()[0])
