"""install() / uninstall() of context parallelism on Megatron's local ``DotProductAttention``, and
the two post-import hooks that do it (registered by bootstrap).

* ``megatron.core.transformer.dot_product_attention``: ``__init__`` and ``forward`` of the exact
  class ``DotProductAttention`` are replaced (a subclass with its own ``__init__``/``forward`` keeps
  them); a layer built with CP = 1 runs Megatron's code unchanged, or with COC_FLASH_ATTN the
  fused attention kernel (Megatron's code for a call that kernel cannot run exactly, with a reason).
* ``megatron.core.parallel_state``: ``initialize_model_parallel`` also makes hybrid's Ulysses
  groups (groups.py), where every rank passes; ``destroy_model_parallel`` destroys them.

The attention's wing of the job's installation (coc_inject.job): patches, coverage and the
COC_CP_ALGO=auto tuner live there, shared with the linears' wing.
"""

from __future__ import annotations

import functools
import inspect
import logging

from coc_inject import job, log
from coc_inject.context_parallel import attention, groups
from coc_inject.routes import MEGATRON_ATTENTION, AttentionRoute


def install(config, attention_module=None, parallel_state=None) -> None:
    """Patch the attention class (and, when given, parallel_state) for ``config``, counting no
    calls (tests, ``coc-inject tune``; the import hooks count). Idempotent."""
    uninstall()
    installation = job.installation(config)
    if parallel_state is not None:
        _patch_parallel_state(installation, parallel_state)
    if attention_module is not None:
        _patch_attention(installation, attention_module.DotProductAttention)


def uninstall() -> None:
    """Undo the job's installation (Ulysses groups live until destroy_model_parallel)."""
    job.uninstall(forget_said=False)


def _patch_attention(installation, cls) -> None:
    config, patches = installation.config, installation.patches
    original_init, original_forward = patches.original(cls, "__init__"), patches.original(cls, "forward")
    signature = inspect.signature(original_init)
    from megatron.core import parallel_state

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs)
        bound = arguments.arguments
        megatron_config = bound["config"]
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
        softmax_coefficient = getattr(self.scale_mask_softmax, "scale", None) or 1.0
        plan.scale = self.softmax_scale * softmax_coefficient  # Megatron scales twice with layer scaling
        self._coc_cp = plan

    @functools.wraps(original_forward)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        plan = getattr(self, "_coc_cp", None)

        def megatron_forward():
            return original_forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                    attention_bias=attention_bias, packed_seq_params=packed_seq_params)

        if plan is None:
            return megatron_forward()
        try:
            for feature, given in (("packed sequences (packed_seq_params)", packed_seq_params),
                                   ("attention_bias", attention_bias)):
                if given is not None:
                    raise attention.ContextParallelError(
                        f"context parallelism on Megatron's local DotProductAttention does not support {feature}")
            causal = attention.mask_is_causal(plan, query, attention_mask, attn_mask_type or self.attn_mask_type)
        except attention.ContextParallelError as exc:
            if not plan.local:
                raise
            return _megatron_instead(installation, self, str(exc), megatron_forward)
        if not plan.local:
            _agree(config, plan, query.device)
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

    __init__.__coc_inject__ = forward.__coc_inject__ = True
    patches.patch(cls, "__init__", __init__)
    patches.patch(cls, "forward", forward)


def _layer_name(layer) -> str:
    return f"attention layer {getattr(layer, 'layer_number', '?')}"


def _flash_plan(config, layer, megatron_config, attention_dropout):
    """COC_FLASH_ATTN's plan for a layer built with CP = 1, or None (Megatron's attention, said once)."""
    if not config.flash_attn:
        return None
    feature = attention.unsupported_feature(megatron_config, attention_dropout)
    if feature is not None:
        log.once(("flash-attn-unsupported", feature), logging.WARNING,
                 f"COC_FLASH_ATTN: layers with {feature} keep Megatron's local attention")
        return None
    plan = attention.plan_local(config)
    softmax_coefficient = getattr(layer.scale_mask_softmax, "scale", None) or 1.0
    plan.scale = layer.softmax_scale * softmax_coefficient
    return plan


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


def auto_decisions() -> dict:
    """COC_CP_ALGO=auto's decisions of this process so far: {AttentionKey: Decision}."""
    installation = job.current()
    return dict(installation.decisions(job.ATTENTION)) if installation is not None else {}


def _agree(config, plan, device) -> None:
    """Every rank of the CP group runs the same settings (the first call on each group checks)."""
    from coc_inject.pipeline import agreement

    agreement.ensure_same_config(plan.cp_group, config, device, f"COC_CP_ALGO -> {plan.describe()}, ")


def _patch_parallel_state(installation, parallel_state) -> None:
    patches = installation.patches
    original_init = patches.original(parallel_state, "initialize_model_parallel")
    original_destroy = patches.original(parallel_state, "destroy_model_parallel")

    @functools.wraps(original_init)
    def initialize_model_parallel(*args, **kwargs):
        result = original_init(*args, **kwargs)
        groups.make_configured(installation.config.cp_ulysses_degree, parallel_state)
        return result

    @functools.wraps(original_destroy)
    def destroy_model_parallel(*args, **kwargs):
        groups.release()
        return original_destroy(*args, **kwargs)

    patches.patch(parallel_state, "initialize_model_parallel", initialize_model_parallel)
    patches.patch(parallel_state, "destroy_model_parallel", destroy_model_parallel)


# -- the post-import hooks ----------------------------------------------------------------------


def _wanted():
    """The config when context parallelism is requested and this Megatron may be patched, else None."""
    config = job.config()
    if not config.attention_armed:
        return None
    return config if job.megatron_patchable(config) is not None else None


def on_parallel_state_imported(module) -> None:
    config = _wanted()
    if config is not None:
        _patch_parallel_state(job.installation(config), module)


def on_attention_imported(module) -> None:
    config = _wanted()
    if config is None:
        return
    installation = job.installation(config)
    installation.armed_coverage()
    _patch_attention(installation, module.DotProductAttention)
    from megatron.core import parallel_state

    level = logging.INFO if log.global_rank() == 0 else logging.DEBUG
    initialized = parallel_state.model_parallel_is_initialized()
    log.logger.log(level, banner(config, parallel_state.get_context_parallel_world_size() if initialized else None))


def banner(config, cp_size: int | None) -> str:
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
