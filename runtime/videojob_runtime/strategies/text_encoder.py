"""Encode the prompt once, then release the text encoder before denoising.

A T5-XXL encoder is ~9-11 GiB (DESIGN.md) and the pipeline only needs its
output. Without offload a diffusers pipeline keeps it on the GPU for the whole
call; encoding first and handing ``prompt_embeds`` / ``negative_prompt_embeds``
to the pipeline lets the denoise and decode stages run without it (the
planner's ``free_text_encoder``). The pipeline's own ``encode_prompt`` does
the encoding, so the frames are the same as a normal call's.

Release modes:

* ``drop``: remove the encoder(s) from the pipeline; memory goes back when the
  last reference does (one-shot pipelines; a warm pipeline cannot encode again).
* ``cpu``: move them to host memory (warm pipelines: the next job moves them
  back). Where an offload hook already parks them on the host between uses
  (model, group, sequential offload) this is a no-op.
* ``keep``: leave them where they are.
"""

from __future__ import annotations

import gc
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RELEASE_MODES", "TextEncoderConfig", "PromptEmbeds", "encode_and_release"]

RELEASE_MODES = ("drop", "cpu", "keep")


@dataclass(frozen=True)
class TextEncoderConfig:
    """What happens to the text encoder(s) once the prompt is encoded."""

    release: str = "drop"

    def __post_init__(self) -> None:
        if self.release not in RELEASE_MODES:
            raise ValueError(f"TextEncoderConfig.release must be one of {RELEASE_MODES}, "
                             f"got {self.release!r}")


@dataclass(frozen=True)
class PromptEmbeds:
    """The encoded prompt; pass ``pipeline_kwargs()`` to the pipeline call
    instead of ``prompt`` / ``negative_prompt``."""

    prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None
    released: dict[str, str] = field(default_factory=dict)

    def pipeline_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"prompt_embeds": self.prompt_embeds}
        if self.negative_prompt_embeds is not None:
            kw["negative_prompt_embeds"] = self.negative_prompt_embeds
        return kw


def encode_and_release(pipe, config: TextEncoderConfig, prompt, negative_prompt=None, *,
                       do_classifier_free_guidance: bool = True, num_videos_per_prompt: int = 1,
                       max_sequence_length: int = 226, device=None) -> PromptEmbeds:
    """Encode with ``pipe.encode_prompt`` (same arguments as the pipeline
    call would use), then release the text encoder(s) as ``config`` says."""
    if not isinstance(config, TextEncoderConfig):
        raise ValueError(f"config must be a TextEncoderConfig, got {type(config).__name__}")
    if not hasattr(pipe, "encode_prompt"):
        raise ValueError(f"{type(pipe).__name__} has no encode_prompt")
    names = _text_encoders(pipe)
    if not names:
        raise RuntimeError(f"{type(pipe).__name__} has no text encoder (an earlier job released it "
                           "with release='drop'?)")
    kwargs = dict(prompt=prompt, negative_prompt=negative_prompt,
                  do_classifier_free_guidance=do_classifier_free_guidance,
                  num_videos_per_prompt=num_videos_per_prompt, max_sequence_length=max_sequence_length,
                  device=device if device is not None else pipe._execution_device)
    accepted = inspect.signature(pipe.encode_prompt).parameters
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    # no_grad: outside the pipeline's own no_grad the embeddings would carry an
    # autograd graph that keeps the encoder's activations (and itself) alive.
    with torch.no_grad():
        out = pipe.encode_prompt(**kwargs)
    prompt_embeds, negative = out[0], out[1] if len(out) > 1 else None
    released = {name: _release(pipe, name, config.release) for name in names}
    if config.release == "drop":
        gc.collect()  # offload hooks can hold the encoder in reference cycles
    if config.release != "keep" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return PromptEmbeds(prompt_embeds, negative, released)


def _text_encoders(pipe) -> list[str]:
    return [n for n, m in pipe.components.items()
            if n.startswith("text_encoder") and isinstance(m, torch.nn.Module)]


def _on_host_between_uses(module: torch.nn.Module) -> bool:
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    return hasattr(module, "_hf_hook") or _is_group_offload_enabled(module)


def _release(pipe, name: str, mode: str) -> str:
    module = getattr(pipe, name)
    if mode == "keep":
        return "kept"
    if mode == "cpu":
        if _on_host_between_uses(module):
            return "already on the host between uses (offload hook)"
        module.to("cpu")
        return "moved to cpu"
    setattr(pipe, name, None)  # diffusers also records None in the pipeline config
    if getattr(pipe, "_all_hooks", None):
        # Model offload chains each component's hook to the previous one's
        # (the transformer's hook holds the encoder's). Rebuild the chain
        # without it, as diffusers does after every call.
        pipe.enable_model_cpu_offload(device=pipe._offload_device)
    return "dropped from the pipeline"
