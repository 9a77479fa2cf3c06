"""A rank's process dying while its group forms, or before the first step, through the driver.

The operator retries an attempt whose reason is lost (``outcome.LOST_REASONS``)
and fails the job for good otherwise. A rank SIGKILLed during the rendezvous
is the same lost rank as one killed a moment later in the job, so it must not
come back as ``RendezvousFailed`` (a chaos soak lost jobs that way); a
rendezvous that fails with every rank alive still does. Either way nothing of
the half-formed group is left in Ray.

The drivers run as Ray jobs on a real head (Jobs and State HTTP APIs, token
auth), as in ``test_driver.py``; the test finds the rank's process through
the State API (its ``init_distributed`` task running) and kills it itself.
"""

from __future__ import annotations

import os
import signal

import pytest

from helpers import require_module

require_module("torch")
require_module("xfuser")
require_module("ray")
require_module("aiohttp_cors", reason="Ray's Jobs API (the dashboard) needs ray[default]")

from helpers import wait_for  # noqa: E402
from test_driver import Cluster, _assert_clean, _job, _request, _submit, _wait_end  # noqa: E402
from test_driver import cluster  # noqa: E402,F401 - its Ray head, one per module
from videojob.controller.outcome import LOST_REASONS, outcome_of  # noqa: E402
from videojob.driver_protocol import records, result_of  # noqa: E402

STALL_S = 600.0  # the stalled rank would wait this long: the kill, not the stall, ends the rendezvous
START_S = 300.0  # actors (a fresh worker imports torch and xfuser on a loaded machine) and the rendezvous
ENDED_S = 180.0  # after the kill: far less than the group's 600 s start timeout


def _running(cluster: Cluster, group: str, method: str) -> dict[int, int]:
    """rank -> pid of each rank of ``group`` whose ``RankActor.<method>`` task is running."""
    ranks = {a["actor_id"]: int(a["name"].rsplit("-rank", 1)[1]) for a in cluster.client.actors(group)}
    tasks = cluster.client._list("tasks", [("name", "=", f"RankActor.{method}")])
    return {ranks[t["actor_id"]]: int(t["worker_pid"]) for t in tasks
            if t.get("state") == "RUNNING" and t.get("actor_id") in ranks and t.get("worker_pid")}


def _ended(cluster: Cluster, sid: str) -> tuple[str, dict, dict]:
    """(Ray job status, result record, error) of the driver ``sid`` once it ended."""
    job, logs = _wait_end(cluster, sid, timeout=ENDED_S)
    result = result_of(logs)
    assert result is not None, f"no result record ({job.status}):\n{logs[-4000:]}"
    assert sum(1 for r in records(logs) if r["type"] == "result") == 1, logs[-4000:]
    assert not any(r["type"] == "group" for r in records(logs)), "the group must not have been reported ready"
    return job, result, result["error"] or {}


@pytest.mark.parametrize("victim", [0, 1], ids=["rank0-in-rendezvous", "rank1-before-joining"])
def test_a_rank_killed_during_the_rendezvous_is_a_lost_rank_and_leaves_nothing(cluster, victim):
    """Rank 1 stalls before it joins; rank 0 waits in the rendezvous for it. Either one
    is SIGKILLed there: the attempt is lost (retried), not ``RendezvousFailed``."""
    stall = {"stage": "rendezvous", "rank": 1, "kind": "stall", "seconds": STALL_S}
    request = _request(f"rdv-kill-{victim}", job=_job(f"rdv-kill-{victim}", inject_fault=stall))
    group = request.group.name
    sid = _submit(cluster, request)
    pids = wait_for("both ranks in the rendezvous (init_distributed running)",
                    lambda: (p := _running(cluster, group, "init_distributed")) and len(p) == 2 and p,
                    timeout=START_S, interval=0.5)
    os.kill(pids[victim], signal.SIGKILL)
    job, result, error = _ended(cluster, sid)
    assert error.get("reason") != "RendezvousFailed", error
    assert (error.get("reason"), error.get("stage"), error.get("rank")) == ("ActorDied", "rendezvous", victim), error
    assert error["reason"] in LOST_REASONS and outcome_of(job, result).kind == "lost", error
    assert error["groupTornDown"] is True, error
    _assert_clean(cluster, group, sid=sid)


def test_a_rendezvous_that_fails_with_every_rank_alive_is_not_retried(cluster):
    """A rank's init_distributed raises (as a bad configuration would, every time): the
    reason stays ``RendezvousFailed``, which the operator does not retry."""
    fault = {"stage": "rendezvous", "rank": 1, "kind": "error"}
    request = _request("rdv-error", job=_job("rdv-error", inject_fault=fault))
    job, result, error = _ended(cluster, _submit(cluster, request))
    assert (error.get("reason"), error.get("stage")) == ("RendezvousFailed", "rendezvous"), error
    assert "injected fault" in error["message"] and outcome_of(job, result).kind == "failed", error
    _assert_clean(cluster, request.group.name)


# rank 1 in `make test`; rank 0 (the rendezvous host) in `make test-slow` (CI's 90 minutes).
@pytest.mark.parametrize("victim", [pytest.param(0, marks=pytest.mark.slow), 1], ids=["rank0", "rank1"])
def test_a_rank_dying_while_loading_the_weights_is_a_lost_rank(cluster, victim):
    """Before the first step (the load stage): the dead rank's peer waits in the next
    agreed vote; the attempt is lost, named by the rank that died."""
    fault = {"stage": "load", "rank": victim, "kind": "exit"}
    request = _request(f"load-exit-{victim}", job=_job(f"load-exit-{victim}", inject_fault=fault))
    sid = _submit(cluster, request)
    job, logs = _wait_end(cluster, sid, timeout=START_S + ENDED_S)
    result = result_of(logs)
    assert result is not None, f"no result record ({job.status}):\n{logs[-4000:]}"
    error = result["error"] or {}
    assert (error.get("reason"), error.get("rank")) == ("ActorDied", victim), error
    assert outcome_of(job, result).kind == "lost" and error["groupTornDown"] is True, error
    _assert_clean(cluster, request.group.name, sid=sid)
