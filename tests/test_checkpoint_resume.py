"""Denoising checkpoints: the file format refuses what it must, and a job
interrupted after step k resumes from its checkpoint with frames bit-identical
to an uninterrupted run (one rank, cache off), for every family with a
denoising loop and the schedulers they ship with (CogVideoX DDIM and DPM,
ConsisID, Wan with flow-matching Euler and UniPC, I2VGen-XL and AnimateDiff's
DDIM). Real diffusers pipelines with tiny random weights, in this process."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import require_module

require_module("torch")
require_module("diffusers")

from videojob_runtime.checkpoint import CheckpointStore, file_name, fingerprint  # noqa: E402
from videojob_runtime.request import JobRequest  # noqa: E402
from videojob_runtime.worker import RankWorker  # noqa: E402

STEPS = 6


def _state(value: float = 1.0) -> dict:
    import torch

    return {"outputs": [torch.full((2, 3), value)], "scheduler": {"_step_index": 3, "model_outputs": [None]}}


# -- the file format ------------------------------------------------------------

def test_a_checkpoint_reads_back_and_the_store_keeps_the_two_newest(tmp_path):
    store = CheckpointStore(tmp_path / "ck", "f" * 64, steps=10)
    for step in (2, 4, 6):
        path, nbytes, _ = store.save(step, _state(step))
        assert path.name == file_name(step) and nbytes == path.stat().st_size
    assert store.steps_on_disk() == [6, 4], "only the two newest are kept"
    found = store.newest()
    assert found.checkpoint.step == 6 and found.refused == []
    assert float(found.checkpoint.state["outputs"][0][0, 0]) == 6.0
    assert not list((tmp_path / "ck").glob(".*tmp*")), "no temporary file is left"
    assert oct((tmp_path / "ck" / file_name(6)).stat().st_mode & 0o777) == "0o600"
    store.remove()
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[: len(b) - 7], "not signed"),
    (lambda b: b[:-40] + bytes([b[-40] ^ 0xFF]) + b[-39:], "not signed"),
    (lambda b: b[:30], "not signed"),
    (lambda b: b"not a checkpoint at all", "magic"),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, damage, why):
    store = CheckpointStore(tmp_path, "a" * 64, steps=10)
    store.save(2, _state(2))
    path, _, _ = store.save(4, _state(4))
    path.write_bytes(damage(path.read_bytes()))
    found = store.newest()
    assert found.checkpoint is not None and found.checkpoint.step == 2
    assert len(found.refused) == 1 and found.refused[0].startswith(file_name(4)) and why in found.refused[0], \
        found.refused


def test_a_foreign_checkpoint_is_never_used(tmp_path):
    CheckpointStore(tmp_path, "b" * 64, steps=10).save(4, _state())
    other_spec = CheckpointStore(tmp_path, "c" * 64, steps=10).newest()
    assert other_spec.checkpoint is None and "not signed for this job" in other_spec.refused[0]
    other_steps = CheckpointStore(tmp_path, "b" * 64, steps=12).newest()
    assert other_steps.checkpoint is None and "10 steps" in other_steps.refused[0]
    renamed = tmp_path / file_name(6)
    (tmp_path / file_name(4)).rename(renamed)  # a file renamed to claim another step
    moved = CheckpointStore(tmp_path, "b" * 64, steps=10).newest()
    assert moved.checkpoint is None and "step 4" in moved.refused[0]


def test_only_a_checkpoint_signed_for_the_job_is_read(tmp_path, monkeypatch):
    """Issue 36, 14: the files lie in the tenant's own directory. One signed with a key the
    tenant could know (anything but the runtime key), one of the same spec from another
    namespace, and an unsigned one of the old format are refused before any byte of them is
    parsed; the job's own reads back. The key comes from the runtime key file: another file
    (another cluster, or a forged key) reads none of them."""
    import hashlib
    import json
    import struct

    from videojob import runtimekey
    from videojob_runtime import checkpoint

    key_file = tmp_path / "runtime-key"
    key_file.write_text("k" * 64)
    monkeypatch.setenv(runtimekey.KEY_ENV, str(key_file))
    fp = "e" * 64
    ours = checkpoint.job_key("team-a", fp)
    assert ours == checkpoint.job_key("team-a", fp) != checkpoint.job_key("team-b", fp)
    ck = tmp_path / "ck"
    CheckpointStore(ck, fp, steps=10, key=hashlib.sha256(b"a tenant's guess").digest()).save(8, _state(8))
    CheckpointStore(ck, fp, steps=10, key=checkpoint.job_key("team-b", fp)).save(6, _state(6))
    payload = b"\x80\x02}q\x00."  # format 1: no signature
    header = json.dumps({"format": 1, "fingerprint": fp, "step": 4, "steps": 10, "size": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    (ck / file_name(4)).write_bytes(checkpoint.MAGIC + struct.pack(">Q", len(header)) + header + payload)
    found = CheckpointStore(ck, fp, steps=10, key=ours, keep=5).newest()
    assert found.checkpoint is None and len(found.refused) == 3, found.refused
    assert all("not signed for this job" in why for why in found.refused), found.refused
    CheckpointStore(ck, fp, steps=10, key=ours, keep=5).save(2, _state(2))
    assert CheckpointStore(ck, fp, steps=10, key=ours, keep=5).newest().checkpoint.step == 2
    other = tmp_path / "other-key"
    other.write_text("o" * 64)
    monkeypatch.setenv(runtimekey.KEY_ENV, str(other))
    elsewhere = CheckpointStore(ck, fp, steps=10, key=checkpoint.job_key("team-a", fp), keep=5).newest()
    assert elsewhere.checkpoint is None and len(elsewhere.refused) == 4


def test_a_checkpoint_cannot_run_code_when_loaded(tmp_path):
    """The payload is read with weights_only: a pickle that would run code is refused."""
    import hashlib
    import json
    import pickle
    import struct

    from videojob_runtime import checkpoint

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    payload = pickle.dumps({"x": Boom()}, protocol=2)
    header = json.dumps({"format": checkpoint.FORMAT, "fingerprint": "d" * 64, "step": 2, "steps": 10,
                         "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    signed = checkpoint.MAGIC + struct.pack(">Q", len(header)) + header + payload
    store = CheckpointStore(tmp_path, "d" * 64, steps=10)  # signed with the job's own key: weights_only still refuses
    (tmp_path / file_name(2)).write_bytes(signed + checkpoint._tag(store.key, signed))
    found = store.newest()
    assert found.checkpoint is None and "unsafe payload" in found.refused[0], found
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("bad", [{"step": 0}, {"set_timesteps": 1.0}, {"config": {}}, {"__class__": 1},
                                 {"order": "x"}, {"not an identifier": 1}, {"timesteps": 3}, {"betas": [1, 2]}])
def test_a_checkpoint_sets_no_scheduler_attribute_a_checkpoint_does_not_keep(bad):
    """Issue 36, 14: restore set every saved name on the scheduler (a rank's scheduler outlives the
    job when its group is reused): a name its class defines, the config, or a value of another
    kind than the attribute's is refused whole, before anything is set."""
    torch = require_module("torch")
    from diffusers import DDIMScheduler

    from videojob_runtime.resume import restore_scheduler_state, scheduler_state

    scheduler = DDIMScheduler()
    scheduler.set_timesteps(4)
    before = dict(vars(scheduler))
    saved = scheduler_state(scheduler)
    with pytest.raises(ValueError, match="checkpoint"):
        restore_scheduler_state(scheduler, {**saved, "timesteps": torch.zeros(4, dtype=torch.long), **bad}, "cpu")
    assert vars(scheduler).keys() == before.keys() and scheduler.timesteps.tolist() == before["timesteps"].tolist()
    restore_scheduler_state(scheduler, {**saved, "made_during_steps": torch.ones(1)}, "cpu")  # a new data attribute
    assert scheduler.timesteps.tolist() == before["timesteps"].tolist()


def test_the_fingerprint_follows_what_changes_the_frames():
    base = dict(model_id="tiny-wan", prompt="p", steps=4, seed=1, width=64)
    assert fingerprint(base) == fingerprint({**base, "output_dir": "/elsewhere", "job_id": "other"})
    assert fingerprint(base) != fingerprint({**base, "seed": 2})
    assert fingerprint(base) != fingerprint({**base, "prompt": "q"})
    assert fingerprint(base, {"image": b"1"}) != fingerprint(base, {"image": b"2"})
    # Issue 36, 14: an input counts by its bytes, not where it was staged (an https input's
    # path is new each attempt, and its job must resume).
    staged = {**base, "image": "/staging/vj-inputs-a1-x/image.png"}
    assert fingerprint(staged, {"image": b"1"}) == fingerprint({**base, "image": "/staging/a2-y/image.png"},
                                                               {"image": b"1"})


def test_bad_checkpoint_settings_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every_steps"):
        JobRequest(job_id="x", model_id="tiny-wan", task="t2v", prompt="p", width=64, height=64, frames=9, fps=8,
                   steps=4, guidance=5.0, checkpoint_every_steps=-1)
    with pytest.raises(ValueError, match="keep"):
        CheckpointStore(tmp_path, "e" * 64, steps=4, keep=0)


# -- resume through the real pipelines -------------------------------------------

FAMILIES = [
    ("tiny-cogvideox", "t2v", None),
    ("tiny-cogvideox", "t2v", "CogVideoXDPMScheduler"),
    ("tiny-consisid", "identity", None),
    ("tiny-wan", "t2v", None),
    ("tiny-wan", "t2v", "UniPCMultistepScheduler"),
    ("tiny-i2vgen-xl", "i2v", None),
    ("tiny-animatediff", "t2v", None),
]


def _request(model_id: str, task: str, inputs: Path, ckdir: Path | None, **extra) -> JobRequest:
    data = dict(job_id="resume", model_id=model_id, task=task, prompt="a resumed tiny video", width=64, height=64,
                frames=9, fps=8, steps=STEPS, guidance=6.0 if "cog" in model_id else 5.0, seed=11,
                frames_dtype="float32", track_memory=False)
    if task == "i2v":
        data.update(image=str(inputs), local_inputs_dir=str(inputs.parent))
    if task == "identity":
        data.update(face_image=str(inputs), local_inputs_dir=str(inputs.parent))
    if model_id == "tiny-animatediff":
        data.update(frames=8, width=32, height=32)
    if ckdir is not None:
        data.update(checkpoint_dir=str(ckdir))
    return JobRequest(**{**data, **extra})


def _swap_scheduler(worker: RankWorker, req: JobRequest, name: str | None) -> None:
    worker.load(req)
    if name is None:
        return
    import diffusers

    from videojob_runtime.pipelines import inner_pipeline

    inner = inner_pipeline(worker.pipe)
    cls = getattr(diffusers, name)
    if name == "UniPCMultistepScheduler":  # Wan's published scheduler: flow prediction
        inner.scheduler = cls(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    else:
        inner.scheduler = cls.from_config(inner.scheduler.config)


@pytest.mark.parametrize("model_id, task, scheduler", FAMILIES,
                         ids=[f"{m}-{s or 'default'}" for m, _, s in FAMILIES])
def test_an_interrupted_job_resumes_bit_identical(tmp_path, face_inputs, model_id, task, scheduler):
    worker = RankWorker(0, 1)
    ckdir = tmp_path / "checkpoints"
    _swap_scheduler(worker, _request(model_id, task, face_inputs, None), scheduler)
    whole = worker.run(_request(model_id, task, face_inputs, None))
    assert whole["ok"], whole.get("error")

    # Attempt 1 saves after steps 2 and 4, then fails after step 5: the newest is step 4.
    failed = worker.run(_request(model_id, task, face_inputs, ckdir, checkpoint_every_steps=2,
                                 inject_fault={"stage": "denoise", "step": 5}))
    assert not failed["ok"] and failed["error"].get("step") == 5, failed["error"]
    assert sorted(p.name for p in ckdir.iterdir()) == [file_name(2), file_name(4)]

    resumed = worker.run(_request(model_id, task, face_inputs, ckdir, checkpoint_every_steps=2))
    assert resumed["ok"], resumed.get("error")
    assert resumed["checkpoints"]["resumedFromStep"] == 4 and resumed["checkpoints"]["refused"] == []
    assert np.array_equal(resumed["frames"], whole["frames"]), \
        f"max difference {np.abs(resumed['frames'] - whole['frames']).max()}"
    assert not ckdir.exists(), "the checkpoints are removed after success"


def test_an_input_staged_elsewhere_by_the_next_attempt_still_resumes(tmp_path, face_inputs):
    """Issue 36, 14: an https input is staged under a new directory each attempt; the
    checkpoint is keyed on the image's bytes, so the next attempt resumes."""
    import shutil

    worker = RankWorker(0, 1)
    ckdir = tmp_path / "checkpoints"
    first, second = tmp_path / "vj-inputs-a1", tmp_path / "vj-inputs-a2"
    for where in (first, second):
        where.mkdir()
        shutil.copy(face_inputs, where / "image.png")
    failed = worker.run(_request("tiny-i2vgen-xl", "i2v", first / "image.png", ckdir, checkpoint_every_steps=2,
                                 inject_fault={"stage": "denoise", "step": 3}))
    assert not failed["ok"] and [p.name for p in ckdir.iterdir()] == [file_name(2)]
    resumed = worker.run(_request("tiny-i2vgen-xl", "i2v", second / "image.png", ckdir))
    assert resumed["ok"] and resumed["checkpoints"]["resumedFromStep"] == 2, resumed.get("checkpoints")


def test_a_corrupt_newest_checkpoint_resumes_from_the_older_one(tmp_path, face_inputs):
    worker = RankWorker(0, 1)
    ckdir = tmp_path / "checkpoints"
    whole = worker.run(_request("tiny-wan", "t2v", face_inputs, None))
    worker.run(_request("tiny-wan", "t2v", face_inputs, ckdir, checkpoint_every_steps=2,
                        inject_fault={"stage": "denoise", "step": 5}))
    newest = ckdir / file_name(4)
    data = bytearray(newest.read_bytes())
    data[-100] ^= 0x55
    newest.write_bytes(bytes(data))
    resumed = worker.run(_request("tiny-wan", "t2v", face_inputs, ckdir))
    assert resumed["ok"] and resumed["checkpoints"]["resumedFromStep"] == 2, resumed.get("checkpoints")
    assert "not signed" in resumed["checkpoints"]["refused"][0]
    assert np.array_equal(resumed["frames"], whole["frames"])


def test_a_checkpoint_of_another_seed_is_not_resumed(tmp_path, face_inputs):
    worker = RankWorker(0, 1)
    ckdir = tmp_path / "checkpoints"
    worker.run(_request("tiny-wan", "t2v", face_inputs, ckdir, checkpoint_every_steps=2,
                        inject_fault={"stage": "denoise", "step": 3}))
    assert (ckdir / file_name(2)).exists()
    other = worker.run(_request("tiny-wan", "t2v", face_inputs, ckdir, seed=12))
    assert other["ok"] and other["checkpoints"]["resumedFromStep"] == 0
    assert "not signed for this job" in other["checkpoints"]["refused"][0]


def test_with_a_step_cache_the_resumed_frames_stay_close(tmp_path, face_inputs):
    """DBCache is not saved in a checkpoint: after the resume it starts fresh (its
    warm-up computes again). The frames then differ a little from the uninterrupted
    cached run; the PSNR is reported and must stay >= 30 dB (frames in [0, 1])."""
    worker = RankWorker(0, 1)
    ckdir = tmp_path / "checkpoints"
    cached = dict(cache="dbcache", cache_threshold=0.5, steps=8)
    whole = worker.run(_request("tiny-cogvideox", "t2v", face_inputs, None, **cached))
    assert whole["ok"] and whole["cache"]["skipped"] > 0, whole.get("cache")
    worker.run(_request("tiny-cogvideox", "t2v", face_inputs, ckdir, checkpoint_every_steps=4,
                        inject_fault={"stage": "denoise", "step": 6}, **cached))
    resumed = worker.run(_request("tiny-cogvideox", "t2v", face_inputs, ckdir, **cached))
    assert resumed["ok"] and resumed["checkpoints"]["resumedFromStep"] == 4, resumed.get("checkpoints")
    mse = float(np.mean((resumed["frames"].astype(np.float64) - whole["frames"]) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)
    print(f"resumed with dbcache: PSNR {psnr:.1f} dB against the uninterrupted cached run")
    assert psnr >= 30.0, psnr
