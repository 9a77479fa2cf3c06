"""Make xfuser 0.7.0 run on a CPU with gloo (tests and the embedded demo).

xfuser assumes an accelerator. With PyPI's CUDA build of torch on a machine
with no GPU it would pick nccl, cuda:N devices and the cuDNN attention
backend. These patches, applied in every process before xfuser builds any
group, route it to gloo and the CPU flash-attention kernel (which returns
the log-sum-exp that ring attention needs to merge partial results). The
facts behind each patch are in DESIGN.md ("Facts about running xfuser on a
CPU"), plus one found since: the CUDA-build check (_is_cuda) must be off too.
"""

from __future__ import annotations

import sys

_APPLIED = False

# Modules that copy HAS_LONG_CTX_ATTN at import time.
_LONG_CTX_FLAGS = (
    "xfuser.config.config",
    "xfuser.model_executor.layers.attention_processor",
    "xfuser.core.distributed.parallel_state",
    "xfuser.core.distributed.group_coordinator",
    "xfuser.model_executor.models.transformers.transformer_wan",
)


def apply_cpu_patches() -> None:
    """Idempotent; call before init_distributed_environment and any wrapper."""
    global _APPLIED
    if _APPLIED:
        return
    import torch
    import xfuser.envs as envs

    envs._is_cuda = lambda: False  # the wheel is a CUDA build; the machine has no GPU
    envs._is_hip = lambda: False
    envs.get_device_version = lambda: None
    envs.get_torch_distributed_backend = lambda: "gloo"
    envs.PACKAGES_CHECKER.packages_info["has_long_ctx_attn"] = True
    for name in _LONG_CTX_FLAGS:
        __import__(name)
        sys.modules[name].HAS_LONG_CTX_ATTN = True

    import xfuser.model_executor.layers.usp as usp
    import yunchang.globals

    usp.PROCESS_GROUP = yunchang.globals.PROCESS_GROUP

    from xfuser.core.distributed.attention_backend import ATTENTION_FUNCTION_REGISTRY, AttentionBackendType

    def cpu_flash(query, key, value, dropout_p, is_causal, attention_kwargs=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p=dropout_p, is_causal=is_causal
        )[:2]
        return out, lse

    ATTENTION_FUNCTION_REGISTRY[AttentionBackendType.SDPA_FLASH] = cpu_flash
    _APPLIED = True


def attention_backend(ring: int, on_cpu: bool) -> str:
    """xfuser's backend name: on a CPU, SDPA for ulysses/cfg and the patched
    SDPA_FLASH when ring > 1 (plain SDPA has no LSE, so xfuser refuses it)."""
    if not on_cpu:
        return "FLASH_ATTN" if ring > 1 else "SDPA"
    return "SDPA_FLASH" if ring > 1 else "SDPA"
