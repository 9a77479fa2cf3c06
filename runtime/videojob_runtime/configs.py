"""Constructor configs of every component of every catalog model.

The runtime never needs a download to know a model's shape: each component
(text encoder, transformer or UNet, VAE, image encoder, motion adapter) is a
diffusers or transformers class plus the keyword config its constructor
takes. Real models carry their FULL published size (sources named per model:
the Hugging Face repo and file the numbers were read from); tiny models are
small random-weight layouts of the same families for CPU tests and the demo.

``build_component(model_id, name, dtype)`` instantiates one component with
random weights in ``dtype``. It works inside ``FakeTensorMode`` (that is how
the memory profiler builds a 14B transformer without allocating it): the
module is constructed with the torch default dtype set to ``dtype`` (calling
``module.to(dtype)`` on fake parameters fails with "Couldn't swap"), and then
the parameters that ``from_pretrained`` would keep in float32 are re-created
in float32, mirroring the libraries:

* transformers 5.x ``_get_dtype_plan``: ``_keep_in_fp32_modules`` patterns
  (regex search on the parameter name) only for float16, e.g. T5/UMT5's
  feed-forward output ``wo``; ``_keep_in_fp32_modules_strict`` for float16
  and bfloat16.
* diffusers ``load_model_dict_into_meta``: ``_keep_in_fp32_modules`` names
  matched against the dotted parameter-name components, for any dtype
  (e.g. Wan's ``time_embedder``, ``scale_shift_table``, ``norm1/2/3``).

Persistent floating buffers (state-dict entries) are cast to ``dtype`` as a
load would; non-persistent ones keep the dtype their constructor gives them
(CogVideoX-2b's sincos table stays float64, 0.25 GiB, as in a real load).

Tiny text encoders use a 256-entry vocabulary: byte-level token ids fit.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ComponentConfig",
    "component_configs",
    "component_names",
    "build_component",
    "model_ids",
    "default_dtype",
    "keep_fp32_param_names",
    "MediumSize",
    "MEDIUM_SIZES",
    "medium_component_configs",
    "medium_model",
    "instantiate_component",
]


@dataclass(frozen=True)
class ComponentConfig:
    """One component: where its class lives, its constructor config, its source."""

    class_name: str
    config: dict[str, Any]
    source: str
    library: str = "diffusers"  # "diffusers" or "transformers"
    # Free-form notes the profiler copies into its table (e.g. how the
    # pipeline derives this module from others).
    notes: tuple[str, ...] = field(default_factory=tuple)


# ---------------------------------------------------------------------------
# Text and image encoders (transformers)
# ---------------------------------------------------------------------------

# google/t5-v1_1-xxl, shipped as THUDM/CogVideoX-*/text_encoder/config.json
# (the same file in CogVideoX-2b, -5b, -5b-I2V, 1.5-5B and ConsisID-preview).
_T5_V11_XXL = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_decoder_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    "initializer_factor": 1.0,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": True,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}

# google/umt5-xxl, shipped as Wan-AI/Wan2.1-T2V-*-Diffusers/text_encoder/config.json
# Same encoder shape as T5 v1.1 XXL; only the (multilingual) vocabulary differs.
_UMT5_XXL = {**_T5_V11_XXL, "vocab_size": 256384}

# OpenCLIP ViT-H/14 text tower (the SD 2.x text encoder),
# ali-vilab/i2vgen-xl text_encoder/config.json
_CLIP_TEXT_H = {
    "vocab_size": 49408,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "projection_dim": 1024,
    "num_hidden_layers": 23,
    "num_attention_heads": 16,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}

# OpenCLIP ViT-H/14 vision tower, ali-vilab/i2vgen-xl image_encoder/config.json
_CLIP_VISION_H = {
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "projection_dim": 1024,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 224,
    "patch_size": 14,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}

# openai/clip-vit-large-patch14 text tower,
# stable-diffusion-v1-5/stable-diffusion-v1-5 text_encoder/config.json
_CLIP_TEXT_L = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}

_TINY_T5 = {
    "vocab_size": 256,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_decoder_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
    "dropout_rate": 0.0,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": True,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
}

# ---------------------------------------------------------------------------
# VAEs (diffusers)
# ---------------------------------------------------------------------------

_COGVIDEOX_VAE_BLOCKS = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["CogVideoXDownBlock3D"] * 4,
    "up_block_types": ["CogVideoXUpBlock3D"] * 4,
    "block_out_channels": [128, 256, 256, 512],
    "latent_channels": 16,
    "layers_per_block": 3,
    "act_fn": "silu",
    "norm_eps": 1e-6,
    "norm_num_groups": 32,
    "temporal_compression_ratio": 4,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
# THUDM/CogVideoX-2b vae/config.json
_COGVIDEOX_2B_VAE = {
    **_COGVIDEOX_VAE_BLOCKS,
    "sample_height": 480,
    "sample_width": 720,
    "scaling_factor": 1.15258426,
}
# THUDM/CogVideoX-5b vae/config.json (also -5b-I2V and ConsisID-preview)
_COGVIDEOX_5B_VAE = {
    **_COGVIDEOX_VAE_BLOCKS,
    "sample_height": 480,
    "sample_width": 720,
    "scaling_factor": 0.7,
}
# THUDM/CogVideoX1.5-5B vae/config.json
_COGVIDEOX15_VAE = {
    **_COGVIDEOX_VAE_BLOCKS,
    "sample_height": 768,
    "sample_width": 1360,
    "scaling_factor": 0.7,
    "invert_scale_latents": True,
}

# Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers vae/config.json (AutoencoderKLWan)
_WAN_VAE = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": [
        -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
        0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
    ],
    "latents_std": [
        2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916,
    ],
}

# The Stable Diffusion KL-f8 image VAE. sample_size sets the tile size that
# enable_tiling() uses: 512 in SD 1.5; 768 for I2VGen-XL is assumed from the
# SD 2.x VAE it ships (not re-read offline; it changes only the tiled decode).
_SD_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 32,
    "scaling_factor": 0.18215,
}

# ---------------------------------------------------------------------------
# Transformers / UNets (diffusers)
# ---------------------------------------------------------------------------

_COGVIDEOX_COMMON = {
    "attention_head_dim": 64,
    "out_channels": 16,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "time_embed_dim": 512,
    "text_embed_dim": 4096,
    "dropout": 0.0,
    "attention_bias": True,
    "patch_size": 2,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 226,
    "activation_fn": "gelu-approximate",
    "timestep_activation_fn": "silu",
    "norm_elementwise_affine": True,
    "norm_eps": 1e-5,
    "spatial_interpolation_scale": 1.875,
    "temporal_interpolation_scale": 1.0,
}
# THUDM/CogVideoX-2b transformer/config.json
_COGVIDEOX_2B = {
    **_COGVIDEOX_COMMON,
    "num_attention_heads": 30,
    "num_layers": 30,
    "in_channels": 16,
    "sample_width": 90,
    "sample_height": 60,
    "sample_frames": 49,
    "use_rotary_positional_embeddings": False,
    "use_learned_positional_embeddings": False,
}
# THUDM/CogVideoX-5b transformer/config.json
_COGVIDEOX_5B = {
    **_COGVIDEOX_2B,
    "num_attention_heads": 48,
    "num_layers": 42,
    "use_rotary_positional_embeddings": True,
}
# THUDM/CogVideoX-5b-I2V transformer/config.json
_COGVIDEOX_5B_I2V = {
    **_COGVIDEOX_5B,
    "in_channels": 32,
    "use_learned_positional_embeddings": True,
}
# THUDM/CogVideoX1.5-5B transformer/config.json
_COGVIDEOX15_5B = {
    **_COGVIDEOX_5B,
    "patch_size_t": 2,
    "patch_bias": False,
    "sample_width": 300,
    "sample_height": 300,
    "sample_frames": 81,
}
# BestWishYsh/ConsisID-preview transformer/config.json
_CONSISID = {
    **_COGVIDEOX_5B_I2V,
    "is_train_face": True,
    "is_kps": False,
    "cross_attn_interval": 2,
    "cross_attn_dim_head": 128,
    "cross_attn_num_heads": 16,
    "LFE_id_dim": 1280,
    "LFE_vit_dim": 1024,
    "LFE_depth": 10,
    "LFE_dim_head": 64,
    "LFE_num_heads": 16,
    "LFE_num_id_token": 5,
    "LFE_num_querie": 32,
    "LFE_output_dim": 2048,
    "LFE_ff_mult": 4,
    "LFE_num_scale": 5,
    "local_face_scale": 1.0,
}

_WAN_COMMON = {
    "patch_size": [1, 2, 2],
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "image_dim": None,
    "added_kv_proj_dim": None,
    "rope_max_seq_len": 1024,
}
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
_WAN_1_3B = {**_WAN_COMMON, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json
_WAN_14B = {**_WAN_COMMON, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40}

# ali-vilab/i2vgen-xl unet/config.json
_I2VGEN_XL_UNET = {
    "sample_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock3D"] * 3 + ["DownBlock3D"],
    "up_block_types": ["UpBlock3D"] + ["CrossAttnUpBlock3D"] * 3,
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "cross_attention_dim": 1024,
    "attention_head_dim": 64,
    "num_attention_heads": None,
}

# stable-diffusion-v1-5/stable-diffusion-v1-5 unet/config.json
_SD15_UNET = {
    "sample_size": 64,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    "block_out_channels": [320, 640, 1280, 1280],
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "cross_attention_dim": 768,
    "attention_head_dim": 8,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
}
# guoyww/animatediff-motion-adapter-v1-5-2 config.json
_MOTION_ADAPTER_V152 = {
    "block_out_channels": [320, 640, 1280, 1280],
    "motion_layers_per_block": 2,
    "motion_mid_block_layers_per_block": 1,
    "motion_num_attention_heads": 8,
    "motion_norm_num_groups": 32,
    "motion_max_seq_length": 32,
    "use_motion_mid_block": True,
    "conv_in_channels": None,
}


def unet_motion_config(unet2d: dict[str, Any], adapter: dict[str, Any]) -> dict[str, Any]:
    """The UNetMotionModel config that ``UNetMotionModel.from_unet2d`` derives
    from a UNet2DConditionModel config and a MotionAdapter config (the
    AnimateDiff pipeline does this in ``__init__``)."""
    import inspect

    from diffusers import UNetMotionModel

    config = dict(unet2d)
    config["down_block_types"] = [
        "CrossAttnDownBlockMotion" if "CrossAttn" in t else "DownBlockMotion"
        for t in config["down_block_types"]
    ]
    config["up_block_types"] = [
        "CrossAttnUpBlockMotion" if "CrossAttn" in t else "UpBlockMotion"
        for t in config["up_block_types"]
    ]
    config["motion_num_attention_heads"] = adapter["motion_num_attention_heads"]
    config["motion_max_seq_length"] = adapter["motion_max_seq_length"]
    config["use_motion_mid_block"] = adapter["use_motion_mid_block"]
    config["layers_per_block"] = adapter["motion_layers_per_block"]
    config["temporal_transformer_layers_per_mid_block"] = adapter.get(
        "motion_transformer_layers_per_mid_block", 1
    )
    config["temporal_transformer_layers_per_block"] = adapter.get(
        "motion_transformer_layers_per_block", 1
    )
    if adapter.get("conv_in_channels"):
        config["in_channels"] = adapter["conv_in_channels"]
    if not config.get("num_attention_heads"):
        config["num_attention_heads"] = config["attention_head_dim"]
    accepted = set(inspect.signature(UNetMotionModel.__init__).parameters) - {"self"}
    return {k: v for k, v in config.items() if k in accepted}


# ---------------------------------------------------------------------------
# Tiny layouts (attention heads 4 as the catalog says; CogVideoX RoPE needs a
# head_dim that is a multiple of 16; native 64x48, 9 frames)
# ---------------------------------------------------------------------------

_TINY_COGVIDEOX_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["CogVideoXDownBlock3D"] * 4,
    "up_block_types": ["CogVideoXUpBlock3D"] * 4,
    "block_out_channels": [16, 16, 32, 32],
    "latent_channels": 4,
    "layers_per_block": 1,
    "act_fn": "silu",
    "norm_eps": 1e-6,
    "norm_num_groups": 4,
    "temporal_compression_ratio": 4,
    "sample_height": 48,
    "sample_width": 64,
    "scaling_factor": 0.7,
    "force_upcast": False,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
_TINY_COGVIDEOX = {
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "time_embed_dim": 32,
    "text_embed_dim": 32,
    "num_layers": 2,
    "sample_width": 8,
    "sample_height": 6,
    "sample_frames": 9,
    "patch_size": 2,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 16,
    "use_rotary_positional_embeddings": True,
    "use_learned_positional_embeddings": False,
}
# Real CogVideoX-5b-I2V / ConsisID use learned positional embeddings, which
# pin the resolution; the tiny ones stay resolution-free (RoPE only) because
# the catalog lets tiny models run from 16 to 256 pixels.
_TINY_COGVIDEOX_I2V = {**_TINY_COGVIDEOX, "in_channels": 8}
_TINY_CONSISID = {
    **_TINY_COGVIDEOX_I2V,
    "is_train_face": True,
    "is_kps": False,
    "cross_attn_interval": 1,
    "cross_attn_dim_head": 8,
    "cross_attn_num_heads": 2,
    "LFE_id_dim": 16,
    "LFE_vit_dim": 32,
    "LFE_depth": 2,
    "LFE_dim_head": 8,
    "LFE_num_heads": 2,
    "LFE_num_id_token": 2,
    "LFE_num_querie": 4,
    "LFE_output_dim": int(4 * 16 * 2 / 3),  # heads x head_dim x 2/3 = 42
    "LFE_ff_mult": 1,
    "LFE_num_scale": 2,
    "local_face_scale": 1.0,
}
_TINY_WAN = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 4,
    "attention_head_dim": 16,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 32,
    "freq_dim": 16,
    "ffn_dim": 64,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 64,
}
_TINY_WAN_VAE = {
    "base_dim": 8,
    "z_dim": 4,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": [0.0] * 4,
    "latents_std": [1.0] * 4,
}

# Tiny UNet layouts (native 64x64, 8 frames). CLIP towers share one width
# (32): the UNet's cross-attention dim is the text hidden size and the image
# encoder's projection. Prompts pad to 16 tokens, as the tiny DiTs' do.
_TINY_CLIP_TEXT = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "projection_dim": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 16,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
_TINY_CLIP_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "projection_dim": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_channels": 3,
    "image_size": 32,
    "patch_size": 8,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}
# KL-f8 like SD's (four blocks, three downsamplings), narrow.
_TINY_SD_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 8, 16, 16],
    "layers_per_block": 1,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 4,
    "sample_size": 64,
    "scaling_factor": 0.18215,
}
_TINY_I2VGEN_XL_UNET = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock3D", "DownBlock3D"],
    "up_block_types": ["UpBlock3D", "CrossAttnUpBlock3D"],
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "cross_attention_dim": 32,
    "attention_head_dim": 4,  # I2VGenXLUNet reads it as the head count (as the real config does)
    "num_attention_heads": None,
}
_TINY_SD_UNET = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 4,
    "norm_eps": 1e-5,
    "cross_attention_dim": 32,
    "attention_head_dim": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
}
_TINY_MOTION_ADAPTER = {
    "block_out_channels": [32, 64],
    "motion_layers_per_block": 1,
    "motion_mid_block_layers_per_block": 1,
    "motion_num_attention_heads": 4,
    "motion_norm_num_groups": 4,
    "motion_max_seq_length": 32,
    "use_motion_mid_block": True,
    "conv_in_channels": None,
}

_TINY_SRC = "videojob tiny config (random weights, {layout} layout)"


def _cogvideox(transformer: dict, vae: dict, repo: str,
               transformer_class: str = "CogVideoXTransformer3DModel") -> dict[str, ComponentConfig]:
    """A CogVideoX-family pipeline whose configs come from hub repo ``repo``."""
    return {
        "text_encoder": ComponentConfig("T5EncoderModel", dict(_T5_V11_XXL),
                                        f"{repo} text_encoder/config.json (google/t5-v1_1-xxl encoder)",
                                        "transformers"),
        "transformer": ComponentConfig(transformer_class, dict(transformer), f"{repo} transformer/config.json"),
        "vae": ComponentConfig("AutoencoderKLCogVideoX", dict(vae), f"{repo} vae/config.json"),
    }


def _registry() -> dict[str, dict[str, ComponentConfig]]:
    reg: dict[str, dict[str, ComponentConfig]] = {}
    reg["cogvideox-2b"] = _cogvideox(_COGVIDEOX_2B, _COGVIDEOX_2B_VAE, "THUDM/CogVideoX-2b")
    reg["cogvideox-5b"] = _cogvideox(_COGVIDEOX_5B, _COGVIDEOX_5B_VAE, "THUDM/CogVideoX-5b")
    reg["cogvideox-5b-i2v"] = _cogvideox(_COGVIDEOX_5B_I2V, _COGVIDEOX_5B_VAE, "THUDM/CogVideoX-5b-I2V")
    reg["cogvideox1.5-5b"] = _cogvideox(_COGVIDEOX15_5B, _COGVIDEOX15_VAE, "THUDM/CogVideoX1.5-5B")
    reg["consisid"] = _cogvideox(_CONSISID, _COGVIDEOX_5B_VAE, "BestWishYsh/ConsisID-preview",
                                 transformer_class="ConsisIDTransformer3DModel")
    for mid, cfg, repo in (
        ("wan2.1-t2v-1.3b", _WAN_1_3B, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
        ("wan2.1-t2v-14b", _WAN_14B, "Wan-AI/Wan2.1-T2V-14B-Diffusers"),
    ):
        reg[mid] = {
            "text_encoder": ComponentConfig(
                "UMT5EncoderModel", dict(_UMT5_XXL),
                f"{repo} text_encoder/config.json (google/umt5-xxl encoder)", "transformers"),
            "transformer": ComponentConfig(
                "WanTransformer3DModel", dict(cfg), f"{repo} transformer/config.json"),
            "vae": ComponentConfig("AutoencoderKLWan", dict(_WAN_VAE), f"{repo} vae/config.json"),
        }
    reg["i2vgen-xl"] = {
        "text_encoder": ComponentConfig(
            "CLIPTextModel", dict(_CLIP_TEXT_H),
            "ali-vilab/i2vgen-xl text_encoder/config.json (OpenCLIP ViT-H/14 text)", "transformers"),
        "image_encoder": ComponentConfig(
            "CLIPVisionModelWithProjection", dict(_CLIP_VISION_H),
            "ali-vilab/i2vgen-xl image_encoder/config.json (OpenCLIP ViT-H/14 vision)", "transformers"),
        "unet": ComponentConfig("I2VGenXLUNet", dict(_I2VGEN_XL_UNET), "ali-vilab/i2vgen-xl unet/config.json"),
        "vae": ComponentConfig(
            "AutoencoderKL", {**_SD_VAE, "sample_size": 768}, "ali-vilab/i2vgen-xl vae/config.json"),
    }
    reg["animatediff"] = {
        "text_encoder": ComponentConfig(
            "CLIPTextModel", dict(_CLIP_TEXT_L),
            "stable-diffusion-v1-5/stable-diffusion-v1-5 text_encoder/config.json "
            "(openai/clip-vit-large-patch14 text)", "transformers"),
        "unet": ComponentConfig(
            "UNetMotionModel", unet_motion_config(_SD15_UNET, _MOTION_ADAPTER_V152),
            "stable-diffusion-v1-5 unet/config.json + guoyww/animatediff-motion-adapter-v1-5-2 "
            "config.json, merged as UNetMotionModel.from_unet2d does",
            notes=("The pipeline builds this UNet from the SD 1.5 UNet and the motion adapter; "
                   "its weights include the motion modules.",)),
        "motion_adapter": ComponentConfig(
            "MotionAdapter", dict(_MOTION_ADAPTER_V152),
            "guoyww/animatediff-motion-adapter-v1-5-2 config.json",
            notes=("AnimateDiffPipeline keeps the adapter registered as its own module after "
                   "copying its weights into the UNet: it is resident only where the whole "
                   "pipeline is moved to the GPU (pipe.to), not under model offload.",)),
        "vae": ComponentConfig(
            "AutoencoderKL", {**_SD_VAE, "sample_size": 512},
            "stable-diffusion-v1-5/stable-diffusion-v1-5 vae/config.json"),
    }
    # Tiny models
    tiny_te = ComponentConfig("T5EncoderModel", dict(_TINY_T5), _TINY_SRC.format(layout="T5"), "transformers")
    tiny_cog_vae = ComponentConfig("AutoencoderKLCogVideoX", dict(_TINY_COGVIDEOX_VAE),
                                   _TINY_SRC.format(layout="CogVideoX VAE"))

    def tiny_cog(cls: str, config: dict, layout: str) -> dict[str, ComponentConfig]:
        return {"text_encoder": tiny_te,
                "transformer": ComponentConfig(cls, dict(config), _TINY_SRC.format(layout=layout)),
                "vae": tiny_cog_vae}

    reg["tiny-cogvideox"] = tiny_cog("CogVideoXTransformer3DModel", _TINY_COGVIDEOX, "CogVideoX")
    reg["tiny-cogvideox-i2v"] = tiny_cog("CogVideoXTransformer3DModel", _TINY_COGVIDEOX_I2V, "CogVideoX I2V")
    reg["tiny-consisid"] = tiny_cog("ConsisIDTransformer3DModel", _TINY_CONSISID, "ConsisID")
    reg["tiny-wan"] = {
        "text_encoder": ComponentConfig("UMT5EncoderModel", dict(_TINY_T5),
                                        _TINY_SRC.format(layout="UMT5"), "transformers"),
        "transformer": ComponentConfig("WanTransformer3DModel", dict(_TINY_WAN),
                                       _TINY_SRC.format(layout="Wan 2.1")),
        "vae": ComponentConfig("AutoencoderKLWan", dict(_TINY_WAN_VAE),
                               _TINY_SRC.format(layout="Wan VAE")),
    }
    tiny_clip = ComponentConfig("CLIPTextModel", dict(_TINY_CLIP_TEXT), _TINY_SRC.format(layout="CLIP text"),
                                "transformers")
    tiny_sd_vae = ComponentConfig("AutoencoderKL", dict(_TINY_SD_VAE), _TINY_SRC.format(layout="SD VAE"))
    reg["tiny-i2vgen-xl"] = {
        "text_encoder": tiny_clip,
        "image_encoder": ComponentConfig("CLIPVisionModelWithProjection", dict(_TINY_CLIP_VISION),
                                         _TINY_SRC.format(layout="CLIP vision"), "transformers"),
        "unet": ComponentConfig("I2VGenXLUNet", dict(_TINY_I2VGEN_XL_UNET), _TINY_SRC.format(layout="I2VGen-XL UNet")),
        "vae": tiny_sd_vae,
    }
    # The UNetMotionModel AnimateDiffPipeline would build from a UNet2D and a
    # motion adapter; the tiny pipeline is given it directly (no separate adapter).
    reg["tiny-animatediff"] = {
        "text_encoder": tiny_clip,
        "unet": ComponentConfig("UNetMotionModel", unet_motion_config(_TINY_SD_UNET, _TINY_MOTION_ADAPTER),
                                _TINY_SRC.format(layout="SD 1.5 UNet + motion adapter, as UNetMotionModel")),
        "vae": tiny_sd_vae,
    }
    return reg


_REGISTRY: dict[str, dict[str, ComponentConfig]] | None = None


def _reg() -> dict[str, dict[str, ComponentConfig]]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _registry()
    return _REGISTRY


def model_ids() -> tuple[str, ...]:
    return tuple(_reg())


def component_configs(model_id: str) -> dict[str, ComponentConfig]:
    """The components of a catalog model, by pipeline attribute name."""
    try:
        comps = _reg()[model_id]
    except KeyError:
        raise KeyError(f"no component configs for model {model_id!r}; known: {', '.join(_reg())}") from None
    # Copies: callers may edit a config dict without touching the registry.
    return {
        name: ComponentConfig(c.class_name, _deepcopy(c.config), c.source, c.library, c.notes)
        for name, c in comps.items()
    }


def component_names(model_id: str) -> tuple[str, ...]:
    return tuple(_reg()[model_id])


def _deepcopy(obj):
    import copy

    return copy.deepcopy(obj)


def default_dtype(model_id: str, name: str) -> str:
    """The dtype the pipelines' model cards load each component in."""
    if model_id == "cogvideox-2b":
        return "float16"
    return "bfloat16"


# ---------------------------------------------------------------------------
# Medium benchmark size (benchmarks/stepcache_bench.py)
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MediumSize:
    """A full-size model cut down to run on a CPU in seconds per job.

    The transformer is the published config (the registry's) with only the
    sequence-length facts changed: ``layers`` blocks instead of all of them,
    prompts of ``text_tokens`` tokens, and the positional tables sized for a
    ``width`` x ``height`` x ``frames`` video. Every width stays the full
    model's: heads, head dim, FFN, time and text embeddings, patching, the face
    modules of ConsisID. The text encoder and VAE are the tiny layouts with the
    widths the transformer reads from them (the text hidden size, the latent
    channels and the VAE's published latent scaling), so a job encodes,
    denoises and decodes with the full model's latent shapes.
    """

    layers: int
    width: int
    height: int
    frames: int
    text_tokens: int


# At these widths the transformer is > 99% of the denoise stage even on a
# 48-72 token video (measured: benchmarks/results/stepcache.json, "profile"),
# so the sizes are set by time: a 10-step job in 6-16 s on one core (ConsisID,
# 3072 wide, gets the smaller video), 4 layers so a first-block cache can skip
# 3 of 4 blocks. CogVideoX/ConsisID split the latent height under sequence
# parallel: the patch rows (height / 16) stay even.
MEDIUM_SIZES: dict[str, MediumSize] = {
    "cogvideox-2b": MediumSize(layers=4, width=96, height=64, frames=9, text_tokens=16),
    "wan2.1-t2v-1.3b": MediumSize(layers=4, width=96, height=64, frames=9, text_tokens=16),
    "consisid": MediumSize(layers=4, width=64, height=64, frames=9, text_tokens=16),
}


def _medium_size(model_id: str, size: MediumSize | None) -> MediumSize:
    if size is not None:
        return size
    if model_id not in MEDIUM_SIZES:
        raise KeyError(f"no medium size for {model_id!r}; known: {', '.join(MEDIUM_SIZES)}")
    return MEDIUM_SIZES[model_id]


def medium_model(model_id: str, size: MediumSize | None = None):
    """The catalog entry of ``model_id`` with the medium size's layers and prompt
    length: what the planner's memory and latency models read for a medium job."""
    from dataclasses import replace

    from videojob.catalog import get_model

    size = _medium_size(model_id, size)
    model = get_model(model_id)
    return replace(model, arch=replace(model.arch, layers=size.layers, text_tokens=size.text_tokens))


def medium_component_configs(model_id: str, size: MediumSize | None = None) -> dict[str, ComponentConfig]:
    """The components of ``model_id`` at ``size`` (default ``MEDIUM_SIZES[model_id]``)."""
    from videojob.catalog import Family, get_model

    size = _medium_size(model_id, size)
    model = get_model(model_id)
    if model.tiny or model.arch.kind != "dit":
        raise ValueError(f"medium sizes are for full-size DiTs, not {model_id}")
    full = component_configs(model_id)
    transformer = dict(full["transformer"].config)
    transformer["num_layers"] = size.layers
    src = f"videojob medium size of {model_id}: {size.layers} of {full['transformer'].config['num_layers']} layers"
    arch = model.arch
    if model.family in (Family.COGVIDEOX, Family.CONSISID):
        # The text is a prefix of the joint sequence; sincos and learned
        # positional tables are built for the sample size (learned ones pin it).
        transformer.update(max_text_seq_length=size.text_tokens,
                           sample_width=size.width // arch.vae_spatial,
                           sample_height=size.height // arch.vae_spatial,
                           sample_frames=size.frames)
        text_width = transformer["text_embed_dim"]
        full_vae = full["vae"].config
        vae = ComponentConfig("AutoencoderKLCogVideoX", {
            **_TINY_COGVIDEOX_VAE, "latent_channels": full_vae["latent_channels"],
            "scaling_factor": full_vae["scaling_factor"]}, _TINY_SRC.format(layout="CogVideoX VAE") +
            f", {full_vae['latent_channels']} latent channels")
        te_class = "T5EncoderModel"
    elif model.family == Family.WAN:
        text_width = transformer["text_dim"]
        full_vae = full["vae"].config
        vae = ComponentConfig("AutoencoderKLWan", {
            **_TINY_WAN_VAE, "z_dim": full_vae["z_dim"], "latents_mean": list(full_vae["latents_mean"]),
            "latents_std": list(full_vae["latents_std"])}, _TINY_SRC.format(layout="Wan VAE") +
            f", z_dim {full_vae['z_dim']}")
        te_class = "UMT5EncoderModel"
    else:
        raise ValueError(f"no medium size for the {model.family.value} family")
    return {
        "text_encoder": ComponentConfig(te_class, {**_TINY_T5, "d_model": text_width},
                                        _TINY_SRC.format(layout="T5") + f", d_model {text_width}", "transformers"),
        "transformer": ComponentConfig(full["transformer"].class_name, transformer,
                                       f"{src}; {full['transformer'].source}"),
        "vae": vae,
    }


# ---------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------

def _torch_dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
            "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}[str(dtype)]


@contextmanager
def _default_dtype(dtype):
    import torch

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _instantiate(comp: ComponentConfig):
    if comp.library == "transformers":
        import transformers

        cls = getattr(transformers, comp.class_name)
        config = cls.config_class(**comp.config)
        return cls(config)
    import diffusers

    cls = getattr(diffusers, comp.class_name)
    return cls(**comp.config)


def _persistent_float_buffers(module) -> list[str]:
    out = []
    for mod_name, sub in module.named_modules():
        for bname, buf in sub._buffers.items():
            if buf is None or bname in sub._non_persistent_buffers_set or not buf.is_floating_point():
                continue
            out.append(f"{mod_name}.{bname}" if mod_name else bname)
    return out


def keep_fp32_param_names(module, dtype, names: list[str] | None = None) -> list[str]:
    """Names of the parameters ``from_pretrained(torch_dtype=dtype)`` keeps in
    float32 for this module (see the module docstring). ``names``: check
    these state-dict names instead of the parameters."""
    import torch

    dtype = _torch_dtype(dtype)
    if names is None:
        names = [n for n, _ in module.named_parameters()]
    keep: list[str] = []
    cls = type(module)
    if cls.__module__.startswith("transformers"):
        patterns: list[str] = []
        if dtype == torch.float16 and getattr(module, "_keep_in_fp32_modules", None):
            patterns += list(module._keep_in_fp32_modules)
        if dtype in (torch.float16, torch.bfloat16) and getattr(module, "_keep_in_fp32_modules_strict", None):
            patterns += list(module._keep_in_fp32_modules_strict)
        if patterns:
            rx = re.compile("|".join(p.replace("*", ".*") for p in patterns))
            keep = [n for n in names if rx.search(n)]
    else:
        mods = getattr(cls, "_keep_in_fp32_modules", None)
        if mods and dtype != torch.float32:
            keep = [n for n in names if any(m in n.split(".") for m in mods)]
    return keep


def _cast_persistent_buffers(module, dtype) -> None:
    """Persistent floating buffers are state-dict entries: ``from_pretrained``
    loads them in ``dtype`` (e.g. the learned positional table of
    CogVideoX-5b-I2V, built in float64). Non-persistent ones keep the dtype
    their constructor gave them, as in a real load."""
    names = _persistent_float_buffers(module)
    keep = set(keep_fp32_param_names(module, dtype, names))
    for full in names:
        owner_name, _, bname = full.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        want = _torch_dtype("float32") if full in keep else dtype
        buf = owner._buffers[bname]
        if buf.dtype != want:
            owner._buffers[bname] = buf.to(want)


def _upcast_params(module, names: list[str]) -> None:
    import torch

    for full in names:
        owner_name, _, pname = full.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        p = getattr(owner, pname)
        if p.dtype == torch.float32:
            continue
        setattr(owner, pname, torch.nn.Parameter(p.detach().to(torch.float32), requires_grad=False))


def build_component(model_id: str, name: str, dtype="bfloat16"):
    """Instantiate one component with random weights, in eval mode, no grad.

    Call it inside ``FakeTensorMode`` to build a full-size model without
    allocating it. Parameters the libraries keep in float32 on load are
    float32 here too (T5's ``wo`` in float16, Wan's norms and time embedder).
    """
    return instantiate_component(component_configs(model_id)[name], dtype)


def instantiate_component(comp: ComponentConfig, dtype="bfloat16"):
    """``build_component`` for a config from anywhere (``medium_component_configs``)."""
    tdtype = _torch_dtype(dtype)
    with _default_dtype(tdtype):
        module = _instantiate(comp)
    module.eval()
    module.requires_grad_(False)
    keep = keep_fp32_param_names(module, tdtype)
    if keep:
        _upcast_params(module, keep)
    _cast_persistent_buffers(module, tdtype)
    # Integer/bool buffers are untouched by the default dtype; float buffers
    # built from explicit float64/float32 (RoPE tables) stay as the library
    # makes them.
    return module
