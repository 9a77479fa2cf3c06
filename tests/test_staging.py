"""https inputs staged on the shared volume (``videojob_runtime.staging``).

In a cluster the driver runs on one pod and the ranks on others: the inputs
it fetches go under VIDEOJOB_INPUT_STAGING_ROOT (the chart: the data volume's
``staging``), one directory per attempt, removed when the attempt ends, on
success, failure and a stop (SIGTERM) alike; what a killed driver left is
removed by the next one once its heartbeat is stale; and a rank that cannot
see a staged file says which setting is wrong.

The driver runs for real here: a Ray head of this module (Jobs API, token),
the tiny i2v model, its image served over https by a local server under a
test CA (tests/test_containment.py's ``https_server``). An image URL with a
query (a presigned URL) is submitted as the operator submits it, the request in
the runtime_env: the query reaches the server but not the Ray job's entrypoint,
the driver's log or the rank's environment (issue 21).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

from helpers import RayHead, wait_for
from test_containment import https_server  # noqa: F401 - the https server fixture (and its CA)
from videojob.driver_protocol import REQUEST_ENV, DriverRequest, GroupRequest, records, result_of, submission_id
from videojob_runtime.errors import JobFailure
from videojob_runtime.staging import ALIVE, PREFIX, StagingDir, sweep_stale

PY = sys.executable


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(PREFIX)) if root.exists() else []


# -- per-attempt directories ---------------------------------------------------------


def test_each_attempt_gets_its_own_directory_removed_however_it_ends(tmp_path):
    root = tmp_path / "staging"
    with StagingDir(root, "team-a-job-1a2b3c4d-a1", 900) as first, \
            StagingDir(root, "team-a-job-1a2b3c4d-a1", 900) as again, \
            StagingDir(root, "team-a-job-1a2b3c4d-a2", 900) as second:
        assert len({first, again, second}) == 3, "two drivers of one attempt, or two attempts, shared a directory"
        assert first.name.startswith(f"{PREFIX}team-a-job-1a2b3c4d-a1-")
        assert second.name.startswith(f"{PREFIX}team-a-job-1a2b3c4d-a2-")
        assert all(d.parent == root and (d / ALIVE).is_file() for d in (first, again, second))
    assert _dirs(root) == []
    with pytest.raises(RuntimeError, match="the attempt failed"):
        with StagingDir(root, "t", 900) as failed:
            (failed / "image").write_bytes(b"x")
            raise RuntimeError("the attempt failed")
    assert _dirs(root) == []
    with StagingDir(root, "../../escape/../x y", 900) as odd:
        assert odd.parent == root and " " not in odd.name and "/" not in odd.name.removeprefix(PREFIX)


def test_what_killed_drivers_left_is_removed_by_the_next_once_stale(tmp_path):
    root = tmp_path / "staging"
    root.mkdir()
    old = time.time() - 3600

    def leftover(name: str, beat: float | None, dir_time: float) -> Path:
        d = root / name
        d.mkdir()
        (d / "image").write_bytes(b"x")
        if beat is not None:
            (d / ALIVE).write_text("")
            os.utime(d / ALIVE, (beat, beat))
        os.utime(d, (dir_time, dir_time))
        return d

    stale = leftover(f"{PREFIX}ns-killed-a1-xyz", old, old)
    no_beat = leftover(f"{PREFIX}ns-killed-before-its-first-beat-abc", None, old)
    alive = leftover(f"{PREFIX}ns-running-a1-def", time.time(), old)  # an old directory, a fresh heartbeat
    other = leftover("someone-elses", None, old)
    with StagingDir(root, "ns-next-a1", 900) as mine:
        assert not stale.exists() and not no_beat.exists(), _dirs(root)
        assert alive.exists() and other.exists() and mine.exists()
    assert sweep_stale(root, 900) == []


def test_a_running_attempts_heartbeat_keeps_its_directory(tmp_path):
    root = tmp_path / "staging"
    with StagingDir(root, "long-job-a1", stale_s=4) as running:  # a beat every second
        first = (running / ALIVE).stat().st_mtime
        wait_for("the heartbeat to touch .alive again", lambda: (running / ALIVE).stat().st_mtime > first,
                 timeout=10, interval=0.2)
        time.sleep(5)  # longer than stale_s: only the heartbeat keeps it
        assert sweep_stale(root, 4) == [] and running.exists()


# -- a rank that cannot see the staged file ---------------------------------------------


def test_a_rank_that_cannot_see_a_staged_file_names_the_setting(tmp_path, monkeypatch):
    from videojob_runtime.inputs import load_face_embeddings, load_image

    monkeypatch.setenv("VIDEOJOB_INPUT_STAGING_ROOT", "/mnt/videojob/data/staging")
    elsewhere = tmp_path / f"{PREFIX}ns-job-a1-q1w2"  # the driver's directory, on another machine's disk
    with pytest.raises(JobFailure) as exc:
        load_image(str(elsewhere / "image"), 64, 64, "spec.image", str(elsewhere))
    message = exc.value.message
    assert message.startswith("spec.image: the job's driver fetched this input into ") and "cannot see" in message
    assert "VIDEOJOB_INPUT_STAGING_ROOT=/mnt/videojob/data/staging" in message and "every Ray node" in message
    assert exc.value.stage == "inputs"
    monkeypatch.delenv("VIDEOJOB_INPUT_STAGING_ROOT")
    with pytest.raises(JobFailure, match="VIDEOJOB_INPUT_STAGING_ROOT is unset"):
        load_face_embeddings(str(elsewhere / "face-image"), None, "spec.faceImage", str(elsewhere))


def test_a_rank_reports_it_as_the_jobs_error(tmp_path):
    """Through a real rank (RankWorker): the job fails in stage inputs with that message."""
    require_module("torch")
    require_module("xfuser")
    from videojob_runtime.worker import JobRequest, RankWorker

    elsewhere = tmp_path / f"{PREFIX}ns-job-a1-x9y8"
    request = JobRequest(job_id="t", model_id="tiny-cogvideox-i2v", task="i2v", prompt="p", width=64, height=64,
                         frames=9, fps=8, steps=2, guidance=6.0, image=str(elsewhere / "image"),
                         local_inputs_dir=str(elsewhere))
    out = RankWorker(0, 1).run(request)
    assert not out["ok"] and out["error"]["stage"] == "inputs", out
    assert "VIDEOJOB_INPUT_STAGING_ROOT" in out["error"]["message"], out["error"]


# -- the driver, for real ---------------------------------------------------------------


@pytest.fixture(scope="module")
def staged_cluster(https_server, tmp_path_factory):  # noqa: F811
    require_module("torch")
    require_module("xfuser")
    require_module("aiohttp_cors", reason="Ray's Jobs API (the dashboard) needs ray[default]")
    from videojob.raycluster.client import HttpRayClient

    root = tmp_path_factory.mktemp("staging-driver")
    env = {"VIDEOJOB_OUTPUT_ROOT": str(root / "outputs"), "VIDEOJOB_INPUT_STAGING_ROOT": str(root / "staging"),
           "VIDEOJOB_INPUT_CA_BUNDLE": https_server.ca, "VIDEOJOB_INPUT_ALLOW_PRIVATE_HOSTS": "true",
           "OMP_NUM_THREADS": "1"}
    (root / "outputs").mkdir()
    with RayHead(num_cpus=2, dashboard=True, env=env) as head:
        client = HttpRayClient(head.dashboard_url, token=head.token)
        client.test_temp_dir = head.temp_dir  # where the head's logs are (the query must not be in any)
        yield client, root / "staging", https_server


def _i2v(name: str, image: str, fault: dict | None = None) -> DriverRequest:
    uid = str(uuid.uuid4())
    job = dict(job_id=name, model_id="tiny-cogvideox-i2v", task="i2v", prompt="a test", width=64, height=64,
               frames=9, fps=8, steps=3, guidance=6.0, seed=7, dtype="float32", image=image)
    if fault:
        job["inject_fault"] = fault
    return DriverRequest(namespace="ns", name=name, uid=uid, job=job, output_uri=f"local://videos/{name}",
                         group=GroupRequest(name=f"vj-{uid}", cpus_per_rank=0.5), progress_interval_s=0.5)


def _shows(text: str, secret: str) -> bool:
    """Whether ``text`` shows ``secret``: as it is, or inside any base64 token (a request)."""
    import base64
    import re

    if secret in text:
        return True
    for token in re.findall(r"[A-Za-z0-9_-]{40,}={0,2}", text):
        try:
            if secret.encode() in base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)):
                return True
        except ValueError:
            continue
    return False


def _submit(client, request: DriverRequest) -> str:
    sid = submission_id(request.namespace, request.name, request.uid, request.attempt)
    assert client.submit(sid, request.entrypoint(PY), metadata={}) is True
    return sid


def _end(client, sid: str, timeout: float = 240):
    job = wait_for(f"Ray job {sid} to end", lambda: (j := client.job(sid)) is not None and j.terminal and j,
                   timeout=timeout, interval=0.5)
    return job, client.logs(sid)


def test_the_ranks_read_the_staged_image_and_the_directory_goes_after_success(staged_cluster):
    client, staging, server = staged_cluster
    request = _i2v("staged-ok", f"{server.url}/face.png")
    job, logs = _end(client, _submit(client, request))
    result = result_of(logs)
    assert job.status == "SUCCEEDED" and result["ok"], logs[-4000:]
    assert _dirs(staging) == [], f"left under the staging root after success: {_dirs(staging)}"


def test_a_stopped_driver_removes_its_staged_inputs(staged_cluster):
    client, staging, server = staged_cluster
    request = _i2v("staged-stop", f"{server.url}/face.png", fault={"stage": "denoise", "kind": "stall", "seconds": 120})
    sid = _submit(client, request)

    def running_with_its_inputs():
        logs = client.logs(sid)
        denoising = any(r["type"] == "progress" and r.get("stage") == "denoise" for r in records(logs))
        return denoising and _dirs(staging)

    (staged,) = wait_for("the job to denoise with its image staged", running_with_its_inputs, timeout=240,
                         interval=0.5)
    assert staged.startswith(f"{PREFIX}ns-staged-stop-{request.uid[:8]}-a1-"), staged
    assert (staging / staged / "image").is_file()
    assert client.stop(sid)
    job, logs = _end(client, sid, timeout=60)
    result = result_of(logs)
    assert job.status == "STOPPED" and result["error"]["reason"] == "Cancelled", logs[-3000:]
    assert _dirs(staging) == [], f"the stop left {_dirs(staging)} under the staging root"


# -- a presigned URL: its query never leaves the request (issue 21) -----------------------

SECRET = "X-Key-9c41e7-expires-1700000000"


def _environ(pid: int) -> dict[str, str]:
    """The environment process ``pid`` was started with (this machine's /proc)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(entry.decode(errors="replace").partition("=")[::2] for entry in raw.split(b"\0") if entry)


def test_a_query_in_the_image_url_stays_off_the_entrypoint_the_log_and_the_ranks(staged_cluster, tmp_path):
    """The operator's submission path (``DriverRequest.submission``, ``DriverLaunch.submit``)
    through the real Jobs API: the request, whose image URL has a query, goes in the
    submission's runtime_env; the driver reads it, fetches the image with its query and
    succeeds; the Ray job's entrypoint and the driver's log hold no query, and the rank
    actor (the i2v model runs on one; seen while the job stalls at denoise, released once
    seen) was started without the request."""
    from videojob.controller.groups import DriverLaunch

    client, staging, server = staged_cluster
    query = f"/face.png?v={SECRET}&expires=1"
    server.routes[query] = server.routes["/face.png"]  # the server answers only the URL with its query
    release = tmp_path / "release-presigned"  # each stall (before and after every step) is 10 s at most
    request = _i2v("presigned", f"{server.url}{query}",
                   fault={"stage": "denoise", "kind": "stall", "seconds": 10, "release": str(release)})
    entrypoint, runtime_env = request.submission(PY)
    assert runtime_env is not None, "a request with a query must travel outside the entrypoint"
    sid = submission_id(request.namespace, request.name, request.uid, request.attempt)
    assert DriverLaunch(PY).submit(client, sid, entrypoint, {"videojob.io/name": request.name},
                                   runtime_env=runtime_env) is True

    def ranks_denoising():
        logs = client.logs(sid)
        if (job := client.job(sid)) is None or job.terminal:
            pytest.fail(f"the Ray job ended before its ranks denoised ({job and job.status}):\n{logs[-4000:]}")
        denoising = any(r["type"] == "progress" and r.get("stage") == "denoise" for r in records(logs))
        ranks = client.actors(f"{request.group.name}-rank")
        return denoising and len(ranks) == 1 and ranks[0].get("pid") and ranks

    ranks = wait_for("the rank to denoise", ranks_denoising, timeout=240, interval=0.5)
    encoded = request.encode()
    for actor in ranks:
        env = _environ(int(actor["pid"]))
        assert env.get("VIDEOJOB_INPUT_CA_BUNDLE") == server.ca, f"not a rank of this head: {actor}"
        assert REQUEST_ENV not in env, f"rank {actor['name']} was started with the request"
        held = [k for k, v in env.items() if SECRET in v or encoded in v]
        assert not held, f"rank {actor['name']}'s environment holds the query in {held}"
    release.touch()

    job, logs = _end(client, sid)
    result = result_of(logs)
    assert job.status == "SUCCEEDED" and result["ok"], logs[-4000:]
    assert server.counts[query] == 1, f"the image was not fetched with its query: {dict(server.counts)}"
    assert job.entrypoint == f"{PY} -m videojob_runtime.driver --request-env", job.entrypoint
    assert "?" not in job.entrypoint and encoded not in job.entrypoint
    assert SECRET not in logs and encoded not in logs, "the driver's log shows the query"
    # Issue 36, 13: Ray's job table and every log of the head (the runtime env agent's
    # among them) hold the request only sealed.
    status, table = client._request("GET", f"/api/jobs/{sid}")
    assert status == 200 and runtime_env["env_vars"][REQUEST_ENV] in table, table[:2000]
    assert not _shows(table, SECRET), "Ray's job table"
    held = [str(p) for p in Path(client.test_temp_dir).rglob("*.log")
            if p.is_file() and _shows(p.read_text(errors="replace"), SECRET)]
    agent_logs = list(Path(client.test_temp_dir).rglob("runtime_env*.log"))
    assert agent_logs and not held, f"the request is readable in {held} (runtime env logs: {agent_logs})"
    assert _dirs(staging) == [], f"left under the staging root after success: {_dirs(staging)}"
