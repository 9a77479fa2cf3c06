"""The operator as users meet it: `kubectl apply` a VideoJob, get a video.

A real kube-apiserver (the loopback cluster), a real Ray head started by the
test as its own process (so killing the operator leaves Ray running), the
operator as a subprocess under a ServiceAccount bound to the chart's RBAC
rules, and the tiny CPU model. One namespace per test.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("ray")
require_module("xfuser")

from helpers import wait_for  # noqa: E402
from operator_harness import (  # noqa: E402
    OperatorProcess, create, elapsed_since, python_without_runtime, rbac_rules, tiny_job, videojob, wait_phase,
    write_inventory,
)
from operator_inprocess import Outage, with_fault  # noqa: E402

pytestmark = pytest.mark.cluster
# Bigger than the demo's 64x64: a step takes long enough to act while the job runs.
SLOW_VIDEO = {"width": 192, "height": 192, "frames": 17, "fps": 8}
# The operator honours the test-only fault annotation (with_fault) only when allowed.
FAULTS = {"VIDEOJOB_ALLOW_FAULT_INJECTION": "1"}


def _stalled(doc: dict, seconds: float, release: Path | None = None) -> dict:
    """``doc`` whose first attempt stalls after denoise step 1 on every rank: a job still
    running at a known point, however fast or slow steps are on this machine. The stall
    lasts ``seconds`` at most: it ends once the job is cancelled, or once the test creates
    the file ``release`` (where the job must go on after the test acted)."""
    fault = {"release": str(release)} if release is not None else {}
    return with_fault(doc, [1], stage="denoise", kind="stall", step=1, seconds=seconds, **fault)


@pytest.fixture
def operator_env(ray_head, roots, tmp_path):
    token = tmp_path / "ray-token"
    token.write_text(ray_head.token)
    return {"VIDEOJOB_RAY_MODE": "address", "VIDEOJOB_RAY_DASHBOARD_URL": ray_head.dashboard_url,
            "VIDEOJOB_RAY_TOKEN_FILE": str(token), "VIDEOJOB_DRIVER_PYTHON": _python(),
            "VIDEOJOB_INVENTORY_FILE": str(write_inventory(tmp_path / "inventory.yaml")),
            # No warm groups outlive a test here (they would hold the shared Ray head's CPUs);
            # tests/test_scheduling_operator.py covers them.
            "VIDEOJOB_WARM_GROUP_TTL_S": "0"}


def _python() -> str:
    import sys

    return sys.executable


def _events(cluster, namespace: str, name: str) -> list[str]:
    out = cluster.api.get(f"/api/v1/namespaces/{namespace}/events")   # polled: no kubectl fork
    return [e["reason"] for e in out["items"] if e["involvedObject"].get("name") == name]


def ray_errors(operator) -> float:
    """videojob_ray_errors_total from the operator's /metrics: calls to Ray that failed."""
    return sum(float(line.split()[-1]) for line in operator.metrics().splitlines()
               if line.startswith("videojob_ray_errors_total"))


def _submissions(ray_client, uid: str) -> int:
    jobs = ray_client._json("GET", "/api/jobs/")
    return sum(1 for j in jobs if (j.get("metadata") or {}).get("videojob.io/uid") == uid)


def _nothing_left(ray_client, group: str) -> None:
    wait_for(f"no actor or placement group of {group} in Ray",
             lambda: not ray_client.actors(group) and not ray_client.placement_groups(group), timeout=15)


def test_apply_then_get_a_video(crd, namespace, ray_head, ray_client, roots, operator_env):
    """`kubectl apply` the tiny job; wait for Succeeded: the mp4 is where the output uri
    says and decodes; the status holds plan, progress, measurements and output;
    each phase has an event; progress was seen to rise while it ran."""
    from videojob_runtime.output import probe_mp4

    with OperatorProcess(crd, namespace, roots["work"], operator_env) as operator:
        created = create(crd, namespace, tiny_job("tiny-cpu", steps=200))
        seen: list[int] = []

        def progressed():
            obj = videojob(crd, namespace, "tiny-cpu")
            percent = (obj.get("status", {}).get("progress") or {}).get("percent")
            if percent is not None and (not seen or seen[-1] != percent):
                seen.append(percent)
            return obj.get("status", {}).get("phase") in ("Succeeded", "Failed") and obj

        obj = wait_for("tiny-cpu to finish", progressed, timeout=240, interval=0.2)
        status = obj["status"]
        assert status["phase"] == "Succeeded", status.get("message")
        rising = [p for p in seen if 0 < p < 100]
        assert len(rising) >= 2, f"progress was seen at {seen}: it must rise at least twice while running"
        assert status["progress"]["percent"] == 100
        assert status["plan"]["ulysses"] == 2 and status["plan"]["gpus"] == 2
        assert status["measured"]["peakGiB"] > 0 and status["measured"]["denoiseSeconds"] > 0
        assert status["output"]["bytes"] > 0 and status["output"]["framesDigest"].startswith("sha256:")
        video = roots["outputs"] / namespace / "videos" / "tiny-cpu" / "tiny-cpu.mp4"
        assert probe_mp4(video)["frames"] == 9
        assert status["observedGeneration"] == obj["metadata"]["generation"]
        conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
        assert conditions["Planned"] == ("True", "Planned") and conditions["Completed"] == ("True", "Succeeded")
        attempts = status["attempts"]
        assert len(attempts) == 1 and attempts[0]["result"] == "Succeeded" and attempts[0]["submissionId"]
        # Planned and admitted at once: the plan is written with the attempt (one
        # write), so the phases it passes through are Running and Succeeded.
        wait_for("an event per phase", lambda: {"Running", "Succeeded"} <= set(
            _events(crd, namespace, "tiny-cpu")), timeout=30)
        assert _submissions(ray_client, created["metadata"]["uid"]) == 1
        _nothing_left(ray_client, f"vj-{created['metadata']['uid']}")
        metrics = operator.metrics()
        assert 'videojob_jobs{phase="Succeeded"} 1.0' in metrics and "videojob_ray_submissions_total 1.0" in metrics
        listed = crd.kubectl("get", "vj", "-n", namespace).stdout.splitlines()
        assert listed[1].split()[:5] == ["tiny-cpu", "Succeeded", "100", "2", "default"]
        assert listed[1].split()[5] == "tiny-cogvideox"  # no queue place once admitted


def test_delete_mid_run_stops_everything_without_waiting_for_the_run(crd, namespace, ray_client, roots,
                                                                     operator_env):
    stall_s = 120
    with OperatorProcess(crd, namespace, roots["work"], {**operator_env, **FAULTS}):
        # Stalled 120 s after step 1 (not "many steps": their time depends on the load), so the
        # driver is still running when it is deleted; the stop kills the sleeping ranks.
        created = create(crd, namespace, _stalled(tiny_job("long", steps=3), stall_s))
        uid = created["metadata"]["uid"]
        wait_for("the long job to make progress", lambda: ((videojob(crd, namespace, "long").get("status") or {})
                                                           .get("progress") or {}).get("step", 0) >= 1, timeout=180)
        sid = videojob(crd, namespace, "long")["status"]["attempts"][0]["submissionId"]
        start = time.monotonic()
        crd.kubectl("delete", "vj", "long", "-n", namespace, "--wait=false")
        wait_for("the VideoJob to be gone (finalizer removed)",
                 lambda: crd.api.get(f"/apis/videojob.io/v1alpha1/namespaces/{namespace}/videojobs/long") is None,
                 timeout=stall_s / 3)
        took = elapsed_since(start)
        # a ratio, not a speed target (a loaded machine must not break it): the stop did not wait
        # for the stalled run
        assert took < stall_s / 4, f"the finalizer took {took:.1f}s of the run's {stall_s} s stall"
        assert ray_client.job(sid).status == "STOPPED"
        _nothing_left(ray_client, f"vj-{uid}")


def test_a_job_that_never_started_is_deleted_at_once(crd, namespace, roots, operator_env):
    with OperatorProcess(crd, namespace, roots["work"], operator_env):
        # Needs 4 ranks on a 2-rank inventory: it fails planning and never starts a driver.
        create(crd, namespace, tiny_job("never", parallel={"ulysses": 2, "cfg": 2}, resources={"maxGPUs": 4}))
        wait_phase(crd, namespace, "never", {"Failed"}, timeout=60)
        start = time.monotonic()
        crd.kubectl("delete", "vj", "never", "-n", namespace, "--timeout=20s")
        assert elapsed_since(start) < 5


# Slow (CI time): `make test` covers a restart mid job with
# test_operator_races::test_restart_while_a_job_runs_on_a_reused_warm_group_books_it_once.
@pytest.mark.slow
def test_restart_mid_job_adopts_the_driver(crd, namespace, ray_client, roots, operator_env, tmp_path):
    """Kill the operator (SIGKILL) while its job runs and start it again: the job
    completes, its driver was submitted once, and the weights were loaded once."""
    from videojob.driver_protocol import result_of

    operator = OperatorProcess(crd, namespace, roots["work"], {**operator_env, **FAULTS}).start()
    try:
        # Stalled after step 1 (30 s at most), so the driver still runs when the operator is
        # back; released once the new operator adopted it, then it finishes under that one.
        release = tmp_path / "release-survivor"
        created = create(crd, namespace, _stalled(tiny_job("survivor", steps=3), 30, release))
        wait_for("the job to run", lambda: ((videojob(crd, namespace, "survivor").get("status") or {})
                                            .get("progress") or {}).get("step", 0) >= 1, timeout=180)
        operator.kill()
        time.sleep(1.5)  # Ray keeps running the driver while no operator watches
        operator.start()
        wait_for("the new operator to adopt the running driver", lambda: "adopted (RUNNING)" in operator.log(),
                 timeout=60)
        release.touch()
        obj = wait_phase(crd, namespace, "survivor", {"Succeeded", "Failed"}, timeout=240)
        assert obj["status"]["phase"] == "Succeeded", obj["status"].get("message")
        uid = created["metadata"]["uid"]
        assert _submissions(ray_client, uid) == 1
        sid = obj["status"]["attempts"][-1]["submissionId"]
        assert len(obj["status"]["attempts"]) == 1
        assert result_of(ray_client.logs(sid))["loads"] == 1, "weights were loaded once"
        assert "adopted (RUNNING)" in operator.log(), "the driver was not running when the operator came back"
    finally:
        operator.stop()


# Slow (CI time): `make test` covers an expired list with test_apiserver's expired continue token
# and restarts with test_operator_races.
@pytest.mark.slow
def test_conflicts_and_dropped_watches_lose_nothing(crd, namespace, ray_client, roots, operator_env, tmp_path):
    """A job queued behind another has its labels changed every few ms while it
    waits and runs, so the operator's conditional write of its attempt (made
    from the status it read before it queued) meets a real 409; and the API
    server ends the operator's watch every 2 s. The job still succeeds,
    submitted once, one attempt."""
    env = {**operator_env, **FAULTS, "VIDEOJOB_WATCH_TIMEOUT_S": "2"}
    stop = threading.Event()

    def churn(lane):
        n = 0
        while not stop.is_set():
            crd.kubectl("label", "vj", "churn", "-n", namespace, f"churn{lane}={n}", "--overwrite", check=False)
            n += 1

    with OperatorProcess(crd, namespace, roots["work"], env) as operator:
        # `blocker` holds both ranks after its first step (a stall of 30 s at most, not a number
        # of steps), so `churn` is queued behind it however slowly the operator picks it up;
        # released once `churn` is queued and its labels change.
        release = tmp_path / "release-blocker"
        create(crd, namespace, _stalled(tiny_job("blocker", steps=2), 30, release))
        wait_phase(crd, namespace, "blocker", {"Running", "Succeeded", "Failed"}, timeout=120)
        created = create(crd, namespace, tiny_job("churn", steps=20))
        wait_phase(crd, namespace, "churn", {"Queued"}, timeout=60)
        threads = [threading.Thread(target=churn, args=(lane,), daemon=True) for lane in range(2)]
        for thread in threads:
            thread.start()
        try:
            wait_for("`churn`'s labels to change while it is queued", lambda: {"churn0", "churn1"} <= set(
                videojob(crd, namespace, "churn")["metadata"].get("labels") or {}), timeout=60)
            release.touch()
            obj = wait_phase(crd, namespace, "churn", {"Succeeded", "Failed"}, timeout=240)
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)
        assert obj["status"]["phase"] == "Succeeded", obj["status"].get("message")
        assert len(obj["status"]["attempts"]) == 1
        assert _submissions(ray_client, created["metadata"]["uid"]) == 1
        log = operator.log()
    assert "changed while starting an attempt" in log, "the test never produced a conflict; it proves nothing"


def test_a_missing_permission_fails_visibly(crd, namespace, roots, operator_env):
    """Under the chart's rules minus one (patching the status), the job never
    gets a status and the operator says why (403), instead of pretending."""
    rules = rbac_rules(drop=("videojobs/status", "patch"))
    with OperatorProcess(crd, namespace, roots["work"], operator_env, rules=rules) as operator:
        create(crd, namespace, tiny_job("forbidden"))
        wait_for("the operator to report the refusal",
                 lambda: "403" in operator.log() or "Forbidden" in operator.log(), timeout=60)
        assert "phase" not in (videojob(crd, namespace, "forbidden").get("status") or {})


@pytest.mark.parametrize("case", ["model-source", "output"])
def test_bad_input_the_api_server_cannot_see_fails_naming_it(crd, namespace, roots, operator_env, case, tmp_path):
    # Room on paper for a full-size model, so it plans and the driver finds its source missing.
    env = {**operator_env, "VIDEOJOB_INVENTORY_FILE": str(write_inventory(
        tmp_path / "big.yaml", gpu_memory="80Gi", host_memory="512Gi"))}
    with OperatorProcess(crd, namespace, roots["work"], env):
        if case == "model-source":
            doc = tiny_job("bad-source", model={"name": "cogvideox-2b", "dtype": "float32",
                                                "source": "local://nowhere/cogvideox"},
                           video={"width": 64, "height": 64, "frames": 9, "fps": 8}, parallel=None)
            expected = "spec.model.source"
        else:
            (roots["outputs"] / namespace).mkdir(parents=True, exist_ok=True)
            (roots["outputs"] / namespace / "a-file").write_text("not a directory")
            doc = tiny_job("bad-output")
            doc["spec"]["output"] = {"uri": "local://a-file/video"}
            expected = "spec.output.uri"
        doc["spec"] = {k: v for k, v in doc["spec"].items() if v is not None}
        name = doc["metadata"]["name"]
        create(crd, namespace, doc)
        obj = wait_phase(crd, namespace, name, {"Failed", "Succeeded"}, timeout=240)
        assert obj["status"]["phase"] == "Failed"
        assert expected in obj["status"]["message"], obj["status"]["message"]
        assert obj["status"]["attempts"][-1]["result"] == "Failed"


@pytest.mark.parametrize("case", ["unreachable", "wrong-token"])
def test_ray_trouble_is_a_retrying_condition_not_a_crash(crd, namespace, roots, operator_env, ray_head, tmp_path,
                                                         case):
    # One quick retry per call and a short wait between tries: the story is the same as
    # with the defaults (4 retries, 5 s), without ~15 s of back-off waited out.
    env = {**operator_env, "VIDEOJOB_RAY_HTTP_RETRIES": "1", "VIDEOJOB_RAY_RETRY_S": "0.5"}
    outage = None
    if case == "unreachable":
        # A forwarder to the shared head that refuses connections until up(): Ray comes back
        # at the end (tests/test_operator_retries.py's slow story has it go away mid-run too).
        outage = Outage(ray_head.dashboard_port)
        env["VIDEOJOB_RAY_DASHBOARD_URL"] = outage.url
        reason, words = "RayUnavailable", "unreachable"
    else:
        (tmp_path / "wrong-token").write_text("not-the-token")
        env["VIDEOJOB_RAY_TOKEN_FILE"] = str(tmp_path / "wrong-token")
        reason, words = "RayAuthFailed", "token"
    with OperatorProcess(crd, namespace, roots["work"], env) as operator:
        create(crd, namespace, tiny_job("stuck"))

        def condition():
            status = videojob(crd, namespace, "stuck").get("status") or {}
            return next((c for c in status.get("conditions", []) if c["reason"] == reason), None)

        found = wait_for(f"a {reason} condition", condition, timeout=60)
        assert words in found["message"] and found["status"] == "Unknown"
        assert "retrying every 0.5 s" in found["message"], found["message"]
        failed = ray_errors(operator)
        wait_for("the operator to try Ray again, twice, after it said so",
                 lambda: ray_errors(operator) >= failed + 2, timeout=30)
        assert operator.healthy() and operator.process.poll() is None, "the operator keeps running and retrying"
        assert videojob(crd, namespace, "stuck")["status"]["phase"] not in ("Failed", "Succeeded")
        if outage is not None:
            outage.up()
            try:
                done = wait_phase(crd, namespace, "stuck", {"Succeeded", "Failed"}, timeout=300)
            finally:
                outage.down()
            assert done["status"]["phase"] == "Succeeded", done["status"].get("message")
            admitted = next(c for c in done["status"]["conditions"] if c["type"] == "Admitted")
            assert admitted["reason"] != reason, "once Ray answers, the status no longer says it does not"
            assert len(done["status"]["attempts"]) == 1, done["status"]["attempts"]


def test_embedded_mode_runs_the_tiny_job(crd, namespace, roots, tmp_path):
    """`videojob operator` with no Ray address starts its own head and runs the job. As
    `.venv/bin/videojob operator` runs from a shell where the venv is not activated: no
    VIDEOJOB_DRIVER_PYTHON, and the first `python` on PATH cannot import the runtime; the
    drivers run with the operator's own Python (before: three DriverLost attempts)."""
    from videojob_runtime.output import probe_mp4

    out = tmp_path / "embedded-outputs"
    plain = python_without_runtime(tmp_path / "plain-venv")
    env = {"VIDEOJOB_RAY_MODE": "embedded", "VIDEOJOB_EMBEDDED_RAY_CPUS": "2", "VIDEOJOB_OUTPUT_ROOT": str(out),
           "VIDEOJOB_INVENTORY_FILE": str(write_inventory(tmp_path / "inventory.yaml")),
           "PATH": f"{plain.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with OperatorProcess(crd, namespace, roots["work"], {**env, "VIDEOJOB_DRIVER_PYTHON": None}):
        create(crd, namespace, tiny_job("embedded", steps=3))
        obj = wait_phase(crd, namespace, "embedded", {"Succeeded", "Failed"}, timeout=300)
        assert obj["status"]["phase"] == "Succeeded", obj["status"].get("message")
        # kopf posts events from a queue after the status write: wait while the operator runs.
        wait_for("a Succeeded event", lambda: "Succeeded" in _events(crd, namespace, "embedded"), timeout=30)
    assert probe_mp4(out / namespace / "videos" / "embedded" / "embedded.mp4")["frames"] == 9
