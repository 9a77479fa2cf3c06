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
from .locations import check_uri, resolve

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


# How xfuser 0.7.0 runs a family sequence-parallel (only (family, task) pairs
# listed here can; the catalog's ``sequence_parallel`` must agree, a test checks):
# through its pipeline wrapper, or, for Wan (no wrapper in xfuser 0.7.0), the
# plain diffusers pipeline with xfuser's sequence-sharding transformer class.
_PARALLEL = {
    (Family.COGVIDEOX, "t2v"): ("wrapper", "xFuserCogVideoXPipeline"),
    (Family.CONSISID, "identity"): ("wrapper", "xFuserConsisIDPipeline"),
    (Family.WAN, "t2v"): ("transformer", "xFuserWanTransformer3DWrapper"),
}


def runs_parallel(model_id: str, task: str) -> bool:
    """Whether the runtime can run this model and task on more than one rank."""
    return (get_model(model_id).family, task) in _PARALLEL


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
    return _build_dit_pipeline(model_id, task, dtype, seed, transformer_class,
                               lambda name: build_component(model_id, name, dtype))


# A JobRequest source meaning "the full-size model with random weights": how
# `make gpu-check` measures memory and speed at full size with no download,
# through the worker like any job. No VideoJob can ask for it: the API admits
# only hf://, pvc:// and local:// sources (api rules; tests/test_gpu_check_dry_run.py).
RANDOM_WEIGHTS = "random-weights:"


def build_random_pipeline(model_id: str, task: str, dtype: str = "bfloat16", seed: int = 0,
                          transformer_class: type | None = None, init_device: str | None = None):
    """A full-size DiT pipeline with random weights, each component made on
    ``init_device`` (the GPU when there is one: seconds, not minutes, for billions
    of parameters) and kept on the host, where a loaded model starts. ``"meta"``
    builds shapes only (no memory), for checks of the full-size structure."""
    model = get_model(model_id)
    if model.family in (Family.I2VGEN_XL, Family.ANIMATEDIFF):
        raise ValueError(f"{model_id} is a UNet model: random full-size weights are built for DiTs only")
    device = init_device or ("cuda" if torch.cuda.is_available() else "cpu")

    def build(name: str):
        with torch.device(device):
            module = build_component(model_id, name, dtype)
        return module if device in ("cpu", "meta") else module.to("cpu")

    return _build_dit_pipeline(model_id, task, dtype, seed, transformer_class, build)


def build_medium_pipeline(model_id: str, task: str, dtype: str = "float32", seed: int = 0,
                          transformer_class: type | None = None, size=None):
    """A full-size DiT at its medium benchmark size (``configs.MEDIUM_SIZES``:
    the published transformer with fewer layers), random weights seeded as the
    tiny ones are. Prompts must be encoded at ``size.text_tokens``."""
    from .configs import instantiate_component, medium_component_configs

    comps = medium_component_configs(model_id, size)
    return _build_dit_pipeline(model_id, task, dtype, seed, transformer_class,
                               lambda name: instantiate_component(comps[name], dtype))


def _build_dit_pipeline(model_id: str, task: str, dtype: str, seed: int, transformer_class, build):
    model = get_model(model_id)
    parts: dict[str, Any] = {}
    for offset, name in enumerate(("text_encoder", "transformer", "vae")):
        torch.manual_seed(seed + offset)
        parts[name] = build(name).eval()
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


def resolve_source(model_id: str, source: str | None, namespace: str | None = None) -> Path:
    """The local directory holding a real model's weights (an operator job's pvc:// and local://
    sources in its namespace's directory, or in a shared read-only model location: ``locations``)."""
    model = get_model(model_id)
    uri = source or (f"hf://{model.hub_id}" if model.hub_id else None)
    if uri is None:
        raise ModelSourceMissing(f"{model_id} has no default source; set spec.model.source", stage="load")
    if uri.startswith("hf://"):
        repo, _, revision = check_uri(uri, "source", "spec.model.source").removeprefix("hf://").partition("@")
        return hub_snapshot(repo, revision or None)
    path = source_path(uri, namespace)
    if not (path / "model_index.json").exists():
        raise ModelSourceMissing(
            f"no diffusers model at {path} (model_index.json missing): check spec.model.source "
            "and that the volume is mounted",
            stage="load",
        )
    return path


def source_path(uri: str, namespace: str | None = None) -> Path:
    """The local directory of a pvc://, local:// or s3:// model source: s3:// is the pod's cached copy
    (downloaded once per pod, ``s3store.download_prefix``), then read like a pvc:// one."""
    if uri.startswith("s3://"):
        from videojob.settings import S3Settings

        from . import s3store

        settings = S3Settings()
        where = s3store.locate(uri, "source", "spec.model.source", namespace, settings)
        return s3store.download_prefix(s3store.client(settings), where, settings)
    return resolve(uri, "source", "spec.model.source", namespace=namespace)  # contained: locations.resolve


def hub_snapshot(repo: str, revision: str | None = None) -> Path:
    """The offline hub cache's snapshot of ``repo`` at ``revision`` (a branch,
    tag or commit; default: main). Nothing is downloaded."""
    from huggingface_hub import snapshot_download

    # Read at call time: the actor's environment decides where the cache is mounted.
    cache_dir = os.environ.get("HF_HUB_CACHE") or (
        str(Path(os.environ["HF_HOME"]) / "hub") if os.environ.get("HF_HOME") else None)
    at = f"@{revision}" if revision else ""
    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True, cache_dir=cache_dir))
    except Exception as exc:  # noqa: BLE001 - any cache miss is the same problem for a user
        raise ModelSourceMissing(
            f"{repo}{at} is not in the offline hub cache ({cache_dir or os.environ.get('HF_HOME', '~/.cache/huggingface')}): "
            f"pre-download it there, or set spec.model.source to pvc://CLAIM/path or local://path ({exc})",
            stage="load",
        ) from None


def _is_motion_adapter(path: Path) -> bool:
    import json

    config = path / "config.json"
    return config.exists() and json.loads(config.read_text()).get("_class_name") == "MotionAdapter"


def _load_animatediff(model_id: str, source: str | None, dtype: str, namespace: str | None = None):
    """AnimateDiff in its published layout: a motion adapter plus a Stable
    Diffusion 1.5 base pipeline (the catalog's ``base_hub_id``, from the
    offline hub cache), with the DDIM settings AnimateDiff's examples use.
    A source that is a saved AnimateDiffPipeline loads as it is."""
    from diffusers import AnimateDiffPipeline, DDIMScheduler, MotionAdapter

    model = get_model(model_id)
    uri = source or f"hf://{model.hub_id}"
    if uri.startswith("hf://"):
        repo, _, revision = check_uri(uri, "source", "spec.model.source").removeprefix("hf://").partition("@")
        path = hub_snapshot(repo, revision or None)
    else:
        path = source_path(uri, namespace)
    if (path / "model_index.json").exists():  # a whole AnimateDiffPipeline
        return clip_text_model_compat(AnimateDiffPipeline.from_pretrained(path, dtype=torch_dtype(dtype)))
    if not _is_motion_adapter(path):
        raise ModelSourceMissing(
            f"no motion adapter or AnimateDiff pipeline at {path} (config.json of a MotionAdapter, or "
            "model_index.json, missing): check spec.model.source and that the volume is mounted", stage="load")
    adapter = MotionAdapter.from_pretrained(path, dtype=torch_dtype(dtype))
    base = hub_snapshot(model.base_hub_id)
    pipe = AnimateDiffPipeline.from_pretrained(base, motion_adapter=adapter, dtype=torch_dtype(dtype))
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, clip_sample=False, beta_schedule="linear",
                                               timestep_spacing="linspace", steps_offset=1)
    return clip_text_model_compat(pipe)


def load_pipeline(model_id: str, task: str, dtype: str, source: str | None = None, seed: int = 0,
                  transformer_class: type | None = None, size: str = "full", namespace: str | None = None):
    """The pipeline for a job: tiny models are built, real ones loaded (``namespace``: the operator
    job's, for its source's location); ``size="medium"`` builds a real model at its benchmark size instead."""
    model = get_model(model_id)
    if size == "medium":
        return build_medium_pipeline(model_id, task, dtype, seed, transformer_class)
    if size != "full":
        raise ValueError(f"load_pipeline size must be 'full' or 'medium', got {size!r}")
    if model.tiny:
        return build_tiny_pipeline(model_id, task, dtype, seed, transformer_class)
    if source == RANDOM_WEIGHTS:
        return build_random_pipeline(model_id, task, dtype, seed, transformer_class)
    if model.family == Family.ANIMATEDIFF:
        return _load_animatediff(model_id, source, dtype, namespace)
    path = resolve_source(model_id, source, namespace)
    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if transformer_class is not None:
        kwargs["transformer"] = transformer_class.from_pretrained(path, subfolder="transformer",
                                                                  dtype=torch_dtype(dtype))
    return clip_text_model_compat(pipeline_class(model_id, task).from_pretrained(path, **kwargs))


def build_parallel_pipeline(model_id: str, task: str, dtype: str, source: str | None, seed: int, *,
                            ulysses: int, ring: int, cfg: int, on_cpu: bool, width: int, height: int,
                            frames: int, steps: int, size: str = "full", namespace: str | None = None):
    """The pipeline for a multi-rank layout, wrapped the way xfuser runs this family.

    torch.distributed and xfuser's parallel groups must be up (``distributed``);
    the caller applies memory strategies afterwards (``strategies.order``).
    ``size``: as ``load_pipeline``'s (the benchmarks' medium size)."""
    kind_and_name = _PARALLEL.get((get_model(model_id).family, task))
    if kind_and_name is None:
        from .errors import JobFailure

        raise JobFailure(f"{model_id} ({task}) cannot run sequence-parallel; plan it on one GPU", stage="load")
    from xfuser import xFuserArgs

    from .xfuser_cpu import attention_backend

    engine_config, _ = xFuserArgs(
        model=model_id, ulysses_degree=ulysses, ring_degree=ring, use_cfg_parallel=cfg == 2,
        attention_backend=attention_backend(ring, on_cpu), height=height, width=width, num_frames=frames,
        num_inference_steps=steps,
    ).create_config()
    engine_config.runtime_config.dtype = torch_dtype(dtype)
    kind, name = kind_and_name
    if kind == "wrapper":
        import xfuser

        return getattr(xfuser, name)(load_pipeline(model_id, task, dtype, source, seed, size=size,
                                                   namespace=namespace), engine_config)
    from xfuser.core.distributed import initialize_runtime_state
    from xfuser.model_executor.models.transformers import transformer_wan

    pipe = load_pipeline(model_id, task, dtype, source, seed, transformer_class=getattr(transformer_wan, name),
                         size=size, namespace=namespace)
    initialize_runtime_state(pipe, engine_config)
    return pipe


def inner_pipeline(pipe):
    """The diffusers pipeline (xfuser's wrappers keep it as ``.module``)."""
    return getattr(pipe, "module", pipe)


def denoiser(pipe):
    """The transformer or UNet of a pipeline (xfuser's wrapped transformer under a wrapper)."""
    inner = inner_pipeline(pipe)
    return getattr(inner, "transformer", None) or getattr(inner, "unet")
