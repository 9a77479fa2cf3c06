"""The runtime on a CPU: real Ray actors, real xfuser USP over gloo, tiny
random-weight models, compared with plain diffusers in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("xfuser")
ray = pytest.importorskip("ray")

from helpers import REPO, wait_for  # noqa: E402
from videojob_runtime.group import ActorGroup, GroupSpec  # noqa: E402
from videojob_runtime.output import probe_mp4  # noqa: E402
from videojob_runtime.worker import JobRequest, RankWorker  # noqa: E402


def _request(model_id: str = "tiny-cogvideox", **overrides) -> JobRequest:
    base = dict(job_id="t", model_id=model_id, task="t2v", prompt="a tiny test video", width=64, height=64,
                frames=9, fps=8, steps=3, guidance=6.0 if "cog" in model_id else 5.0, seed=7,
                frames_dtype="float32")
    return JobRequest(**{**base, **overrides})


@pytest.fixture(scope="module")
def local_ray():
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="videojob",
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    """Plain diffusers in this process (world of one), same weights and seed."""
    worker = RankWorker(0, 1)
    cache: dict = {}

    def run(req: JobRequest) -> np.ndarray:
        key = (req.model_id, req.steps, req.guidance)
        if key not in cache:
            out = worker.run(req)
            assert out["ok"], out
            assert out["collectives"] == 0
            cache[key] = out["frames"]
        return cache[key]

    return run


@pytest.fixture(scope="module")
def ulysses_group(local_ray):
    group = ActorGroup.start(GroupSpec("test-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    yield group
    group.teardown()


def _assert_equivalent(result: dict, expected: np.ndarray) -> None:
    assert result["ok"], result
    frames = result["frames"]
    assert frames.shape == expected.shape
    value_range = float(expected.max() - expected.min()) or 1.0
    assert float(np.abs(frames - expected).max()) < 1e-3 * value_range
    assert all(c > 0 for c in result["collectives_per_rank"]), "a rank ran without collectives: not parallel"


def test_cogvideox_ulysses2_matches_diffusers(ulysses_group, reference):
    req = _request()
    _assert_equivalent(ulysses_group.run(req, timeout_s=180), reference(req))


@pytest.mark.parametrize("degrees", [(1, 2, 1), (1, 1, 2)], ids=["ring2", "cfg2"])
def test_cogvideox_ring_and_cfg_match_diffusers(local_ray, reference, degrees):
    u, r, c = degrees
    group = ActorGroup.start(GroupSpec(f"test-{u}{r}{c}", ulysses=u, ring=r, cfg=c), timeout_s=120, cpus_per_rank=0.5)
    try:
        req = _request()
        _assert_equivalent(group.run(req, timeout_s=180), reference(req))
    finally:
        group.teardown()


def test_wan_ulysses2_matches_diffusers(local_ray, reference):
    # 64x64x9 -> 3 x 4 x 4 = 48 latent tokens, divisible by 2 (xfuser pads Wan without masking).
    group = ActorGroup.start(GroupSpec("test-wan-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    try:
        req = _request("tiny-wan")
        _assert_equivalent(group.run(req, timeout_s=180), reference(req))
    finally:
        group.teardown()


def test_warm_group_does_not_load_again(ulysses_group):
    first = ulysses_group.run(_request(job_id="warm-1"), timeout_s=180)
    second = ulysses_group.run(_request(job_id="warm-2", prompt="another prompt"), timeout_s=180)
    assert first["ok"] and second["ok"]
    assert second["reused_all"] and second["timings"]["load"] == 0.0
    assert second["loads"] == first["loads"]


def test_injected_oom_is_structured(ulysses_group):
    result = ulysses_group.run(_request(job_id="oom", inject_oom="denoise"), timeout_s=180)
    assert not result["ok"]
    error = result["error"]
    assert error["reason"] == "OutOfMemory" and error["stage"] == "denoise"
    assert error["peak_bytes"] > 0 and "out of memory" in error["message"]
    assert ulysses_group.run(_request(job_id="after-oom"), timeout_s=180)["ok"], "group unusable after OOM"


def test_progress_while_running_and_cancel_between_steps(ulysses_group):
    refs = [a.run.remote(vars(_request(job_id="long", steps=400))) for a in ulysses_group.actors]
    progress = wait_for(
        "the long job to pass step 2",
        lambda: (p := ulysses_group.progress())["job_id"] == "long" and p["step"] >= 2 and p,
        timeout=120,
    )
    assert progress["steps"] == 400 and 0 < progress["percent"] < 100
    ulysses_group.cancel()
    results = ray.get(refs, timeout=120)
    steps = {r["error"].get("step") for r in results}
    assert all(r["error"]["reason"] == "Cancelled" for r in results)
    assert len(steps) == 1 and steps.pop() < 400, "ranks must stop at the same step"
    assert ulysses_group.run(_request(job_id="after-cancel"), timeout_s=180)["ok"]


def test_detached_group_reattaches_by_name(ulysses_group):
    again = ActorGroup.attach(ulysses_group.spec)
    health = again.health()
    assert [h["rank"] for h in health] == [0, 1] and all(h["distributed"] for h in health)


def test_mp4_has_frames_size_and_fps(tmp_path):
    out = RankWorker(0, 1).run(_request(job_id="mp4", fps=12, output_dir=str(tmp_path), output_name="clip"))
    assert out["ok"], out
    assert probe_mp4(tmp_path / "clip.mp4") == {"codec": "h264", "width": 64, "height": 64, "fps": 12.0, "frames": 9}
    result = json.loads((tmp_path / "clip.json").read_text())
    assert result["output"]["frames"] == 9 and result["measured"]["peakGiB"] > 0
    assert (tmp_path / "clip.png").stat().st_size > 0


def test_missing_model_source_is_actionable():
    out = RankWorker(0, 1).run(_request("cogvideox-2b", source="local://nowhere/cogvideox"))
    assert not out["ok"]
    assert out["error"]["reason"] == "ModelSourceMissing" and "spec.model.source" in out["error"]["message"]


def test_videojob_run_cli_writes_the_three_files(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "videojob.cli", "run", str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(tmp_path),
         "--set", "sampling.steps=2", "--set", "parallel.ulysses=2", "--quiet"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - start < 300
    assert probe_mp4(tmp_path / "tiny-cpu.mp4")["frames"] == 9
    summary = json.loads((tmp_path / "tiny-cpu.json").read_text())
    assert summary["plan"]["ulysses"] == 2 and summary["spec"]["sampling"]["steps"] == 2
    assert "ulysses2" in result.stdout


def test_videojob_run_rejects_bad_override(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "videojob.cli", "run", str(REPO / "examples" / "tiny-cpu.yaml"), "--out", str(tmp_path),
         "--set", "video.frames=10"], capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1 and "spec.video.frames" in result.stderr


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def test_step_cache_under_sequence_parallel(local_ray):
    """DBCache on two USP ranks: both ranks skip the same evaluations (cache-dit
    all-reduces its statistics), at least 30% are skipped, and the video stays
    close to cache-off: PSNR >= 35 dB (frames in [0, 1]; two different seeds'
    videos are ~12.5 dB apart on this model, so 35 dB is a small error)."""
    group = ActorGroup.start(GroupSpec("test-cache-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    try:
        off = group.run(_request(job_id="cache-off", steps=8), timeout_s=180)
        assert off["ok"] and off["cache"] is None
        refs = [a.run.remote(vars(_request(job_id="cache-on", steps=8, cache="dbcache", cache_threshold=0.55)))
                for a in group.actors]
        ranks = ray.get(refs, timeout=180)
        assert all(r["ok"] for r in ranks), ranks
        stats = [r["cache"] for r in ranks]
        assert stats[0] == stats[1], f"ranks disagreed: {stats}"
        total = stats[0]["evaluations"] + stats[0]["skipped"]
        assert stats[0]["skipped"] / total >= 0.30, stats
        frames = next(r["frames"] for r in ranks if r["frames"] is not None)
        assert _psnr(frames, off["frames"]) >= 35.0
    finally:
        group.teardown()


@pytest.mark.parametrize("mode", ["model", "group", "sequential"])
def test_offload_modes_give_the_same_frames_through_the_worker(reference, mode):
    req = _request()
    out = RankWorker(0, 1).run(_request(offload=mode))
    assert out["ok"], out
    assert float(np.abs(out["frames"] - reference(req)).max()) <= 1e-5


@pytest.fixture(scope="module")
def face_inputs(tmp_path_factory):
    """A face image and its precomputed ConsisID embeddings (no face models needed)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    image = root / "face.png"
    Image.fromarray((rng.random((64, 64, 3)) * 255).astype("uint8")).save(image)
    np.savez(str(image) + ".npz", id_cond=rng.standard_normal((1, 16)).astype("float32"),
             id_vit_hidden_0=rng.standard_normal((1, 5, 32)).astype("float32"),
             id_vit_hidden_1=rng.standard_normal((1, 5, 32)).astype("float32"))
    return image


def test_cogvideox_image_to_video(face_inputs):
    out = RankWorker(0, 1).run(_request("tiny-cogvideox-i2v", task="i2v", image=str(face_inputs)))
    assert out["ok"], out
    assert out["frames"].shape == (9, 64, 64, 3)
    missing = RankWorker(0, 1).run(_request("tiny-cogvideox-i2v", task="i2v", image="/nonexistent.png"))
    assert missing["error"]["stage"] == "inputs" and "not found" in missing["error"]["message"]


def test_consisid_identity_ulysses2_matches_diffusers(local_ray, reference, face_inputs):
    group = ActorGroup.start(GroupSpec("test-consisid-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    try:
        req = _request("tiny-consisid", task="identity", face_image=str(face_inputs))
        _assert_equivalent(group.run(req, timeout_s=180), reference(req))
    finally:
        group.teardown()


def test_consisid_without_embeddings_says_what_to_do(tmp_path):
    from PIL import Image

    face = tmp_path / "face.png"
    Image.fromarray(np.zeros((64, 64, 3), dtype="uint8")).save(face)
    out = RankWorker(0, 1).run(_request("tiny-consisid", task="identity", face_image=str(face)))
    assert not out["ok"] and "precomputed face embeddings" in out["error"]["message"]


def test_real_model_loads_from_a_local_source_and_the_offline_hub_cache(tmp_path, monkeypatch):
    """The loading path of real models, with saved tiny weights standing in:
    spec.model.source local://..., and the catalog's hub id from an offline cache."""
    import shutil

    from videojob_runtime.pipelines import build_tiny_pipeline

    saved = tmp_path / "models" / "cogvideox-2b"
    build_tiny_pipeline("tiny-cogvideox", "t2v", "float32", seed=3).save_pretrained(saved)
    monkeypatch.setenv("VIDEOJOB_MODEL_ROOT", str(tmp_path / "models"))
    req = _request("cogvideox-2b", source="local://cogvideox-2b", steps=2)
    local = RankWorker(0, 1).run(req)
    assert local["ok"], local

    repo = tmp_path / "hub" / "models--THUDM--CogVideoX-2b"
    shutil.copytree(saved, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub = RankWorker(0, 1).run(_request("cogvideox-2b", steps=2))
    assert hub["ok"], hub
    assert float(np.abs(hub["frames"] - local["frames"]).max()) == 0.0


def test_pack_strategy_follows_node_capacity(local_ray):
    from videojob_runtime.group import pack_strategy

    assert pack_strategy([{"CPU": 0.5}, {"CPU": 0.5}]) == "STRICT_PACK"
    assert pack_strategy([{"CPU": 1.0}] * 64) == "PACK"  # more than this node has


def test_teacache_on_consisid_skips_and_stays_close(reference, face_inputs):
    """TeaCache-style output reuse at threshold 0.1 on 8 steps: measured
    accumulated changes 0.019, 0.049, 0.091 (skip) then 0.146 (compute)...:
    half the calls skipped at ~47 dB. Bound: >= 30% skipped and PSNR >= 35 dB
    (the error is then a small fraction of the distance between two seeds)."""
    base = _request("tiny-consisid", task="identity", face_image=str(face_inputs), steps=8)
    off = reference(base)
    out = RankWorker(0, 1).run(_request("tiny-consisid", task="identity", face_image=str(face_inputs), steps=8,
                                        cache="teacache", cache_threshold=0.1))
    assert out["ok"], out
    assert out["cache"]["skipped"] / out["cache"]["calls"] >= 0.30
    assert _psnr(out["frames"], off) >= 35.0


def test_teacache_ranks_agree_under_sequence_parallel(local_ray, face_inputs):
    group = ActorGroup.start(GroupSpec("test-tea-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    try:
        req = _request("tiny-consisid", task="identity", face_image=str(face_inputs), steps=8, cache="teacache",
                       cache_threshold=0.1)
        ranks = ray.get([a.run.remote(vars(req)) for a in group.actors], timeout=180)
        assert all(r["ok"] for r in ranks), ranks
        assert ranks[0]["cache"] == ranks[1]["cache"] and ranks[0]["cache"]["skipped"] > 0
    finally:
        group.teardown()


@pytest.mark.parametrize("kwargs,field", [({"threshold": 0}, "threshold"), ({"warmup_calls": 0}, "warmup_calls")])
def test_teacache_config_rejects_bad_values(kwargs, field):
    from videojob_runtime.teacache import TeaCacheConfig

    with pytest.raises(ValueError, match=field):
        TeaCacheConfig(**kwargs)


def test_uri_locations(monkeypatch):
    from videojob_runtime.locations import local_path
    from videojob_runtime.output import resolve_location

    monkeypatch.setenv("VIDEOJOB_OUTPUT_ROOT", "/data/out")
    monkeypatch.setenv("VIDEOJOB_VOLUMES_ROOT", "/mnt/vols")
    assert str(resolve_location("local://videos/job")) == "/data/out/videos/job"
    assert str(resolve_location("pvc://claim-a/videos/job")) == "/mnt/vols/claim-a/videos/job"
    assert str(local_path("some/dir", "X", "/unused")) == "some/dir"
    with pytest.raises(ValueError, match="unsupported scheme"):
        local_path("s3://bucket/key", "X", "/unused")
