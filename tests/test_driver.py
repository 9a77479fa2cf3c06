"""The per-attempt driver (``python -m videojob_runtime.driver``) as the
operator runs it: a Ray job submitted through the Jobs HTTP API of a real Ray
head (started here as its own process, dashboard on, token auth), read back
through its logs, stopped with ``POST /api/jobs/{id}/stop``, and checked with
the State API for anything left in Ray. The client is the operator's own
(``HttpRayClient``).

One head for the module (2 CPUs; each rank asks 0.5); tiny random-weight
CogVideoX, 64x64, 9 frames, Ulysses 2 over gloo.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("torch")
require_module("xfuser")
require_module("ray")
require_module("aiohttp_cors", reason="Ray's Jobs API (the dashboard) needs ray[default]")

from helpers import REPO, RayHead, wait_for  # noqa: E402
from videojob.driver_protocol import (  # noqa: E402
    PROTOCOL,
    DriverRequest,
    GroupRequest,
    last_progress,
    records,
    result_of,
    submission_id,
    teardown_entrypoint,
)
from videojob.raycluster.client import HttpRayClient, RayAuthError, RayJob  # noqa: E402
from videojob_runtime.output import probe_mp4  # noqa: E402
from videojob_runtime.request import JobRequest  # noqa: E402

PY = sys.executable
NAMESPACE = "team-a"


@dataclasses.dataclass
class Cluster:
    head: RayHead
    client: HttpRayClient
    outputs: Path
    root: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("driver")
    outputs, models = root / "outputs", root / "models"
    outputs.mkdir()
    models.mkdir()
    # The head's environment reaches its job supervisors, so the drivers, and its actors.
    env = {"VIDEOJOB_OUTPUT_ROOT": str(outputs), "VIDEOJOB_MODEL_ROOT": str(models), "OMP_NUM_THREADS": "1"}
    with RayHead(num_cpus=2, dashboard=True, env=env) as head:
        yield Cluster(head, HttpRayClient(head.dashboard_url, token=head.token), outputs, root)


# -- requests ------------------------------------------------------------------------


def _job(name: str, **overrides) -> dict:
    fields = dict(job_id=name, model_id="tiny-cogvideox", task="t2v", prompt="a tiny test video", width=64,
                  height=64, frames=9, fps=8, steps=3, guidance=6.0, seed=7, dtype="float32", output_name=name)
    job = JobRequest(**{**fields, **overrides})
    data = dataclasses.asdict(job)
    del data["output_dir"]
    return data


def _request(name: str, group: str | None = None, keep: bool = False, cpus_per_rank: float = 0.5,
             job: dict | None = None, ulysses: int = 2, **fields) -> DriverRequest:
    uid = str(uuid.uuid4())
    return DriverRequest(
        namespace=NAMESPACE, name=name, uid=uid,
        group=GroupRequest(name=group or f"vj-{uid}", ulysses=ulysses, cpus_per_rank=cpus_per_rank, keep=keep),
        job=job or _job(name), output_uri=fields.pop("output_uri", f"local://videos/{name}"),
        progress_interval_s=0.5, **fields)


def _submit(cluster: Cluster, request: DriverRequest) -> str:
    sid = submission_id(request.namespace, request.name, request.uid, request.attempt)
    assert cluster.client.submit(sid, request.entrypoint(PY), metadata={"videojob": request.name}) is True
    return sid


def _wait_end(cluster: Cluster, sid: str, timeout: float) -> tuple[RayJob, str]:
    job = wait_for(f"Ray job {sid} to end", lambda: (j := cluster.client.job(sid)) is not None and j.terminal and j,
                   timeout=timeout, interval=0.5)
    return job, cluster.client.logs(sid)


def _run(cluster: Cluster, request: DriverRequest, timeout: float = 240) -> tuple[RayJob, str, dict]:
    job, logs = _wait_end(cluster, _submit(cluster, request), timeout)
    result = result_of(logs)
    assert result is not None, f"no result record in the driver's logs ({job.status}):\n{logs[-4000:]}"
    assert sum(1 for r in records(logs) if r["type"] == "result") == 1, logs[-4000:]
    return job, logs, result


def _left(cluster: Cluster, prefix: str) -> dict[str, list]:
    """Actors (any state but DEAD) and placement groups (any state but REMOVED) named ``prefix``*."""
    actors = [f"{a['name']}:{a['state']}" for a in cluster.client.actors(prefix, alive_only=False)
              if a.get("state") != "DEAD"]
    pgs = [f"{p['name']}:{p['state']}" for p in cluster.client.placement_groups(prefix)]
    return {"actors": actors, "placement_groups": pgs}


def _assert_clean(cluster: Cluster, prefix: str, timeout: float = 30, sid: str | None = None) -> None:
    try:
        wait_for(f"no actor or placement group named {prefix}* in Ray",
                 lambda: not any(_left(cluster, prefix).values()) or None, timeout=timeout)
    except TimeoutError as exc:
        logs = cluster.client.logs(sid)[-3000:] if sid else ""
        raise AssertionError(f"{exc}; left: {_left(cluster, prefix)}\n{logs}") from None


# -- without Ray ------------------------------------------------------------------------


def _driver(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "videojob_runtime.driver", *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1", **(env or {})})


def test_a_request_that_does_not_decode_is_a_result_record_not_a_traceback():
    done = _driver("--request", "bm90IGpzb24=")
    assert done.returncode == 1, done.stderr
    result = result_of(done.stdout)
    assert result["ok"] is False and result["error"]["reason"] == "BadRequest", done.stdout
    assert "Traceback" not in done.stderr


def test_the_progress_printer_prints_changes_at_most_every_interval(capsys):
    from videojob_runtime.driver import ProgressPrinter

    printer = ProgressPrinter(interval_s=0.3, job_id="j")
    base = {"job_id": "j", "steps": 4, "percent": 0}
    printer({**base, "job_id": "the-last-job", "step": 4, "stage": "", "state": "done"})  # a warm rank's last job
    for step in (0, 1, 1, 2):
        printer({**base, "step": step, "stage": "denoise", "state": "running"})
    time.sleep(0.35)
    printer({**base, "step": 2, "stage": "denoise", "state": "running"})  # held back before: printed now
    printer({**base, "step": 2, "stage": "denoise", "state": "running"})
    printed = [r for r in records(capsys.readouterr().out)]
    assert [(r["step"], r["job_id"]) for r in printed] == [(0, "j"), (2, "j")]
    assert set(printed[0]) == {"type", "protocol", "step", "steps", "percent", "stage", "state", "job_id"}
    assert printed[0]["protocol"] == PROTOCOL


# -- through the Jobs API -----------------------------------------------------------------


def test_the_stop_budget_follows_rays_stop_wait(monkeypatch):
    """The stopper tears down within Ray's SIGTERM-to-SIGKILL wait, which the driver
    inherits from its job supervisor (the chart sets 10 s; Ray's default is 3 s)."""
    from videojob_runtime.stopping import stop_budget_s

    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "10")
    assert stop_budget_s() == 9.0
    monkeypatch.delenv("RAY_JOB_STOP_WAIT_TIME_S")
    assert stop_budget_s() == 2.0
    monkeypatch.setenv("RAY_JOB_STOP_WAIT_TIME_S", "soon")
    assert stop_budget_s() == 2.0


def test_the_jobs_api_refuses_a_wrong_token(cluster):
    assert cluster.client.version()["ray_version"]
    with pytest.raises(RayAuthError):
        HttpRayClient(cluster.head.dashboard_url, token="not-the-token", retries=0).version()
    assert cluster.client.job("vj-never-submitted") is None and cluster.client.logs("vj-never-submitted") == ""


def test_a_job_runs_to_succeeded_and_leaves_nothing_in_ray(cluster):
    request = _request("plain")
    job, logs, result = _run(cluster, request)
    assert job.status == "SUCCEEDED", logs[-4000:]
    progress = [r for r in records(logs) if r["type"] == "progress"]
    assert any(p["stage"] not in ("start", "") for p in progress), f"no progress from the ranks: {progress}"
    assert all(p["job_id"] == "plain" and p["steps"] == 3 for p in progress)
    assert result["ok"] is True and result["error"] is None, result
    assert result["groupName"] == request.group.name and result["groupReused"] is False
    assert result["reused"] is False and result["loads"] == 1 and result["seed"] == 7
    assert len(result["collectivesPerRank"]) == 2 and result["framesDigest"]
    assert result["measured"]["peakGiB"] > 0 and result["measured"]["denoiseSeconds"] > 0
    video = Path(result["output"]["video"])
    assert result["output"]["uri"] == "local://videos/plain"
    assert video == (cluster.outputs / NAMESPACE / "videos" / "plain" / "plain.mp4").resolve() and video.is_file()
    probe = probe_mp4(video)
    assert (probe["frames"], probe["width"], probe["height"]) == (9, 64, 64), probe
    assert json.loads(Path(result["output"]["result"]).read_text())["framesDigest"] == result["framesDigest"]
    _assert_clean(cluster, request.group.name)


def test_rays_tables_keep_no_request_once_the_job_is_deleted(cluster):
    """Ray's GCS keeps each driver's command line for the cluster's life, past the
    Jobs API record the operator deletes: the driver runs itself again with the
    request (prompts in it) in its environment, so that line names no request."""
    request = _request("private", ulysses=1, job=_job("private", prompt="a secret prompt, word 5d1f"))
    encoded = request.encode()
    sid = _submit(cluster, request)
    job, logs = _wait_end(cluster, sid, timeout=240)
    assert job.status == "SUCCEEDED" and result_of(logs)["ok"], logs[-4000:]

    def deleted() -> bool:  # Ray writes a record back when it is deleted before its supervisor exits
        cluster.client.delete(sid)
        return cluster.client.job(sid) is None
    wait_for(f"Ray job {sid} to stay deleted", deleted, timeout=60, interval=2)
    # The GCS's own job table (no HTTP API lists a deleted submission's driver): read by a
    # separate Ray driver process, so this test process stays off the cluster.
    read = ("import json, ray; ray.init(address=%r, log_to_driver=False); "
            "print(json.dumps([j['Entrypoint'] for j in ray._private.state.jobs()]))" % cluster.head.address)
    done = subprocess.run([PY, "-c", read], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **cluster.head.env})
    assert done.returncode == 0, done.stderr[-3000:]
    entrypoints = json.loads(done.stdout.strip().splitlines()[-1])
    drivers = [e for e in entrypoints if "videojob_runtime.driver" in e]
    assert drivers, f"the GCS holds no driver of this module: {entrypoints}"
    text = json.dumps(entrypoints)
    assert encoded not in text and "5d1f" not in text, f"Ray's GCS keeps the request: {text[:2000]}"
    assert any("--request-env" in e for e in drivers), drivers


def test_a_short_placement_timeout_does_not_cut_short_the_ranks_start(cluster):
    """The placement timeout bounds finding room, not the ranks' start: with 1 s (room is
    there at once) the rank actors still get VIDEOJOB_GROUP_START_TIMEOUT_S to import
    torch, diffusers and xfuser and meet (found on the chart's e2e install, where a
    placement timeout shorter than a scale-up also failed every fresh worker's actors)."""
    request = _request("quickroom", placement_timeout_s=1)
    job, logs, result = _run(cluster, request)
    assert job.status == "SUCCEEDED", f"{result.get('error')}\n{logs[-3000:]}"
    _assert_clean(cluster, request.group.name)


def test_a_newer_operators_request_runs_on_this_driver_ignoring_what_it_does_not_know(cluster):
    """Protocol: a request with optional fields from a newer operator (top level, group,
    job) runs to the end; the result lists what was ignored and the protocol spoken."""
    import base64

    request = _request("newer", ulysses=1)
    data = json.loads(base64.urlsafe_b64decode(request.encode()))
    data.update(minor=7, operator_hint="x")
    data["group"]["topology"] = "nvlink"
    data["job"]["film_grain"] = 0.2
    encoded = base64.urlsafe_b64encode(json.dumps(data).encode()).decode()
    sid = submission_id(request.namespace, request.name, request.uid, request.attempt)
    assert cluster.client.submit(sid, f"{PY} -m videojob_runtime.driver --request {encoded}", metadata={}) is True
    job, logs = _wait_end(cluster, sid, timeout=240)
    result = result_of(logs)
    assert job.status == "SUCCEEDED" and result["ok"], logs[-4000:]
    assert sorted(result["ignored"]) == ["group.topology", "job.film_grain", "minor", "operator_hint"], result
    assert {r["protocol"] for r in records(logs)} == {PROTOCOL}
    _assert_clean(cluster, request.group.name)


def test_a_kept_group_is_reused_by_the_next_job_then_torn_down_by_name(cluster):
    group = f"vj-{uuid.uuid4()}"
    job, logs, first = _run(cluster, _request("warm-a", group=group, keep=True))
    assert job.status == "SUCCEEDED" and first["ok"], logs[-4000:]
    assert first["groupReused"] is False and first["groupKept"] is True and first["loads"] == 1
    left = _left(cluster, group)
    assert len(left["actors"]) == 2 and len(left["placement_groups"]) == 1, left

    job, logs, second = _run(cluster, _request("warm-b", group=group, keep=True))
    assert job.status == "SUCCEEDED" and second["ok"], logs[-4000:]
    assert second["groupReused"] is True and second["reused"] is True
    assert second["loads"] == first["loads"], "a warm group must not load the weights again"
    assert [r["reused"] for r in records(logs) if r["type"] == "group"] == [True]

    # Same name, another layout: what is there cannot run it, so it is replaced.
    job, logs, third = _run(cluster, _request("warm-c", group=group, keep=True, ulysses=1))
    assert job.status == "SUCCEEDED" and third["ok"], logs[-4000:]
    assert third["groupReused"] is False and third["loads"] == 1 and len(third["collectivesPerRank"]) == 1
    left = _left(cluster, group)
    assert [a.split(":")[0] for a in left["actors"]] == [f"{group}-rank0"], left
    # The operator's teardown wait sees it, asking Ray for this group's rows only.
    asked = _present_asking(cluster.client, group)
    assert asked[0] is True and all(filters for _, filters in asked[1]), asked

    sid = f"vj-teardown-{uuid.uuid4().hex[:8]}"
    assert cluster.client.submit(sid, teardown_entrypoint(group, world=2, python=PY))
    job, logs = _wait_end(cluster, sid, timeout=90)
    result = result_of(logs)
    assert job.status == "SUCCEEDED" and result and result["ok"], logs[-4000:]
    assert result["removed"]["actors"] == [f"{group}-rank0"] and result["removed"]["placementGroup"] is True
    # What the operator reads of a running driver: the log's last lines, from Ray's log
    # agent (not the whole log by the Jobs API, which log_tail falls back to: refused here).
    # It names the file, not the submission id (which Ray resolves by reading every job's record).
    cluster.client.logs = None
    asked_for: list[dict] = []
    real_request = cluster.client._request
    cluster.client._request = lambda method, path, **kw: (asked_for.append(kw.get("query") or {}),
                                                          real_request(method, path, **kw))[1]
    try:
        assert cluster.client.log_tail(sid, 2, job.driver_node_id).splitlines() == logs.splitlines()[-2:], \
            logs[-2000:]
    finally:
        del cluster.client.logs, cluster.client._request
    assert asked_for and asked_for[0].get("filename") == f"job-driver-{sid}.log" and "submission_id" not in asked_for[0]
    assert cluster.client.log_tail(f"vj-never-{uuid.uuid4().hex[:8]}", 2, job.driver_node_id) == ""
    _assert_clean(cluster, group)
    gone = _present_asking(cluster.client, group)
    assert gone[0] is False and all(filters for _, filters in gone[1]), gone
    never = _present_asking(cluster.client, f"vj-{uuid.uuid4()}")
    assert never[0] is False and all(filters for _, filters in never[1]), never


def _present_asking(client: HttpRayClient, group: str) -> tuple[bool, list[tuple[str, list]]]:
    """``present(client, group)`` and the State API listings it made: (kind, filters)."""
    from videojob.controller.groups import present

    asked, listing = [], client._list

    def recording(kind, filters):
        asked.append((kind, [f for f in filters if f[0] != "state"]))
        return listing(kind, filters)

    client._list = recording
    try:
        return present(client, group), asked
    finally:
        del client._list


def test_stop_mid_run_cancels_and_tears_the_group_down_within_seconds(cluster):
    request = _request("stopped", job=_job("stopped", steps=1000))  # ~17 s of denoise on an idle machine
    sid = _submit(cluster, request)
    wait_for("a progress record with step >= 1",
             lambda: ((p := last_progress(cluster.client.logs(sid))) and p["step"] >= 1) or None, timeout=180)
    stopped_at = time.monotonic()
    assert cluster.client.stop(sid)
    # the driver has RAY_JOB_STOP_WAIT_TIME_S (10 s, as the chart sets it) to tear down and exit
    job = wait_for(f"Ray job {sid} to be STOPPED", lambda: (j := cluster.client.job(sid)).terminal and j,
                   timeout=15, interval=0.1)
    assert job.status == "STOPPED", job
    _assert_clean(cluster, request.group.name, timeout=max(1.0, 20 - (time.monotonic() - stopped_at)))
    logs = cluster.client.logs(sid)
    last = list(records(logs))[-1]
    assert last["type"] == "result", f"the last record is not the result: {last}\n{logs[-3000:]}"
    assert last["ok"] is False and last["error"]["reason"] == "Cancelled", last
    assert last["error"]["stage"] == "denoise" and last["error"]["groupTornDown"] is True, last
    assert "SIGTERM" in last["error"]["message"] and last["stopSeconds"] < 3, last
    assert last["removed"]["gone"] is True and len(last["removed"]["actors"]) == 2, last
    assert not (cluster.outputs / NAMESPACE / "videos" / "stopped" / "stopped.mp4").exists()


def test_stop_while_the_group_is_still_starting_removes_what_was_made(cluster):
    # Waiting for a placement no node can give: ActorGroup.start is blocked on it.
    request = _request("pending", cpus_per_rank=64, placement_timeout_s=120)
    sid = _submit(cluster, request)
    wait_for("the group's placement group, pending",
             lambda: cluster.client.placement_groups(request.group.name) or None, timeout=60)
    stopped_at = time.monotonic()
    assert cluster.client.stop(sid)
    # the driver has RAY_JOB_STOP_WAIT_TIME_S (10 s, as the chart sets it) to tear down and exit
    job = wait_for(f"Ray job {sid} to be STOPPED", lambda: (j := cluster.client.job(sid)).terminal and j,
                   timeout=15, interval=0.1)
    assert job.status == "STOPPED", job
    _assert_clean(cluster, request.group.name, timeout=max(1.0, 20 - (time.monotonic() - stopped_at)), sid=sid)
    result = result_of(cluster.client.logs(sid))
    assert result["error"]["reason"] == "Cancelled" and result["error"]["stage"] == "start", result
    assert result["removed"]["placementGroup"] is True


def test_an_output_uri_that_escapes_through_a_link_fails_naming_the_field(cluster, tmp_path):
    outside = cluster.root / "outside"
    outside.mkdir(exist_ok=True)
    (cluster.outputs / NAMESPACE).mkdir(parents=True, exist_ok=True)
    (cluster.outputs / NAMESPACE / "escape").symlink_to(outside)
    request = _request("escapes", output_uri="local://escape/videos")
    job, logs, result = _run(cluster, request, timeout=60)
    assert job.status == "FAILED", logs[-3000:]
    assert result["ok"] is False and result["error"]["field"] == "spec.output.uri", result
    assert "spec.output.uri" in result["error"]["message"]
    assert not any(r["type"] == "group" for r in records(logs)), "nothing may start for a refused output"
    assert not list(outside.iterdir())
    _assert_clean(cluster, request.group.name, timeout=5)


def test_a_missing_model_source_fails_naming_the_field_and_leaves_nothing(cluster):
    request = _request("nosource", job=_job("nosource", model_id="cogvideox-2b", source="local://nowhere"))
    job, logs, result = _run(cluster, request)
    assert job.status == "FAILED", logs[-3000:]
    error = result["error"]
    assert error["reason"] == "ModelSourceMissing" and "spec.model.source" in error["message"], error
    assert error["stage"] == "load"
    _assert_clean(cluster, request.group.name)


def test_no_placement_fails_with_the_reason_and_leaves_nothing(cluster):
    request = _request("noroom", cpus_per_rank=64, placement_timeout_s=3)
    job, logs, result = _run(cluster, request, timeout=90)
    assert job.status == "FAILED", logs[-3000:]
    assert result["error"]["reason"] == "NoPlacement" and result["error"]["stage"] == "placement", result
    # No autoscaler here: nothing ever launches, so the wait is the plain timeout, and the driver said so.
    assert "within 3s" in result["error"]["message"] and "no autoscaler" in result["error"]["message"], result
    waits = [r for r in records(logs) if r["type"] == "progress" and r["stage"] == "placement"]
    assert waits and {w["state"] for w in waits} == {"waiting-for-room"}, waits
    assert "nothing is launching" in waits[0]["message"], waits[0]
    _assert_clean(cluster, request.group.name)
