"""Faults at every step of a group's life, and what is left afterwards.

Start (placement, actor creation, rendezvous), run (load, inputs, a step,
decode, write; one rank or all; an error, an out-of-memory, a dead process),
cancel (before the job, during load), and a second job while one runs. After
each: the error names the rank and the stage, surviving ranks return within
seconds (not the 300 s group timeout), and Ray holds no placement group or
actor of the group unless the group is still consistent and kept.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("torch")
require_module("xfuser")
ray = require_module("ray")

from helpers import ray_census, wait_for, wait_until_clean  # noqa: E402
from videojob_runtime.group import ActorGroup, GroupSpec, GroupStartError  # noqa: E402
from videojob_runtime.worker import JobRequest, RankWorker  # noqa: E402

SURVIVORS_WITHIN_S = 10.0


def _request(**overrides) -> JobRequest:
    base = dict(job_id="f", model_id="tiny-cogvideox", task="t2v", prompt="a tiny fault video", width=64,
                height=64, frames=9, fps=8, steps=3, guidance=6.0, seed=7, frames_dtype="float32",
                track_memory=False)
    return JobRequest(**{**base, **overrides})


def _start(name: str, **spec) -> ActorGroup:
    return ActorGroup.start(GroupSpec(name, ulysses=2, **spec), timeout_s=60, cpus_per_rank=0.5)


@contextlib.contextmanager
def _group(name: str):
    """A two-rank group for one test: torn down afterwards, and Ray checked empty of it."""
    group = _start(name)
    try:
        yield group
    finally:
        group.teardown()
    wait_until_clean(name)


# -- start ---------------------------------------------------------------------

@pytest.mark.parametrize("fault,reason,stage", [
    ({"inject_start_fault": (1,)}, "ActorStartFailed", "actors"),
    ({"inject_start_fault": (0, 1)}, "ActorStartFailed", "actors"),
    ({"inject_rendezvous_fault": (1,)}, "RendezvousFailed", "rendezvous"),
], ids=["actor-1", "actor-all", "rendezvous-1"])
def test_a_failed_start_leaves_nothing(ray_session, fault, reason, stage):
    name = f"vj-fault-start-{reason.lower()}-{len(fault[next(iter(fault))])}"
    with pytest.raises(GroupStartError) as info:
        _start(name, **fault)
    assert info.value.reason == reason and info.value.stage == stage
    assert "injected fault" in info.value.message
    wait_until_clean(name)


@pytest.mark.parametrize("fault,stage,rank", [
    ({"inject_start_exit": (1,)}, "actors", 1),
    ({"rendezvous_fault": {"stage": "rendezvous", "rank": 0, "kind": "exit"}}, "rendezvous", 0),
    ({"rendezvous_fault": {"stage": "rendezvous", "rank": 1, "kind": "exit"}}, "rendezvous", 1),
], ids=["actors-rank1", "rendezvous-rank0", "rendezvous-rank1"])
def test_a_rank_process_dying_while_the_group_forms_is_a_lost_rank(ray_session, fault, stage, rank):
    """A dead process is ActorDied (the operator retries it), not the stage's own
    reason, which says the start would fail again."""
    name = f"vj-fault-died-{stage}-{rank}"
    with pytest.raises(GroupStartError) as info:
        _start(name, **fault)
    error = info.value.to_dict()
    assert (error["reason"], error["stage"], error.get("rank")) == ("ActorDied", stage, rank), error
    assert "died" in error["message"], error
    wait_until_clean(name)


# Slow (CI time): `make test` covers the rendezvous failing with
# test_a_rank_process_dying_while_the_group_forms_is_a_lost_rank.
@pytest.mark.slow
def test_a_rendezvous_timing_out_with_every_rank_alive_is_not_a_lost_rank(ray_session):
    """Rank 1 never joins but stays alive: RendezvousFailed, which would repeat."""
    name = "vj-fault-rendezvous-timeout"
    stall = {"stage": "rendezvous", "rank": 1, "kind": "stall", "seconds": 600.0}
    with pytest.raises(GroupStartError) as info:
        ActorGroup.start(GroupSpec(name, ulysses=2, rendezvous_fault=stall), timeout_s=60, cpus_per_rank=0.5,
                         start_timeout_s=60)
    assert (info.value.reason, info.value.stage) == ("RendezvousFailed", "rendezvous"), info.value.message
    assert "rank" not in info.value.to_dict()
    wait_until_clean(name)


def test_a_store_port_taken_meanwhile_is_a_retried_start_failure():
    """Rank 0 finds a free port, then listens on it for the group's store; another
    process may take it in between (the chaos soak saw EADDRINUSE). torch's real
    error for that is a start failure the operator retries, not RendezvousFailed."""
    import socket

    import torch.distributed as dist

    from videojob.controller.outcome import LOST_REASONS
    from videojob_runtime.group import start_failure_reason

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(Exception) as raised:
            dist.TCPStore("127.0.0.1", port, 1, True, timeout=__import__("datetime").timedelta(seconds=5))
    problem = f"rendezvous failed: {type(raised.value).__name__}: {raised.value}"
    reason = start_failure_reason("RendezvousFailed", problem)
    assert reason == "GroupStartFailed" and reason in LOST_REASONS, problem
    assert start_failure_reason("RendezvousFailed", "rendezvous did not finish within 60s") == "RendezvousFailed"


def test_no_placement_within_the_timeout_leaves_nothing(ray_session):
    name = "vj-fault-placement"
    start = time.monotonic()
    with pytest.raises(GroupStartError) as info:
        ActorGroup.start(GroupSpec(name, ulysses=2), timeout_s=2, cpus_per_rank=64)
    assert info.value.reason == "NoPlacement" and info.value.stage == "placement"
    assert "STRICT_PACK" in info.value.message and time.monotonic() - start < 30
    wait_until_clean(name)


# -- run -----------------------------------------------------------------------

_RUN_FAULTS = [
    ({"stage": "load", "rank": 1}, "Failed", "load", 1),
    ({"stage": "inputs", "rank": 0}, "Failed", "inputs", 0),
    ({"stage": "denoise", "rank": 1, "step": 2}, "Failed", "denoise", 1),
    ({"stage": "denoise", "rank": 0, "step": 1, "kind": "oom"}, "OutOfMemory", "denoise", 0),
    ({"stage": "decode", "rank": 1, "kind": "oom"}, "OutOfMemory", "decode", 1),
    ({"stage": "denoise", "rank": 1, "step": 2, "kind": "exit"}, "ActorDied", "denoise", 1),
]
# One fault of each outcome (Failed, OutOfMemory, ActorDied) in `make test`; the other
# stages and ranks in `make test-slow` (in `make bench`; CI's 90 minutes).
_SLOW_RUN_FAULTS = {"inputs-error-rank0", "denoise-error-rank1", "decode-oom-rank1"}


def _fault_id(fault: dict) -> str:
    return f"{fault['stage']}-{fault.get('kind', 'error')}-rank{fault['rank']}"


FAULTS = [pytest.param(*case, id=_fault_id(case[0]),
                       marks=[pytest.mark.slow] if _fault_id(case[0]) in _SLOW_RUN_FAULTS else [])
          for case in _RUN_FAULTS]


@pytest.mark.parametrize("fault,reason,stage,rank", FAULTS)
def test_one_rank_failing_stops_the_others_and_tears_the_group_down(ray_session, fault, reason, stage, rank):
    with _group(f"vj-fault-run-{fault['stage']}-{fault.get('kind', 'error')}") as group:
        assert group.run(_request(job_id="warm-up"), timeout_s=120)["ok"]
        result = group.run(_request(job_id="faulty", inject_fault=fault), timeout_s=120)
        returned = time.time()
    assert not result["ok"]
    error = result["error"]
    assert (error["reason"], error["rank"]) == (reason, rank), error
    if reason != "ActorDied":
        assert error["stage"] == stage, error
        waited = returned - error["time"]
        assert waited < SURVIVORS_WITHIN_S, f"the others returned {waited:.1f}s after the failure"
    assert f"rank {rank} failed" in error["summary"]
    assert error["groupTornDown"] is True
    other = [r for r in result["ranks"] if r["rank"] != rank]
    assert all(not r["ok"] for r in other), "the other rank must not report success"


def test_all_ranks_oom_is_structured_with_the_measured_peak(ray_session):
    """The operator's re-plan hook: every rank out of memory in decode."""
    with _group("vj-fault-oom-all") as group:
        result = group.run(_request(job_id="oom", inject_oom="decode", track_memory=True), timeout_s=120)
    error = result["error"]
    assert error["reason"] == "OutOfMemory" and error["stage"] == "decode"
    assert error["peak_bytes"] > 0 and "out of memory" in error["message"]


def test_a_job_timeout_cancels_and_keeps_a_consistent_group(ray_session):
    with _group("vj-fault-timeout") as group:
        result = group.run(_request(job_id="slow", steps=400), timeout_s=3)
        assert result["error"]["reason"] == "Timeout" and result["error"]["groupTornDown"] is False
        assert group.run(_request(job_id="after-timeout"), timeout_s=120)["ok"]


# -- cancel --------------------------------------------------------------------

def test_cancel_before_the_job_starts_stops_it(ray_session):
    with _group("vj-fault-cancel-early") as group:
        group.cancel("early")  # the job is not running yet: the token waits for it
        result = group.run(_request(job_id="early"), timeout_s=120)
        assert result["error"]["reason"] == "Cancelled" and result["error"]["stage"] == "load"
        assert result["error"]["groupTornDown"] is False
        assert group.run(_request(job_id="next"), timeout_s=120)["ok"], "a cancel must not leak into the next job"


def test_cancel_during_load_stops_after_load(ray_session):
    with _group("vj-fault-cancel-load") as group:
        stall = {"stage": "load", "kind": "stall", "seconds": 3.0}
        refs = [a.run.remote(_request(job_id="slow-load", inject_fault=stall).to_dict()) for a in group.actors]
        wait_for("the job to be loading", lambda: (p := group.progress())["job_id"] == "slow-load"
                 and p["state"] == "loading", timeout=60)
        group.cancel("slow-load")
        results = ray.get(refs, timeout=60)
    assert all(r["error"]["reason"] == "Cancelled" and r["error"]["stage"] == "inputs" for r in results)
    assert "after load" in results[0]["error"]["message"]


def test_a_cancel_for_another_job_changes_nothing():
    worker = RankWorker(0, 1)
    worker.cancel("someone-else")
    assert worker.run(_request(job_id="mine"))["ok"]
    assert worker.cancel(None) is None, "nothing running: nothing to cancel"


# -- one job at a time, all-or-nothing warm state --------------------------------

def test_a_second_run_while_one_runs_is_refused_busy():
    worker = RankWorker(0, 1)
    results = {}
    thread = threading.Thread(target=lambda: results.update(first=worker.run(
        _request(job_id="first", inject_fault={"stage": "inputs", "kind": "stall", "seconds": 2.0}))))
    thread.start()
    wait_for("the first job to start", lambda: worker.progress.job_id == "first", timeout=30)
    second = worker.run(_request(job_id="second"))
    thread.join(60)
    assert second["error"]["reason"] == "Busy" and second["consistent"] is True
    assert results["first"]["ok"], "the running job is unaffected"


@pytest.mark.parametrize("bad", [
    {"model_id": "cogvideox-2b", "source": "local://nowhere"},          # fails building the pipeline
    {"model_id": "tiny-consisid", "task": "identity", "cache": "dbcache"},  # fails applying a strategy
], ids=["build", "strategy"])
def test_a_failed_load_leaves_the_worker_empty(bad):
    worker = RankWorker(0, 1)
    assert worker.run(_request(job_id="good"))["ok"] and worker.health()["loaded"]
    failed = worker.run(_request(job_id="bad", **bad))
    assert not failed["ok"] and failed["error"]["stage"] == "load"
    assert worker.pipe is None and worker.pipe_key is None and not worker.health()["loaded"]
    again = worker.run(_request(job_id="good-again"))
    assert again["ok"] and again["reused"] is False, "never reported as reused after a failed load"


# -- collectives on the rank's device (what only a GPU runs, checked on a CPU) -----

class _Seen(Exception):
    pass


def test_the_cancel_vote_is_a_tensor_on_the_ranks_device():
    from videojob_runtime import distributed

    seen = []

    def all_reduce(tensor, op=None):
        seen.append(tensor.device.type)
        raise _Seen

    for device in ("meta", "cpu"):
        with pytest.raises(_Seen):
            distributed.agree(True, device, all_reduce=all_reduce)
    assert seen == ["meta", "cpu"]


def test_gpu_groups_carry_both_backends():
    from videojob_runtime import distributed

    assert distributed.backend_for("cuda") == "cpu:gloo,cuda:nccl"
    assert distributed.backend_for("cpu") == "gloo"
    assert distributed.device_backend("cuda") == "nccl"


def test_teacache_reduces_its_statistic_on_the_hidden_states_device(monkeypatch):
    import torch
    import torch.distributed as dist

    from videojob_runtime.teacache import TeaCacheConfig, apply_teacache

    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device.type)
        raise _Seen

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    handle = apply_teacache(torch.nn.Linear(2, 2), TeaCacheConfig(threshold=0.5))
    with pytest.raises(_Seen):
        handle._change(torch.ones(2, device="meta"), torch.zeros(2, device="meta"))
    assert seen == ["meta"]


def test_peer_failures_are_recognised():
    from videojob_runtime import distributed

    assert distributed.is_peer_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert distributed.is_peer_failure(RuntimeError("NCCL communicator was aborted on rank 1"))
    assert not distributed.is_peer_failure(RuntimeError("CUDA out of memory"))


def test_nothing_is_left_by_this_module(ray_session):
    assert ray_census("vj-fault") == {"placement_groups": [], "actors": []}
