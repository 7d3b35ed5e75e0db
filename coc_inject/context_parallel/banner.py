"""The context-parallel wing's one-line banner: what is on (the details: coc-inject status, COC_REPORT).

Said when Megatron's attention is imported; where only the linears armed the wing (COC_PARALLEL_NUM
without COC_CP_ALGO or COC_FLASH_ATTN), when the first layer with CP > 1 is built, never for a job
without context parallelism.
"""

from __future__ import annotations

import logging

from coc_inject import log
from coc_inject.context_parallel import attention


def implicit(config) -> bool:
    """The wing is armed only because the linears are: each layer's cp_comm_type at CP > 1."""
    return config.cp_algo is None and not config.flash_attn


def say(config, cp_size: int | None, once: bool = False) -> None:
    level = logging.INFO if log.global_rank() == 0 else logging.DEBUG
    if once:
        log.once(("context-parallel banner",), level, text(config, cp_size))
    else:
        log.logger.log(level, text(config, cp_size))


def text(config, cp_size: int | None) -> str:
    """One short line of what is on (the details: coc-inject status, COC_REPORT)."""
    window = f", window {config.cp_window}" if config.cp_window > 1 else ""
    degree = f", Ulysses degree {config.cp_ulysses_degree}" if config.cp_ulysses_degree else ""
    algorithm = "cp_comm_type" if config.cp_algorithm == attention.FOLLOW_MEGATRON else config.cp_algorithm
    kernel = f"kernel {_device_kernel()}" if config.attn_kernel == "auto" else f"kernel {config.attn_kernel}"
    if config.cp_algorithm is None:
        return f"fused attention installed on DotProductAttention (COC_FLASH_ATTN), {kernel}"
    size = f"CP {cp_size}" if cp_size is not None else "CP from Megatron"
    return (f"context parallelism installed on DotProductAttention: {algorithm}{window}{degree}, {size}, {kernel}"
            + ("; CP = 1 layers: fused kernel" if config.flash_attn else ""))


def _device_kernel() -> str:
    """The fused kernel this process's device would run in its default dtype (for the banner)."""
    import torch

    from coc_inject import attention_kernels

    device = next((d for d in attention_kernels.devices_here() if d != "cpu"), "cpu")  # an accelerator first
    kernel, _ = attention_kernels.fused_kernel(device, torch.bfloat16 if device != "cpu" else torch.float32, 128)
    return kernel.name if kernel is not None else f"reference on {device}"
