"""Build the diffusers pipeline a job needs.

Tiny catalog models (``tiny-*``) are built from the configs in ``configs.py``
with random weights seeded per component, so every rank (and a reference
run in one process) gets bit-identical weights with no download. Real models
load from a local directory, a mounted volume, or a hub id resolved from an
offline cache (HF_HUB_OFFLINE); a missing source is a clear error.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

import torch

from videojob.catalog import Family, get_model

from .configs import build_component
from .errors import ModelSourceMissing
from .locations import local_path

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# diffusers pipeline classes per family and task.
_PIPELINES = {
    (Family.COGVIDEOX, "t2v"): "CogVideoXPipeline",
    (Family.COGVIDEOX, "i2v"): "CogVideoXImageToVideoPipeline",
    (Family.CONSISID, "identity"): "ConsisIDPipeline",
    (Family.WAN, "t2v"): "WanPipeline",
    (Family.I2VGEN_XL, "i2v"): "I2VGenXLPipeline",
    (Family.ANIMATEDIFF, "t2v"): "AnimateDiffPipeline",
}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def tiny_tokenizer():
    """A T5 Unigram tokenizer built in memory: single characters and
    word-initial characters, ids below the tiny text encoders' 256 entries."""
    from transformers import T5Tokenizer

    chars = string.ascii_letters + string.digits + ".,!?'-:;()"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in chars] + [("\u2581" + c, -2.5) for c in chars]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


# CLIP's byte-level alphabet for printable ASCII is the characters themselves.
_CLIP_CHARS = string.ascii_letters + string.digits + ".,!?'-:;()"


def tiny_clip_tokenizer(max_length: int = 16):
    """A CLIP BPE tokenizer built in memory (no merges: words split into
    characters, the last one with CLIP's ``</w>`` end-of-word marker); ids
    below the tiny CLIP text encoder's 256 entries, prompts padded to 16."""
    from transformers import CLIPTokenizer

    tokens = ["<|startoftext|>", "<|endoftext|>"] + list(_CLIP_CHARS) + [c + "</w>" for c in _CLIP_CHARS]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_clip_image_processor():
    """The CLIP image preprocessing at the tiny image encoder's 32 pixels."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def _scheduler(family: Family):
    from diffusers import CogVideoXDDIMScheduler, DDIMScheduler, FlowMatchEulerDiscreteScheduler

    if family in (Family.COGVIDEOX, Family.CONSISID):
        # CogVideoX's published scheduler settings (scheduler/scheduler_config.json).
        return CogVideoXDDIMScheduler(
            beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
            num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
            set_alpha_to_one=True, timestep_spacing="trailing",
        )
    if family == Family.I2VGEN_XL:
        # I2VGen-XL's DDIM settings (cosine betas, v-prediction, zero terminal SNR), from
        # ali-vilab/i2vgen-xl scheduler/scheduler_config.json as remembered: not re-read offline.
        return DDIMScheduler(
            beta_schedule="squaredcos_cap_v2", beta_start=0.0001, beta_end=0.02, clip_sample=False,
            num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
            set_alpha_to_one=True, steps_offset=1, timestep_spacing="leading",
        )
    if family == Family.ANIMATEDIFF:
        # The DDIM settings diffusers' AnimateDiff example uses with SD 1.5 betas.
        return DDIMScheduler(
            beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
            num_train_timesteps=1000, steps_offset=1, timestep_spacing="linspace",
        )
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def pipeline_class(model_id: str, task: str):
    import diffusers

    model = get_model(model_id)
    name = _PIPELINES.get((model.family, task))
    if name is None:
        raise ValueError(f"{model_id} has no pipeline for task {task}")
    if name == "ConsisIDPipeline":
        # The top-level name is a stand-in that demands OpenCV (DESIGN.md).
        from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline

        return ConsisIDPipeline
    return getattr(diffusers, name)


def build_tiny_pipeline(model_id: str, task: str, dtype: str = "float32", seed: int = 0,
                        transformer_class: type | None = None):
    """A tiny random-weight pipeline; same (model, dtype, seed) -> same weights.

    ``transformer_class`` swaps in a subclass with the same state dict (xfuser's
    Wan wrapper shards the sequence itself).
    """
    model = get_model(model_id)
    if not model.tiny:
        raise ValueError(f"{model_id} is not a tiny model; load it from its source")
    if model.family in (Family.I2VGEN_XL, Family.ANIMATEDIFF):
        if transformer_class is not None:
            raise ValueError(f"{model_id} is a UNet model: it has no transformer to swap")
        return _build_tiny_unet_pipeline(model_id, task, dtype, seed)
    parts: dict[str, Any] = {}
    for offset, name in enumerate(("text_encoder", "transformer", "vae")):
        torch.manual_seed(seed + offset)
        parts[name] = build_component(model_id, name, dtype).eval()
    if transformer_class is not None:
        plain = parts["transformer"]
        config = {k: v for k, v in plain.config.items() if not k.startswith("_")}
        swapped = transformer_class(**config).to(torch_dtype(dtype)).eval()
        missing, unexpected = swapped.load_state_dict(plain.state_dict(), strict=False)
        if unexpected or any(not m.endswith("head_perm") for m in missing):
            raise RuntimeError(f"{transformer_class.__name__} does not match {model_id}: {missing} {unexpected}")
        parts["transformer"] = swapped
    cls = pipeline_class(model_id, task)
    return cls(tokenizer=tiny_tokenizer(), scheduler=_scheduler(model.family), **parts)


def _build_tiny_unet_pipeline(model_id: str, task: str, dtype: str, seed: int):
    """I2VGen-XL / AnimateDiff with CLIP towers; one seed per component, in
    the order of the model's component configs."""
    from .configs import component_names

    model = get_model(model_id)
    parts: dict[str, Any] = {}
    for offset, name in enumerate(component_names(model_id)):
        torch.manual_seed(seed + offset)
        parts[name] = build_component(model_id, name, dtype).eval()
    if model.family == Family.I2VGEN_XL:
        parts["feature_extractor"] = tiny_clip_image_processor()
    else:
        parts["motion_adapter"] = None  # the UNet is already a UNetMotionModel
    cls = pipeline_class(model_id, task)
    return clip_text_model_compat(cls(tokenizer=tiny_clip_tokenizer(), scheduler=_scheduler(model.family), **parts))


def clip_text_model_compat(pipe):
    """transformers 5 flattened ``CLIPTextModel`` (no ``.text_model``), but
    diffusers' I2VGen-XL and AnimateDiff prompt encoders still call
    ``text_encoder.text_model.final_layer_norm`` under ``clip_skip`` (I2VGen-XL's
    default is 1). Give such an encoder a plain, unregistered ``text_model``
    view of its own final norm: no module, parameter or state-dict change."""
    from types import SimpleNamespace

    encoder = getattr(pipe, "text_encoder", None)
    if (encoder is not None and hasattr(encoder, "final_layer_norm")
            and "text_model" not in encoder.__dict__ and "text_model" not in encoder._modules):
        object.__setattr__(encoder, "text_model", SimpleNamespace(final_layer_norm=encoder.final_layer_norm))
    return pipe


def resolve_source(model_id: str, source: str | None) -> Path:
    """The local directory holding a real model's weights."""
    model = get_model(model_id)
    uri = source or (f"hf://{model.hub_id}" if model.hub_id else None)
    if uri is None:
        raise ModelSourceMissing(f"{model_id} has no default source; set spec.model.source", stage="load")
    if uri.startswith("hf://"):
        repo = uri.removeprefix("hf://").split("@", 1)[0]
        from huggingface_hub import snapshot_download

        # Read at call time: the actor's environment decides where the cache is mounted.
        cache_dir = os.environ.get("HF_HUB_CACHE") or (
            str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None)
        try:
            return Path(snapshot_download(repo, local_files_only=True, cache_dir=cache_dir))
        except Exception as exc:  # noqa: BLE001 - any cache miss is the same problem for a user
            raise ModelSourceMissing(
                f"{repo} is not in the offline hub cache ({os.environ.get('HF_HOME', '~/.cache/huggingface')}): "
                f"pre-download it there, or set spec.model.source to pvc://CLAIM/path or local://path ({exc})",
                stage="load",
            ) from None
    path = local_path(uri, "VIDEOJOB_MODEL_ROOT", "/var/lib/videojob/models")
    if not (path / "model_index.json").exists():
        raise ModelSourceMissing(
            f"no diffusers model at {path} (model_index.json missing): check spec.model.source "
            "and that the volume is mounted",
            stage="load",
        )
    return path


def load_pipeline(model_id: str, task: str, dtype: str, source: str | None = None, seed: int = 0,
                  transformer_class: type | None = None):
    """The pipeline for a job: tiny models are built, real ones loaded."""
    if get_model(model_id).tiny:
        return build_tiny_pipeline(model_id, task, dtype, seed, transformer_class)
    path = resolve_source(model_id, source)
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if transformer_class is not None:
        kwargs["transformer"] = transformer_class.from_pretrained(path, subfolder="transformer",
                                                                  dtype=torch_dtype(dtype))
    return clip_text_model_compat(pipeline_class(model_id, task).from_pretrained(path, **kwargs))
