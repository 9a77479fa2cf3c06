"""The runtime on a CPU: real Ray actors, real xfuser USP over gloo, tiny
random-weight models, compared with plain diffusers in one process.

Layout-by-layout equivalence is ``test_layout_matrix.py``; faults, cancel and
cleanup ``test_runtime_faults.py``; ``videojob run`` ``test_run_cli.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("torch")
require_module("xfuser")
ray = require_module("ray")

from helpers import wait_for  # noqa: E402
from videojob_runtime.group import ActorGroup, GroupSpec  # noqa: E402
from videojob_runtime.output import probe_mp4  # noqa: E402
from videojob_runtime.worker import JobRequest, RankWorker  # noqa: E402


def _request(model_id: str = "tiny-cogvideox", **overrides) -> JobRequest:
    base = dict(job_id="t", model_id=model_id, task="t2v", prompt="a tiny test video", width=64, height=64,
                frames=9, fps=8, steps=3, guidance=6.0 if "cog" in model_id else 5.0, seed=7,
                frames_dtype="float32")
    for key in ("image", "face_image"):
        if overrides.get(key) and "://" not in overrides[key]:
            # A test's own file: plain paths are accepted only inside a directory the request names.
            base["local_inputs_dir"] = str(Path(overrides[key]).parent)
    return JobRequest(**{**base, **overrides})


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


@pytest.fixture(scope="module")
def worker():
    return RankWorker(0, 1)


@pytest.fixture(scope="module")
def reference():
    """Plain diffusers in this process (world of one), same weights and seed."""
    one = RankWorker(0, 1)
    cache: dict = {}

    def run(req: JobRequest) -> np.ndarray:
        key = (req.model_id, req.steps, req.guidance, req.seed)
        if key not in cache:
            out = one.run(req)
            assert out["ok"], out
            assert out["collectives"] == 0
            cache[key] = out["frames"]
        return cache[key]

    return run


@pytest.fixture(scope="module")
def ulysses_group(ray_session):
    group = ActorGroup.start(GroupSpec("vj-test-u2", ulysses=2), timeout_s=120, cpus_per_rank=0.5)
    yield group
    group.teardown()


# -- groups ------------------------------------------------------------------

def test_warm_group_does_not_load_again(ulysses_group):
    first = ulysses_group.run(_request(job_id="warm-1"), timeout_s=180)
    second = ulysses_group.run(_request(job_id="warm-2", prompt="another prompt"), timeout_s=180)
    assert first["ok"] and second["ok"]
    assert second["reused_all"] and second["timings"]["load"] == 0.0
    assert second["loads"] == first["loads"]


def test_progress_while_running_and_cancel_between_steps(ulysses_group):
    refs = [a.run.remote(_request(job_id="long", steps=400).to_dict()) for a in ulysses_group.actors]
    try:
        # percent is whole: 4 of 400 steps is the first step that reads 1%.
        progress = wait_for(
            "the long job to pass step 4 (1%)",
            lambda: (p := ulysses_group.progress())["job_id"] == "long" and p["step"] >= 4 and p,
            timeout=120,
        )
        assert progress["steps"] == 400 and 0 < progress["percent"] < 100, progress
    finally:
        # Cancel even when an assertion failed: the next tests share this group.
        ulysses_group.cancel("long")
    results = ray.get(refs, timeout=120)
    steps = {r["error"].get("step") for r in results}
    assert all(r["error"]["reason"] == "Cancelled" and r["consistent"] for r in results)
    assert len(steps) == 1 and steps.pop() < 400, "ranks must stop at the same step"
    assert ulysses_group.run(_request(job_id="after-cancel"), timeout_s=180)["ok"]


def test_detached_group_reattaches_by_name_with_its_placement_group(ulysses_group):
    again = ActorGroup.attach(ulysses_group.spec)
    health = again.health()
    assert [h["rank"] for h in health] == [0, 1] and all(h["distributed"] for h in health)
    assert again.pg is not None and again.pg.id == ulysses_group.pg.id, "re-attach must find the placement group"


def test_group_is_one_pod_and_rendezvous_is_on_the_node_address(ulysses_group):
    """STRICT_PACK always (never spread over pods), and rank 0 advertises its node's IP."""
    assert ray.util.placement_group_table(ulysses_group.pg)["strategy"] == "STRICT_PACK"
    node_ip = ray.util.get_node_ip_address()
    hosts = {h["rendezvous"].rsplit(":", 1)[0] for h in ulysses_group.health()}
    assert hosts == {node_ip}


def test_rank0_holds_its_rendezvous_port_from_the_moment_it_names_it():
    """The port rank 0 announces is already bound by its store: no other process on a
    shared node can take it before the group forms (CI failed on EADDRINUSE when the port
    was only probed free and bound later), and a peer's store reaches it."""
    import datetime
    import socket

    import torch.distributed as dist

    rank0 = RankWorker(0, 2, ulysses=2)  # holds the store: the port lives as long as it does
    host, port = rank0.rendezvous_address("127.0.0.1", timeout_s=10)
    assert host == "127.0.0.1" and port > 0
    with socket.socket() as intruder, pytest.raises(OSError) as taken:
        intruder.bind((host, port))
        intruder.listen()
    assert taken.value.errno == 98, taken.value  # EADDRINUSE
    peer = dist.TCPStore(host, port, 2, False, datetime.timedelta(seconds=10))
    peer.set("hello", "from rank 1")
    assert RankWorker(0, 1).rendezvous_address("127.0.0.1") == ("127.0.0.1", 0), "a world of one binds nothing"


def test_group_names_derive_from_the_owner():
    from videojob_runtime.group import group_name, owner_of

    uid = "0b0e6e3a-5d2f-4c7a-9a43-2f1c9f6c1d2e"
    name = group_name(uid, "u2")
    assert name == f"vj-{uid}-u2" and owner_of(name) == uid and owner_of(f"{name}-pg") == uid
    assert owner_of("someone-else") is None
    with pytest.raises(ValueError, match="owner uid"):
        group_name("../x")


def test_step_cache_under_sequence_parallel(ulysses_group):
    """DBCache on two USP ranks: both ranks skip the same evaluations (cache-dit
    all-reduces its statistics), at least 30% are skipped, and the video stays
    close to cache-off: PSNR >= 35 dB (frames in [0, 1]; two different seeds'
    videos are ~12.5 dB apart on this model, so 35 dB is a small error)."""
    off = ulysses_group.run(_request(job_id="cache-off", steps=8), timeout_s=180)
    assert off["ok"] and off["cache"] is None
    refs = [a.run.remote(_request(job_id="cache-on", steps=8, cache="dbcache", cache_threshold=0.55).to_dict())
            for a in ulysses_group.actors]
    ranks = ray.get(refs, timeout=180)
    assert all(r["ok"] for r in ranks), ranks
    stats = [r["cache"] for r in ranks]
    assert stats[0] == stats[1], f"ranks disagreed: {stats}"
    total = stats[0]["evaluations"] + stats[0]["skipped"]
    assert stats[0]["skipped"] / total >= 0.30, stats
    frames = next(r["frames"] for r in ranks if r["frames"] is not None)
    assert _psnr(frames, off["frames"]) >= 35.0


def test_teacache_ranks_agree_under_sequence_parallel(ulysses_group, face_inputs):
    req = _request("tiny-consisid", task="identity", face_image=str(face_inputs), steps=8, cache="teacache",
                   cache_threshold=0.1)
    ranks = ray.get([a.run.remote(req.to_dict()) for a in ulysses_group.actors], timeout=180)
    assert all(r["ok"] for r in ranks), ranks
    assert ranks[0]["cache"] == ranks[1]["cache"] and ranks[0]["cache"]["skipped"] > 0


# -- one rank ----------------------------------------------------------------

@pytest.mark.parametrize("cache,threshold", [("dbcache", 1.0), ("fbcache", 1e9), ("teacache", 1e9)])
def test_step_cache_survives_model_offload_rearming_on_a_warm_pipeline(worker, cache, threshold):
    """diffusers re-installs model offload's hooks after every call: a cache
    applied before offload (strategies.order) keeps skipping on the next jobs."""
    stats = []
    for job in range(3):
        out = worker.run(_request(job_id=f"warm-{cache}-{job}", offload="model", cache=cache,
                                  cache_threshold=threshold))
        assert out["ok"], out
        assert out["reused"] == (job > 0)
        stats.append(out["cache"])
    assert stats[0]["skipped"] > 0 and stats[1] == stats[0] == stats[2]


def test_teacache_on_wan_keeps_guidance(worker):
    """Wan calls the denoiser twice per step (cond, uncond). One shared history
    would reuse the cond output for uncond and drop guidance: the guided video
    would equal the conditional-only one."""
    guided = worker.run(_request("tiny-wan", job_id="wan-guided", cache="teacache", cache_threshold=1e9, steps=4))
    cond_only = worker.run(_request("tiny-wan", job_id="wan-cond", cache="teacache", cache_threshold=1e9,
                                    steps=4, guidance=1.0))
    assert guided["ok"] and cond_only["ok"]
    assert guided["cache"]["calls"] == 8 and cond_only["cache"]["calls"] == 4
    assert guided["cache"]["skipped"] == 6, "each branch computes its first call, then reuses"
    assert float(np.abs(guided["frames"] - cond_only["frames"]).max()) > 1e-3


def test_teacache_on_consisid_skips_and_stays_close(worker, reference, face_inputs):
    """TeaCache-style output reuse at threshold 0.1 on 8 steps: measured
    accumulated changes 0.019, 0.049, 0.091 (skip) then 0.146 (compute)...:
    half the calls skipped at ~47 dB. Bound: >= 30% skipped and PSNR >= 35 dB
    (the error is then a small fraction of the distance between two seeds)."""
    base = _request("tiny-consisid", task="identity", face_image=str(face_inputs), steps=8)
    off = reference(base)
    out = worker.run(_request("tiny-consisid", task="identity", face_image=str(face_inputs), steps=8,
                              cache="teacache", cache_threshold=0.1))
    assert out["ok"], out
    assert out["cache"]["skipped"] / out["cache"]["calls"] >= 0.30
    assert _psnr(out["frames"], off) >= 35.0


@pytest.mark.parametrize("kwargs,field", [({"threshold": 0}, "threshold"), ({"warmup_calls": 0}, "warmup_calls"),
                                          ({"calls_per_step": 3}, "calls_per_step")])
def test_teacache_config_rejects_bad_values(kwargs, field):
    from videojob_runtime.teacache import TeaCacheConfig

    with pytest.raises(ValueError, match=field):
        TeaCacheConfig(**kwargs)


def test_mp4_has_frames_size_and_fps_and_a_digest(worker, tmp_path):
    out = worker.run(_request(job_id="mp4", fps=12, output_dir=str(tmp_path), output_name="clip"))
    assert out["ok"], out
    assert probe_mp4(tmp_path / "clip.mp4") == {"codec": "h264", "width": 64, "height": 64, "fps": 12.0, "frames": 9}
    result = json.loads((tmp_path / "clip.json").read_text())
    assert result["output"]["frames"] == 9 and result["measured"]["peakGiB"] > 0
    assert result["framesDigest"] == out["frames_digest"] and result["seed"] == 7
    assert (tmp_path / "clip.png").stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.json", "clip.mp4", "clip.png"]


def test_frames_digest_and_mp4_bytes_are_reproducible(worker, tmp_path):
    """Same seed: the same digest (and, on one machine, the same mp4 bytes);
    another seed: another digest."""
    runs = [worker.run(_request(job_id=f"rep-{i}", seed=seed, output_dir=str(tmp_path / str(i)), output_name="v"))
            for i, seed in enumerate((5, 5, 6))]
    assert all(r["ok"] for r in runs)
    assert runs[0]["frames_digest"] == runs[1]["frames_digest"] != runs[2]["frames_digest"]
    assert (tmp_path / "0" / "v.mp4").read_bytes() == (tmp_path / "1" / "v.mp4").read_bytes()


def test_missing_model_source_is_actionable(worker):
    out = worker.run(_request("cogvideox-2b", source="local://nowhere/cogvideox"))
    assert not out["ok"]
    assert out["error"]["reason"] == "ModelSourceMissing" and "spec.model.source" in out["error"]["message"]


def test_cogvideox_image_to_video(worker, face_inputs):
    out = worker.run(_request("tiny-cogvideox-i2v", task="i2v", image=str(face_inputs)))
    assert out["ok"], out
    assert out["frames"].shape == (9, 64, 64, 3)
    missing = worker.run(_request("tiny-cogvideox-i2v", task="i2v", image="/nonexistent.png"))
    assert missing["error"]["stage"] == "inputs" and "not found" in missing["error"]["message"]


def test_consisid_without_embeddings_says_what_to_do(worker, tmp_path):
    from PIL import Image

    face = tmp_path / "face.png"
    Image.fromarray(np.zeros((64, 64, 3), dtype="uint8")).save(face)
    out = worker.run(_request("tiny-consisid", task="identity", face_image=str(face)))
    assert not out["ok"] and "precomputed face embeddings" in out["error"]["message"]


def _hub_snapshot(hub, repo: str, commit: str, source, branch: str | None = None) -> None:
    import shutil

    folder = hub / ("models--" + repo.replace("/", "--"))
    shutil.copytree(source, folder / "snapshots" / commit)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    if branch:
        (folder / "refs" / branch).write_text(commit)


def test_real_model_loads_from_a_local_source_the_offline_hub_cache_and_a_revision(tmp_path, monkeypatch):
    """The loading path of real models, with saved tiny weights standing in:
    spec.model.source local://..., the catalog's hub id from an offline cache,
    and hf://ORG/NAME@REV picking that revision's weights."""
    from videojob_runtime.pipelines import build_tiny_pipeline

    saved, other = tmp_path / "models" / "cogvideox-2b", tmp_path / "models" / "other"
    build_tiny_pipeline("tiny-cogvideox", "t2v", "float32", seed=3).save_pretrained(saved)
    build_tiny_pipeline("tiny-cogvideox", "t2v", "float32", seed=4).save_pretrained(other)
    monkeypatch.setenv("VIDEOJOB_MODEL_ROOT", str(tmp_path / "models"))
    local = RankWorker(0, 1).run(_request("cogvideox-2b", source="local://cogvideox-2b", steps=2))
    assert local["ok"], local

    hub = tmp_path / "hub"
    _hub_snapshot(hub, "THUDM/CogVideoX-2b", "0123abcd" * 5, saved, branch="main")
    _hub_snapshot(hub, "THUDM/CogVideoX-2b", "fedcba98" * 5, other, branch="v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    worker = RankWorker(0, 1)
    default = worker.run(_request("cogvideox-2b", steps=2))
    assert default["ok"], default
    assert float(np.abs(default["frames"] - local["frames"]).max()) == 0.0
    for revision in ("fedcba98" * 5, "v2"):
        pinned = worker.run(_request("cogvideox-2b", source=f"hf://THUDM/CogVideoX-2b@{revision}", steps=2))
        assert pinned["ok"], pinned
        assert float(np.abs(pinned["frames"] - default["frames"]).max()) > 1e-3, "the revision's weights"
    missing = worker.run(_request("cogvideox-2b", source="hf://THUDM/CogVideoX-2b@nope", steps=2))
    assert missing["error"]["reason"] == "ModelSourceMissing" and "@nope" in missing["error"]["message"]


def test_prompts_are_encoded_at_the_pipelines_own_length():
    """Wan pads prompts to 512 tokens, CogVideoX to 226: the catalog's one fact."""
    from videojob_runtime.generate import pipeline_kwargs

    class Pipe:
        def __call__(self, prompt=None, max_sequence_length=226, **kwargs):  # noqa: D401 - a signature only
            raise AssertionError("not called")

    for model_id, tokens in (("wan2.1-t2v-1.3b", 512), ("wan2.1-t2v-14b", 512), ("cogvideox-5b", 226),
                             ("tiny-wan", 16)):
        kwargs = pipeline_kwargs(Pipe(), _request(model_id), {}, on_step_end=None)
        assert kwargs["max_sequence_length"] == tokens, model_id


def test_uri_locations(monkeypatch, tmp_path):
    """Each kind under its root; a plain path only inside a directory the caller names;
    other schemes refused naming the field (tests/test_containment.py has the hostile table)."""
    from videojob_runtime.errors import JobFailure
    from videojob_runtime.locations import resolve
    from videojob_runtime.output import resolve_location

    monkeypatch.setenv("VIDEOJOB_OUTPUT_ROOT", "/data/out")
    monkeypatch.setenv("VIDEOJOB_DATA_ROOT", "/data/in")
    monkeypatch.setenv("VIDEOJOB_MODEL_ROOT", "/data/models")
    monkeypatch.setenv("VIDEOJOB_VOLUMES_ROOT", "/mnt/vols")
    assert str(resolve_location("local://videos/job")) == "/data/out/videos/job"
    assert str(resolve_location("pvc://claim-a/videos/job")) == "/mnt/vols/claim-a/videos/job"
    assert str(resolve_location("pvc://claim-a")) == "/mnt/vols/claim-a"
    assert str(resolve("local://a.png", "input", "spec.image")) == "/data/in/a.png"
    assert str(resolve("local://m/cogvideox", "source", "spec.model.source")) == "/data/models/m/cogvideox"
    assert str(resolve("local://x", "output", "spec.output.uri", root=tmp_path)) == str(tmp_path.resolve() / "x")
    assert resolve("some/dir", "output", "spec.output.uri", local_dir=tmp_path) == tmp_path.resolve() / "some/dir"
    with pytest.raises(JobFailure, match="spec.output.uri: 'some/dir' has no scheme"):
        resolve("some/dir", "output", "spec.output.uri")
    with pytest.raises(JobFailure, match="spec.output.uri: 'gs://bucket/key' must start with one of"):
        resolve("gs://bucket/key", "output", "spec.output.uri")
    with pytest.raises(JobFailure, match="spec.output.uri: 's3://bucket/key' is not a file on this machine"):
        resolve("s3://bucket/key", "output", "spec.output.uri")
    with pytest.raises(JobFailure, match="spec.model.source: 'hf://a/b' is not a file on this machine"):
        resolve("hf://a/b", "source", "spec.model.source")
