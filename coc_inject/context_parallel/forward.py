"""What context parallelism puts on Megatron's local ``DotProductAttention`` (install.py patches the
exact class): its ``__init__`` makes the layer's plan (attention.plan_layer; with COC_FLASH_ATTN at
CP = 1, the fused kernel's), its ``forward`` runs the plan and counts the call. A layer without a
plan runs Megatron's code unchanged; with COC_FLASH_ATTN, a call the fused kernel cannot run exactly
runs Megatron's attention with the reason.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch

from coc_inject import job, log, mindspeed
from coc_inject.context_parallel import attention, banner, groups
from coc_inject.routes import MEGATRON_ATTENTION, AttentionRoute


def wrap_init(installation, cls, original_init):
    """``cls.__init__``: the layer's plan, in ``self._coc_cp`` (None: Megatron's layer)."""
    config = installation.config
    signature = inspect.signature(original_init)
    from megatron.core import parallel_state

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs)
        bound = arguments.arguments
        megatron_config = bound["config"]
        feature = mindspeed.class_feature(type(self), mindspeed.ATTENTION)
        if feature is not None:  # MindSpeed's class in Megatron's place: its CP (or its kernel) is MindSpeed's
            mindspeed.aside(mindspeed.ATTENTION, type(self).__name__, feature)
            self._coc_cp = None
            original_init(self, *args, **kwargs)
            return
        # A subclass with a forward of its own would run that forward, not the CP one: it keeps
        # Megatron's __init__, whose assertion refuses CP > 1.
        if megatron_config.context_parallel_size == 1 or type(self).forward is not cls.__dict__["forward"] \
                or config.cp_algorithm is None:
            self._coc_cp = None
            original_init(self, *args, **kwargs)
            if megatron_config.context_parallel_size == 1 and type(self).forward is cls.__dict__["forward"]:
                self._coc_cp = _flash_plan(config, self, megatron_config, bound.get("attention_dropout"))
            return
        pgs = bound.get("pg_collection") or bound.get("model_comm_pgs")
        cp_group = getattr(pgs, "cp", None) or parallel_state.get_context_parallel_group(check_initialized=False)
        plan = attention.plan_layer(
            config, megatron_config, bound["layer_number"], bound.get("cp_comm_type"),
            bound.get("attention_dropout"), cp_group,
            lambda degree: groups.ulysses_group(degree, megatron_config, parallel_state))
        attention.megatron_init(original_init, arguments, self)
        plan.scale = _softmax_scale(self)  # Megatron scales twice with layer scaling
        if plan.scale is None:  # Megatron's own layer refuses CP > 1: nothing to step aside to
            raise attention.ContextParallelError(f"context parallelism: {_lacks(self)}")
        self._coc_cp = plan
        if banner.implicit(config):  # the wing armed by the linears alone says itself here (banner.py)
            banner.say(config, megatron_config.context_parallel_size, once=True)

    __init__.__coc_inject__ = True
    return __init__


# Megatron's enable_autocast (or a caller's torch.autocast): Megatron's local attention then multiplies in the
# autocast dtype; the wing's kernels are not verified to match it (tests/context_parallel/test_cp_gpt.py).
AUTOCAST = ("torch.autocast is on (Megatron's enable_autocast): the wing's attention kernels are not verified "
            "against Megatron's local attention under it (at CP > 1 run without autocast, e.g. with bf16 "
            "parameters, or without COC_CP_ALGO)")


def wrap_forward(installation, original_forward):
    """``forward``: the layer's plan run over its CP group, counted; Megatron's without a plan."""
    config = installation.config

    @functools.wraps(original_forward)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        plan = self.__dict__.get("_coc_cp")  # decided at construction; a plain read (no Module.__getattr__)
        if plan is None:  # Megatron's layer: its forward at once
            return original_forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                    attention_bias=attention_bias, packed_seq_params=packed_seq_params)

        def megatron_forward():
            return original_forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                    attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        try:
            if torch.is_autocast_enabled(query.device.type):
                raise attention.ContextParallelError(AUTOCAST)
            for feature, given in (("packed sequences (packed_seq_params)", packed_seq_params),
                                   ("attention_bias", attention_bias)):
                if given is not None:
                    raise attention.ContextParallelError(
                        f"context parallelism on Megatron's local DotProductAttention does not support {feature}")
            causal = attention.mask_is_causal(plan, query, attention_mask, attn_mask_type or self.attn_mask_type,
                                            self)
        except attention.ContextParallelError as exc:
            if not plan.local:
                raise
            return _megatron_instead(installation, self, str(exc), megatron_forward)
        if not plan.local:
            _agree(config, plan)
        kernel = attention.kernel_for(plan, query, _layer_name(self)).kernel
        variant = _auto_choice(installation, self, plan, query, key, value, causal, kernel) if plan.auto \
            else plan.variants[0]
        out = attention.run(plan, variant, query, key, value, causal, kernel)
        coverage = installation.coverage
        if coverage is not None:
            coverage.count_attention(self, AttentionRoute(variant.describe() + (" (auto)" if plan.auto else ""),
                                                          plan.cp_size, kernel.name))
        s, b, heads, d = query.shape
        return out.reshape(s, b, heads * d)

    forward.__coc_inject__ = True
    return forward


def _layer_name(layer) -> str:
    return f"attention layer {getattr(layer, 'layer_number', '?')}"


def _flash_plan(config, layer, megatron_config, attention_dropout):
    """COC_FLASH_ATTN's plan for a layer built with CP = 1, or None (Megatron's attention, said once)."""
    if not config.flash_attn:
        return None
    feature = attention.unsupported_feature(megatron_config, attention_dropout)
    if feature is not None:
        log.once(("flash-attn-unsupported", feature), logging.WARNING,
                 f"COC_FLASH_ATTN: Megatron's local attention is kept: {feature}")
        return None
    scale = _softmax_scale(layer)
    if scale is None:
        log.once(("flash-attn-unsupported", "scale"), logging.WARNING,
                 f"COC_FLASH_ATTN: Megatron's local attention is kept: {_lacks(layer)}")
        return None
    plan = attention.plan_local(config)
    plan.scale = scale
    return plan


# What the plan reads of Megatron's layer: a release whose layer lacks one (COC_ALLOW_UNTESTED_MEGATRON=1)
# keeps Megatron's attention (CP = 1) or is refused naming it (CP > 1), never an AttributeError.
LAYER_READS = ("softmax_scale", "scale_mask_softmax")


def _softmax_scale(layer):
    """The scale Megatron's attention applies (its softmax's coefficient too), or None where the layer lacks it."""
    if not all(hasattr(layer, name) for name in LAYER_READS):
        return None
    return layer.softmax_scale * (getattr(layer.scale_mask_softmax, "scale", None) or 1.0)


def _lacks(layer) -> str:
    missing = [name for name in LAYER_READS if not hasattr(layer, name)]
    return (f"{type(layer).__name__} has no attribute {missing[0]!r} (a megatron-core release coc-inject "
            "does not know)")


def _megatron_instead(installation, layer, reason: str, megatron_forward):
    """COC_FLASH_ATTN: a call the fused kernel cannot run exactly runs Megatron's attention (said once)."""
    log.once(("flash-attn-call", reason), logging.WARNING,
             f"COC_FLASH_ATTN: Megatron's local attention runs this call instead: {reason}")
    if installation.coverage is not None:
        installation.coverage.count_attention(layer, AttentionRoute(MEGATRON_ATTENTION, 1, reason=reason))
    return megatron_forward()


def _auto_choice(installation, layer, plan, query, key, value, causal, kernel):
    from coc_inject.context_parallel import auto

    return auto.choose(installation.tuner(job.ATTENTION), plan, query, key, value, causal,
                       layer.config.tensor_model_parallel_size, kernel)


def _agree(config, plan) -> None:
    """Every rank of the CP group runs the same settings (the first call on each group checks)."""
    from coc_inject.pipeline import agreement

    agreement.ensure_same_config(plan.cp_group, config, f"COC_CP_ALGO -> {plan.describe()}, ")
