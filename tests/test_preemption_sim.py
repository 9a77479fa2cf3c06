"""benchmarks/preemption_sim.py: the fleet simulation of priority preemption (issue 20, point 5).

Its dry run goes through the same code as `make bench` (the real planner,
Scheduler and plan_preemptions) on a small fleet; what it reports must hold
together: every job completes under every policy, preemption shortens the
high-priority wait, and restarting from step 0 loses more than checkpointing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

SCRIPT = REPO / "benchmarks" / "preemption_sim.py"
THREE = ("no-preemption", "preempt-checkpoint", "preempt-restart")


def _sim():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import preemption_sim
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return preemption_sim


def test_dry_run_compares_the_three_policies(tmp_path):
    out = tmp_path / "sim.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                            text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(out.read_text())
    # The header every result carries (benchmarks/machine.py), and the plot beside it.
    assert len(doc["commit"]) == 40 and doc["command"].startswith("python benchmarks/preemption_sim.py")
    assert doc["dryRun"] is True and (tmp_path / "sim.png").stat().st_size > 0
    results = doc["results"]
    assert set(THREE) <= set(results)
    for policy in results.values():  # no job lost: the simulation also raises if one is
        assert policy["completed"] == policy["submitted"] == doc["jobs"]
        assert policy["highPriority"]["jobs"] + policy["lowPriority"]["jobs"] == doc["jobs"]
    base, ckpt, restart = (results[p] for p in THREE)
    assert base["preemptions"] == 0 and base["gpuSecondsLost"] == 0
    assert ckpt["preemptions"] > 0 and restart["preemptions"] > 0
    for policy in (ckpt, restart):
        assert policy["highPriority"]["waitP95Seconds"] < base["highPriority"]["waitP95Seconds"]
    assert restart["gpuSecondsLost"] > ckpt["gpuSecondsLost"] > 0
    # A victim that checkpoints when it stops throws no step away; one restarted from 0 does.
    assert ckpt["gpuSecondsLostParts"]["thrownAway"] == 0 and ckpt["gpuSecondsLostParts"]["checkpointWrites"] > 0
    assert restart["gpuSecondsLostParts"]["thrownAway"] > 0
    assert restart["gpuSecondsLostParts"].get("checkpointWrites", 0) == 0
    assert doc["comparison"]["ratios"]["gpuSecondsLost preempt-restart / preempt-checkpoint"] > 1


def test_an_over_committed_pod_stops_the_simulation(monkeypatch):
    """The invariant the simulation checks after every pass: a scheduler that puts
    every job on pod 0 whatever it holds is caught, not averaged into the results."""
    from videojob.inventory import parse_inventory

    sim = _sim()

    class OverCommitting(sim.Scheduler):
        def _place(self, ask, avoid_pod=None):
            return 0, (), None

    monkeypatch.setattr(sim, "Scheduler", OverCommitting)
    inventory = parse_inventory(sim.fleet(sim.DRY_PODS))
    classes = {c.name: (c.gpus_per_pod, c.max_pods) for c in inventory.classes}
    shape = ("wan2.1-t2v-14b", 1280, 720, 81, 50)  # 8 GPUs: two of them overfill one pod
    jobs = [sim.Job(i, 0.0, shape, sim.LOW) for i in range(2)]
    with pytest.raises(RuntimeError, match=r"pod h100-80/0 holds 16 GPUs \(has 8"):
        sim.simulate("no-preemption", jobs, sim.Planner(inventory), classes)
