"""Run one pipeline stage of a full-size model symbolically and measure it.

Each ``profile_*`` function builds the real diffusers / transformers module
at full size under ``FakeTensorMode`` (fake CPU device: no memory is
allocated, no GPU is needed), builds the exact inputs the diffusers pipeline
passes to that module for the requested video (latent shapes from the VAE
compression ratios and patch sizes, text lengths, RoPE tables, image latents
concatenated on channels, ConsisID face embeddings), runs the forward under
``torch.no_grad()`` inside :class:`LiveBytes` with weights and inputs
registered as resident, and returns a sample dict in the calibration schema.

SDPA: every ``torch.nn.functional.scaled_dot_product_attention`` call is
routed to ``aten._scaled_dot_product_flash_attention_for_cpu`` (output +
fp32 logsumexp: the bytes of CUDA flash / memory-efficient attention).
Without that, some paths fall back to the math kernel and allocate a
seq x seq matrix no GPU run would (143 GiB for CogVideoX-2b on meta).
"""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..configs import build_component, component_configs
from .memtrack import LiveBytes

__all__ = [
    "profile_encode",
    "profile_image_encode",
    "profile_vae_encode",
    "profile_denoise",
    "profile_decode",
    "skips_unread_conv_cache",
    "fp8_storage_bytes",
    "component_stats",
    "text_tokens",
    "latent_shape",
    "latent_tokens",
    "denoiser_name",
    "valid_frames",
    "flash_sdpa",
    "DTYPES",
]

DTYPES = ("bfloat16", "float16", "float32")
GiB = 1024**3


def _dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
            "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}[d]


def _dtype_name(d) -> str:
    return str(_dtype(d)).replace("torch.", "")


def _info(model_id: str):
    from videojob.catalog import get_model

    return get_model(model_id)


def _family(model_id: str) -> str:
    return _info(model_id).family.value


def denoiser_name(model_id: str) -> str:
    comps = component_configs(model_id)
    return "transformer" if "transformer" in comps else "unet"


# ---------------------------------------------------------------------------
# SDPA routing
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def flash_sdpa(counter: dict | None = None):
    """Route F.scaled_dot_product_attention to the CPU flash kernel.

    ``counter`` (optional dict) receives ``calls``.
    """
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if counter is not None:
            counter["calls"] = counter.get("calls", 0) + 1
        squeeze = query.dim() == 3
        if squeeze:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
        if query.dim() != 4:
            return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[1] != query.shape[1]:
            rep = query.shape[1] // key.shape[1]
            key = key.repeat_interleave(rep, dim=1)
            value = value.repeat_interleave(rep, dim=1)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            # What SDPA itself does before a fused kernel: an additive mask.
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
                attn_mask.logical_not(), float("-inf"))
        if attn_mask is not None and attn_mask.dtype != query.dtype:
            attn_mask = attn_mask.to(query.dtype)
        out = flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return out.squeeze(0) if squeeze else out

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


# ---------------------------------------------------------------------------
# Pipeline facts
# ---------------------------------------------------------------------------

def text_tokens(model_id: str) -> int:
    """Text sequence length the pipeline pads prompts to: the catalog's one fact
    (CogVideoX/ConsisID 226, Wan 512, CLIP 77, tiny models 16)."""
    return _info(model_id).arch.text_tokens


def valid_frames(model_id: str, frames: int) -> int:
    """The valid frame count nearest to ``frames`` below the native count."""
    info = _info(model_id)
    return info.frames.nearest(frames)


def _vae_scale(model_id: str) -> tuple[int, int]:
    """(spatial, temporal) compression of the model's VAE."""
    fam = _family(model_id)
    if fam in ("cogvideox", "consisid"):
        cfg = component_configs(model_id)["vae"].config
        return 2 ** (len(cfg["block_out_channels"]) - 1), cfg["temporal_compression_ratio"]
    if fam == "wan":
        cfg = component_configs(model_id)["vae"].config
        return 2 ** len(cfg["temperal_downsample"]), 2 ** sum(cfg["temperal_downsample"])
    cfg = component_configs(model_id)["vae"].config
    return 2 ** (len(cfg["block_out_channels"]) - 1), 1


def _latent_channels(model_id: str) -> int:
    cfg = component_configs(model_id)["vae"].config
    return cfg.get("latent_channels", cfg.get("z_dim"))


def latent_shape(model_id: str, width: int, height: int, frames: int, batch: int = 1,
                 for_decode: bool = False) -> tuple[int, ...]:
    """Shape of the latents the pipeline builds (denoise: the noise latents
    before any image concat; decode: what reaches the VAE).

    CogVideoX-family: [B, F, C, H, W] (frames second). Wan and UNets:
    [B, C, F, H, W]. CogVideoX 1.5 pads latent frames to a multiple of
    patch_size_t for denoise and strips the padding before decode.
    """
    fam = _family(model_id)
    s, t = _vae_scale(model_id)
    c = _latent_channels(model_id)
    h, w = height // s, width // s
    if fam in ("cogvideox", "consisid"):
        f = (frames - 1) // t + 1
        pt = component_configs(model_id)["transformer"].config.get("patch_size_t")
        if pt and not for_decode and f % pt:
            f += pt - f % pt
        return (batch, f, c, h, w)
    if fam == "wan":
        return (batch, c, (frames - 1) // t + 1, h, w)
    return (batch, c, frames, h, w)


def latent_tokens(model_id: str, width: int, height: int, frames: int) -> int:
    """Patch tokens of the video in the denoiser (text excluded). For the
    UNets: latent pixels (frames x h x w), which is what their spatial and
    temporal attention lengths multiply to."""
    fam = _family(model_id)
    shape = latent_shape(model_id, width, height, frames)
    cfg = component_configs(model_id)[denoiser_name(model_id)].config
    if fam in ("cogvideox", "consisid"):
        _, f, _, h, w = shape
        p = cfg.get("patch_size", 2)
        pt = cfg.get("patch_size_t") or 1
        return (f // pt) * (h // p) * (w // p)
    if fam == "wan":
        _, _, f, h, w = shape
        pt, ph, pw = cfg["patch_size"]
        return (f // pt) * (h // ph) * (w // pw)
    _, _, f, h, w = shape
    return f * h * w


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------

def _measure(module, inputs: Any, call, tracker_extra=()) -> tuple[int, LiveBytes]:
    counter: dict = {}
    with torch.no_grad(), flash_sdpa(counter), LiveBytes() as tr:
        tr.add_resident(module)
        tr.add_resident(inputs)
        for extra in tracker_extra:
            tr.add_resident(extra)
        out = call()
        peak = tr.peak
        del out
    tr.sdpa_calls = counter.get("calls", 0)
    big = [a for a in tr.largest if a.op in ("bmm", "_softmax", "baddbmm") and len(a.shape) >= 2
           and a.shape[-1] == a.shape[-2] and a.shape[-1] > 4096]
    if big:
        raise RuntimeError(f"a seq x seq attention matrix was allocated: {big[0]}")
    return peak, tr


def _fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def _rotary(model_id: str, transformer, height: int, width: int, latent_frames: int):
    cfg = transformer.config
    if not cfg.get("use_rotary_positional_embeddings"):
        return None
    if _family(model_id) == "consisid":
        from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline as P
    else:
        from diffusers import CogVideoXPipeline as P
    s, _ = _vae_scale(model_id)
    ns = SimpleNamespace(transformer=transformer, vae_scale_factor_spatial=s)
    return P._prepare_rotary_positional_embeddings(ns, height, width, latent_frames, torch.device("cpu"))


def _sample(stage: str, component: str, dtype, **kw) -> dict:
    d = {"stage": stage, "component": component, "dtype": _dtype_name(dtype)}
    d.update(kw)
    return d


def _encoder_inputs(model_id: str, module, batch: int) -> tuple[dict, int]:
    n = text_tokens(model_id)
    ids = torch.ones(batch, n, dtype=torch.long)
    cls = type(module).__name__
    if cls == "UMT5EncoderModel":
        return {"input_ids": ids, "attention_mask": torch.ones(batch, n, dtype=torch.long)}, n
    return {"input_ids": ids}, n


def profile_encode(model_id: str, dtype="bfloat16", batch: int = 1) -> dict:
    """Text encoder forward on one padded prompt batch, as the pipeline calls it."""
    t0 = time.perf_counter()
    with _fake_mode():
        module = build_component(model_id, "text_encoder", dtype)
        inputs, n = _encoder_inputs(model_id, module, batch)
        peak, _ = _measure(module, inputs, lambda: module(**inputs)[0])
    return _sample("encode", "text_encoder", dtype, batch=batch, text_tokens=n,
                   activation_peak_bytes=int(peak), seconds=round(time.perf_counter() - t0, 3))


def profile_image_encode(model_id: str, dtype="bfloat16", batch: int = 1) -> dict:
    """CLIP image encoder (I2VGen-XL): one 224x224 crop -> image_embeds.
    Stage ``image_encode`` (kept apart from the text ``encode`` samples)."""
    t0 = time.perf_counter()
    with _fake_mode():
        module = build_component(model_id, "image_encoder", dtype)
        size = module.config.image_size
        pixels = torch.randn(batch, 3, size, size, dtype=_dtype(dtype))
        peak, _ = _measure(module, pixels, lambda: module(pixels).image_embeds)
    return _sample("image_encode", "image_encoder", dtype, batch=batch, image_size=size,
                   activation_peak_bytes=int(peak), seconds=round(time.perf_counter() - t0, 3))


def profile_vae_encode(model_id: str, width: int, height: int, dtype="bfloat16") -> dict:
    """VAE encode of the conditioning image (I2V, identity): one frame, as
    the pipeline's prepare_latents / prepare_image_latents does it. Stage
    ``image_encode``."""
    fam = _family(model_id)
    t0 = time.perf_counter()
    with _fake_mode():
        vae = build_component(model_id, "vae", dtype)
        if fam in ("cogvideox", "consisid"):
            image = torch.randn(1, 3, 1, height, width, dtype=_dtype(dtype))  # [B, C, F, H, W]
        else:
            image = torch.randn(1, 3, height, width, dtype=_dtype(dtype))
        peak, _ = _measure(vae, image, lambda: vae.encode(image).latent_dist.sample())
    return _sample("image_encode", "vae", dtype, batch=1, width=width, height=height, frames=1,
                   activation_peak_bytes=int(peak), seconds=round(time.perf_counter() - t0, 3))


def _denoise_call(model_id: str, module, width: int, height: int, frames: int, batch: int,
                  dtype) -> tuple[Any, Any, list]:
    """(inputs, call) for one denoiser forward, shapes exactly as the pipeline."""
    fam = _family(model_id)
    dt = _dtype(dtype)
    n_text = text_tokens(model_id)
    cfg = module.config
    if fam in ("cogvideox", "consisid"):
        b, f, _, h, w = latent_shape(model_id, width, height, frames, batch)
        # I2V / ConsisID: the pipeline concatenates image latents on channels,
        # so the transformer sees in_channels (32) channels.
        hidden = torch.randn(b, f, cfg.in_channels, h, w, dtype=dt)
        text = torch.randn(b, n_text, cfg.text_embed_dim, dtype=dt)
        timestep = torch.full((b,), 999, dtype=torch.long)
        rotary = _rotary(model_id, module, height, width, f)
        kwargs = dict(hidden_states=hidden, encoder_hidden_states=text, timestep=timestep,
                      image_rotary_emb=rotary, return_dict=False)
        if fam == "consisid":
            # Face embeddings as the ConsisID pipeline passes them: batch 1
            # even under CFG (insightface + EVA-CLIP ids, ViT hidden states).
            vit_tokens = 577  # EVA-CLIP ViT-L/14 at 336 px: 24 x 24 + 1
            kwargs["id_cond"] = torch.randn(1, cfg.LFE_id_dim, dtype=dt)
            kwargs["id_vit_hidden"] = [torch.randn(1, vit_tokens, cfg.LFE_vit_dim, dtype=dt)
                                       for _ in range(cfg.LFE_num_scale)]
        return kwargs, (lambda: module(**kwargs)[0])
    if fam == "wan":
        shape = latent_shape(model_id, width, height, frames, batch)
        kwargs = dict(hidden_states=torch.randn(*shape, dtype=dt),
                      timestep=torch.full((batch,), 999.0, dtype=torch.float32),
                      encoder_hidden_states=torch.randn(batch, n_text, cfg.text_dim, dtype=dt),
                      return_dict=False)
        return kwargs, (lambda: module(**kwargs)[0])
    if fam == "i2vgen-xl":
        shape = latent_shape(model_id, width, height, frames, batch)
        kwargs = dict(sample=torch.randn(*shape, dtype=dt),
                      timestep=torch.tensor(999, dtype=torch.long),
                      encoder_hidden_states=torch.randn(batch, n_text, cfg.cross_attention_dim, dtype=dt),
                      fps=torch.full((batch,), 16, dtype=torch.long),
                      image_latents=torch.randn(*shape, dtype=dt),
                      image_embeddings=torch.randn(batch, 1, cfg.cross_attention_dim, dtype=dt),
                      return_dict=False)
        return kwargs, (lambda: module(**kwargs)[0])
    if fam == "animatediff":
        shape = latent_shape(model_id, width, height, frames, batch)
        # AnimateDiffPipeline repeats the prompt embeddings per frame
        # (prompt_embeds.repeat_interleave(num_frames, dim=0)).
        kwargs = dict(sample=torch.randn(*shape, dtype=dt),
                      timestep=torch.tensor(999, dtype=torch.long),
                      encoder_hidden_states=torch.randn(batch * frames, n_text, cfg.cross_attention_dim,
                                                        dtype=dt))
        return kwargs, (lambda: module(**kwargs).sample)
    raise ValueError(f"no denoise recipe for family {fam}")


def profile_denoise(model_id: str, width: int, height: int, frames: int, batch: int = 2,
                    dtype="bfloat16", calls: int = 1) -> dict:
    """One denoising step's denoiser forward(s) for a video of this size.

    ``batch`` 2 is the CFG batch of one prompt (cond + uncond in one call).
    ``calls`` 2 is a step as WanPipeline runs guidance: two calls at ``batch``,
    the first call's output (the conditional noise prediction) alive while the
    second runs. The sample records ``calls`` when it is not 1.
    """
    if calls not in (1, 2):
        raise ValueError(f"calls must be 1 or 2, got {calls!r}")
    name = denoiser_name(model_id)
    t0 = time.perf_counter()
    with _fake_mode():
        module = build_component(model_id, name, dtype)
        inputs, call = _denoise_call(model_id, module, width, height, frames, batch, dtype)
        if calls == 2:
            one = call

            def call():
                first = one()  # kept, as noise_pred is, while the unconditional call runs
                return first, one()
        peak, _ = _measure(module, inputs, call)
    extra = {"calls": calls} if calls != 1 else {}
    return _sample("denoise", name, dtype, batch=batch, width=width, height=height, frames=frames,
                   latent_tokens=latent_tokens(model_id, width, height, frames),
                   text_tokens=text_tokens(model_id), **extra, activation_peak_bytes=int(peak),
                   seconds=round(time.perf_counter() - t0, 3))


def _decode_call(model_id: str, vae, width: int, height: int, frames: int, dtype):
    fam = _family(model_id)
    dt = _dtype(dtype)
    shape = latent_shape(model_id, width, height, frames, 1, for_decode=True)
    latents = torch.randn(*shape, dtype=dt)
    if fam in ("cogvideox", "consisid"):
        from diffusers import CogVideoXPipeline

        ns = SimpleNamespace(vae=vae, vae_scaling_factor_image=vae.config.scaling_factor)
        return latents, (lambda: CogVideoXPipeline.decode_latents(ns, latents))
    if fam == "wan":
        def wan_decode():
            # WanPipeline.__call__ after the denoising loop.
            mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(dt)
            std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(dt)
            x = latents / std + mean
            return vae.decode(x, return_dict=False)[0]
        return latents, wan_decode
    if fam == "i2vgen-xl":
        from diffusers import I2VGenXLPipeline

        ns = SimpleNamespace(vae=vae)
        return latents, (lambda: I2VGenXLPipeline.decode_latents(ns, latents, decode_chunk_size=1))
    if fam == "animatediff":
        from diffusers import AnimateDiffPipeline

        ns = SimpleNamespace(vae=vae)
        return latents, (lambda: AnimateDiffPipeline.decode_latents(ns, latents, decode_chunk_size=16))
    raise ValueError(f"no decode recipe for family {fam}")


def skips_unread_conv_cache(model_id: str) -> bool:
    """Whether the model's VAE has convs whose cache is never read (``strategies.vae_conv_cache``)."""
    from ..strategies.vae_conv_cache import unread_cache_convs

    with _fake_mode():
        return bool(unread_cache_convs(build_component(model_id, "vae", "float32")))


def profile_decode(model_id: str, width: int, height: int, frames: int, dtype="bfloat16",
                   tiling: bool = False, skip_unread_conv_cache: bool = False) -> dict:
    """The VAE decode the pipeline makes after denoising (its own
    ``decode_latents`` where it has one), optionally with ``enable_tiling()``
    and with the runtime's ``vae_conv_cache`` strategy (recorded in the sample
    when on; a ValueError where it does not apply)."""
    from ..strategies.vae_conv_cache import VaeConvCacheConfig, apply_vae_conv_cache

    t0 = time.perf_counter()
    with _fake_mode():
        vae = build_component(model_id, "vae", dtype)
        if tiling:
            vae.enable_tiling()
        if skip_unread_conv_cache and not apply_vae_conv_cache(vae, VaeConvCacheConfig(True)).applicable:
            raise ValueError(f"skip_unread_conv_cache: {type(vae).__name__} ({model_id}) has no unread conv cache")
        inputs, call = _decode_call(model_id, vae, width, height, frames, dtype)
        peak, _ = _measure(vae, inputs, call)
    extra = {"skip_unread_conv_cache": True} if skip_unread_conv_cache else {}
    return _sample("decode", "vae", dtype, width=width, height=height, frames=frames, tiling=bool(tiling),
                   **extra, activation_peak_bytes=int(peak), seconds=round(time.perf_counter() - t0, 3))


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------

def _tensor_bytes(tensors) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        key = t.untyped_storage()._cdata
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _own_bytes(module: torch.nn.Module) -> int:
    return _tensor_bytes(list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)))


def _all_bytes(modules, extra=()) -> int:
    ts = list(extra)
    for m in modules:
        ts += list(m.parameters()) + list(m.buffers())
    return _tensor_bytes(ts)


# transformers encoders have no _group_offload_block_modules: these names
# make diffusers' block-level group offload descend to their layer lists
# (pass them as ``block_modules`` to enable_group_offload).
_TRANSFORMERS_BLOCK_MODULES = {
    "T5EncoderModel": ["encoder"],
    "UMT5EncoderModel": ["encoder"],
    "CLIPTextModel": ["text_model", "encoder"],
    "CLIPVisionModelWithProjection": ["vision_model", "encoder"],
}


def group_offload_block_modules(module) -> list[str] | None:
    names = getattr(module, "_group_offload_block_modules", None)
    if names:
        return list(names)
    return _TRANSFORMERS_BLOCK_MODULES.get(type(module).__name__)


def block_groups(module: torch.nn.Module, block_modules=None) -> tuple[list[int], int]:
    """Mirror diffusers' block-level group offloading (num_blocks_per_group=1):
    returns (bytes of each matched block group, bytes of the unmatched groups,
    which stay onloaded for the whole forward of their leader module)."""
    groups, rest = _block_groups(module, set(block_modules or ()))
    return groups, _tensor_bytes(rest)


def _block_groups(module, names: set) -> tuple[list[int], list]:
    groups: list[int] = []
    rest: list = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    for name, child in module.named_children():
        if name in names:
            g, r = _block_groups(child, names)
            groups += g
            rest += r
        elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
            groups += [_all_bytes([block]) for block in child]
        else:
            rest += list(child.parameters()) + list(child.buffers())
    return groups, rest


def _stats_one(model_id: str, name: str, dtype) -> dict:
    with _fake_mode():
        m = build_component(model_id, name, dtype)
        params = list(m.parameters())
        buffers = list(m.buffers())
        out = {
            "params": int(sum(p.numel() for p in params)),
            "weight_bytes": _tensor_bytes(params + buffers),
            "buffer_bytes": _tensor_bytes(buffers),
            "largest_leaf_bytes": max((_own_bytes(mod) for mod in m.modules()), default=0),
        }
        bm = group_offload_block_modules(m)
        groups, unmatched = block_groups(m, bm)
        out["num_blocks"] = len(groups)
        out["largest_block_bytes"] = max(groups, default=0)
        out["group_offload_unmatched_bytes"] = unmatched
        out["group_offload_block_modules"] = bm or []
        out["fp32_params"] = int(sum(p.numel() for p in params if p.dtype == torch.float32))
        out["class"] = type(m).__name__
        if name in ("transformer", "unet") and hasattr(m, "enable_layerwise_casting"):
            out["fp8_weight_bytes"] = fp8_storage_bytes(m)
    return out


def fp8_storage_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s weights under the runtime's fp8 storage
    (``strategies.fp8``: diffusers layerwise casting to float8): the layers it
    would cast, with the model's own skip patterns, at 1 byte a parameter; the
    rest as built. The casting hooks are recorded, not installed (a fake
    module's parameters cannot be swapped to another dtype)."""
    import diffusers.hooks.layerwise_casting as layerwise

    cast: list[torch.nn.Module] = []
    install = layerwise.apply_layerwise_casting_hook
    layerwise.apply_layerwise_casting_hook = lambda mod, *args, **kwargs: cast.append(mod)
    try:
        module.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    finally:
        layerwise.apply_layerwise_casting_hook = install
    in_fp8 = {id(p) for mod in cast for p in mod.parameters()}
    params = list(module.parameters())
    kept = [p for p in params if id(p) not in in_fp8] + list(module.buffers())
    return sum(p.numel() for p in params if id(p) in in_fp8) + _tensor_bytes(kept)


def component_stats(model_id: str, name: str, dtype="bfloat16") -> dict:
    """Weights of one component as built in ``dtype`` (no forward):
    params (count), weight_bytes (params + buffers), buffer_bytes,
    largest_leaf_bytes (largest module's own params + buffers: what
    sequential offload keeps on the GPU at a time), largest_block_bytes and
    num_blocks (diffusers block-level group offload groups), and the bytes of
    the ungrouped remainder that stays onloaded during the forward."""
    return _stats_one(model_id, name, dtype)
