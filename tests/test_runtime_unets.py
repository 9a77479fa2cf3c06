"""The UNet catalog families on one rank: tiny random-weight I2VGen-XL (i2v)
and AnimateDiff (t2v) through ``RankWorker(0, 1)``, no Ray, no download."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import require_module  # noqa: E402 - a skip, or a failure where required

require_module("torch")
require_module("diffusers")

from helpers import REPO  # noqa: E402
from videojob_runtime.output import probe_mp4  # noqa: E402
from videojob_runtime.worker import JobRequest, RankWorker  # noqa: E402

MODELS = {"tiny-i2vgen-xl": "i2v", "tiny-animatediff": "t2v"}


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    from PIL import Image

    path = tmp_path_factory.mktemp("inputs") / "start.png"
    yy, xx = np.mgrid[0:64, 0:64]
    rgb = np.stack([xx * 4, yy * 4, (xx + yy) * 2], axis=-1).clip(0, 255).astype("uint8")
    Image.fromarray(rgb).save(path)
    return str(path)


@pytest.fixture(scope="module")
def worker() -> RankWorker:
    return RankWorker(0, 1)


def _request(model_id: str, image: str, **overrides) -> JobRequest:
    task = MODELS[model_id]
    base = dict(job_id="unet", model_id=model_id, task=task, prompt="a small red boat on a lake",
                negative_prompt="blurry", width=64, height=64, frames=8, fps=8, steps=2, guidance=7.5,
                seed=11, image=image if task == "i2v" else None, frames_dtype="float32",
                local_inputs_dir=str(Path(image).parent) if image else None)  # the test's own image, inside it
    return JobRequest(**{**base, **overrides})


@pytest.mark.parametrize("model_id", list(MODELS))
def test_tiny_unet_runs_and_is_deterministic(worker, image, model_id):
    first = worker.run(_request(model_id, image))
    assert first["ok"], first
    assert first["frames_shape"] == [8, 64, 64, 3]
    frames = first["frames"]
    assert frames.shape == (8, 64, 64, 3) and frames.dtype == np.float32
    assert np.isfinite(frames).all()
    # Every step reached the worker's callback (progress, cancel votes, stage times).
    assert worker.progress.step == 2 and worker.progress.state == "done"
    assert first["timings"]["denoise"] > 0

    again = worker.run(_request(model_id, image))
    assert again["ok"], again
    assert again["reused"]
    np.testing.assert_array_equal(again["frames"], frames)

    # A fresh build from the same (model, dtype, seed): same weights, same video.
    rebuilt = RankWorker(0, 1).run(_request(model_id, image))
    assert rebuilt["ok"], rebuilt
    np.testing.assert_array_equal(rebuilt["frames"], frames)


@pytest.mark.parametrize("model_id", list(MODELS))
def test_tiny_unet_writes_mp4(worker, image, model_id, tmp_path):
    result = worker.run(_request(model_id, image, steps=3, frames_dtype="uint8", output_dir=str(tmp_path),
                                 output_name=model_id))
    assert result["ok"], result
    assert result["frames"] is None
    video = probe_mp4(tmp_path / f"{model_id}.mp4")
    assert video["frames"] == 8
    assert (video["width"], video["height"]) == (64, 64)
    assert (tmp_path / f"{model_id}.png").exists()
    summary = json.loads((tmp_path / f"{model_id}.json").read_text())
    assert summary["model"] == model_id


def test_i2vgen_xl_needs_an_image(worker):
    result = worker.run(_request("tiny-i2vgen-xl", image=None))
    assert not result["ok"]
    assert result["error"]["stage"] == "inputs"


@pytest.mark.parametrize("gpus", [1, 4])
def test_plan_tiny_animatediff_uses_one_gpu(gpus):
    """UNets do not run sequence-parallel: one GPU even where four are free."""
    proc = subprocess.run([sys.executable, "-m", "videojob.cli", "plan", "--model", "tiny-animatediff",
                           "--gpus", str(gpus), "--json"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    chosen = json.loads(proc.stdout)["chosen"]
    assert chosen["gpus"] == 1 and chosen["ulysses"] == chosen["ring"] == chosen["cfg"] == 1, chosen


def _save_hub_repo(hub, repo: str, save) -> None:
    """A snapshot of ``repo`` in an offline hub cache, written by ``save(folder)``."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    commit = "5eed" * 10
    save(folder / "snapshots" / commit)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)


def test_animatediff_loads_from_its_real_layout(tmp_path, monkeypatch):
    """A motion adapter repo plus a Stable Diffusion 1.5 base pipeline (the
    catalog's hub ids, from the offline cache), as AnimateDiff is published;
    and a saved AnimateDiffPipeline from a local source. Tiny random weights
    stand in; the frames equal those of the same parts assembled in memory."""
    import torch
    from diffusers import AnimateDiffPipeline, DDIMScheduler, MotionAdapter, StableDiffusionPipeline, UNet2DConditionModel

    from videojob.catalog import get_model
    from videojob_runtime.configs import _TINY_MOTION_ADAPTER, _TINY_SD_UNET, build_component
    from videojob_runtime.pipelines import _scheduler, clip_text_model_compat, tiny_clip_tokenizer

    torch.manual_seed(0)
    unet2d = UNet2DConditionModel(**_TINY_SD_UNET).eval()
    adapter = MotionAdapter(**_TINY_MOTION_ADAPTER).eval()
    parts = {name: build_component("tiny-animatediff", name, "float32").eval() for name in ("text_encoder", "vae")}
    base = StableDiffusionPipeline(unet=unet2d, tokenizer=tiny_clip_tokenizer(), scheduler=_scheduler(
        get_model("animatediff").family), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False, **parts)
    hub = tmp_path / "hub"
    _save_hub_repo(hub, get_model("animatediff").hub_id, adapter.save_pretrained)
    _save_hub_repo(hub, get_model("animatediff").base_hub_id, base.save_pretrained)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))

    req = dict(job_id="ad", model_id="animatediff", task="t2v", prompt="a small red boat", width=64, height=64,
               frames=8, fps=8, steps=2, guidance=7.5, seed=3, frames_dtype="float32")
    loaded = RankWorker(0, 1).run(JobRequest(**req))
    assert loaded["ok"], loaded

    expected_pipe = clip_text_model_compat(AnimateDiffPipeline(
        unet=unet2d, motion_adapter=adapter, tokenizer=tiny_clip_tokenizer(), **parts,
        scheduler=DDIMScheduler.from_config(base.scheduler.config, clip_sample=False, beta_schedule="linear",
                                            timestep_spacing="linspace", steps_offset=1)))
    expected_pipe.set_progress_bar_config(disable=True)
    torch.manual_seed(3)
    expected = expected_pipe(prompt="a small red boat", negative_prompt="", height=64, width=64, num_frames=8,
                             num_inference_steps=2, guidance_scale=7.5, output_type="np",
                             generator=torch.Generator().manual_seed(3)).frames[0]
    assert float(np.abs(loaded["frames"] - expected).max()) <= 1e-5

    saved = tmp_path / "models" / "animatediff-full"
    expected_pipe.save_pretrained(saved)
    monkeypatch.setenv("VIDEOJOB_MODEL_ROOT", str(tmp_path / "models"))
    local = RankWorker(0, 1).run(JobRequest(**{**req, "source": "local://animatediff-full"}))
    assert local["ok"], local
    assert float(np.abs(local["frames"] - expected).max()) <= 1e-5

    wrong = RankWorker(0, 1).run(JobRequest(**{**req, "source": "local://nowhere"}))
    assert wrong["error"]["reason"] == "ModelSourceMissing" and "spec.model.source" in wrong["error"]["message"]
