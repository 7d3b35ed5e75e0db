"""Megatron's activation recompute on the tests' CPU ranks (test-only): it saves and restores the "cuda"
RNG state, which on the CPU is torch's; and where Transformer Engine is absent, its output-discarding
checkpoint (selective 'layernorm', 'moe_act') still asks TE's FP8 state whatever its fp8 flag (0.19:
``fp8 is not None``). A GPU job has TE, with FP8 off: the stand-ins answer as that does."""

from __future__ import annotations

import contextlib

import torch


class _FP8Off:
    """Transformer Engine's FP8GlobalStateManager with FP8 off."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def install() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    if not getattr(megatron_random, "HAVE_TE", True):
        megatron_random.FP8GlobalStateManager = _FP8Off
        megatron_random.fp8_autocast = lambda enabled=False, fp8_recipe=None: contextlib.nullcontext()
        megatron_random.activation_recompute_forward = lambda **kwargs: contextlib.nullcontext()
