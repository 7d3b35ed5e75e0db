"""Does an MoE layer's call run as pieces? Each guard names what runs on Megatron's path, and why.

The pieces replace the dispatcher's all-to-alls and the local experts' loop of Megatron's
``alltoall`` dispatcher with ``SequentialMLP`` experts; whatever else Megatron does around them
(routing, permutation, the shared expert, recompute, the aux losses) runs as Megatron wrote it.
"""

from __future__ import annotations

# What status names as running on Megatron's path (the reasons below, briefly).
WITHOUT_PIECES = ("the allgather and flex dispatchers", "grouped / Transformer Engine experts", "EP 1", "FP8 / FP4",
                  "permute fusion", "padding to capacity", "Megatron's own EP or shared-expert overlap",
                  "CUDA graphs", "inference mode")

# (config attribute, why a layer with it set (not None / False) runs on Megatron's path)
_CONFIG_GUARDS = (
    ("fp8", "FP8: its quantised expert inputs are padded per expert inside Megatron's experts"),
    ("fp4", "FP4: its quantised expert inputs are padded per expert inside Megatron's experts"),
    ("moe_permute_fusion", "moe_permute_fusion (Transformer Engine's fused permute kernels)"),
    ("moe_pad_expert_input_to_capacity",
     "padding expert inputs to capacity (moe_pad_expert_input_to_capacity): the all-to-all is dense per capacity"),
    ("moe_router_padding_for_quantization", "router padding for quantization"),
    ("moe_router_padding_for_fp8", "router padding for FP8"),
    ("moe_shared_expert_overlap",
     "Megatron's own shared-expert overlap (moe_shared_expert_overlap) runs inside the dispatcher's all-to-alls"),
    ("overlap_moe_expert_parallel_comm",
     "Megatron's own EP overlap (overlap_moe_expert_parallel_comm) is on: coc-inject steps aside"),
    ("delay_wgrad_compute", "delay_wgrad_compute (the experts' weight gradients run later, outside the layer)"),
    ("overlap_dispatch_backward_with_experts_wgrad", "overlap_dispatch_backward_with_experts_wgrad"),
    ("moe_latent_size", "latent MoE (moe_latent_size)"),
    ("enable_cuda_graph", "CUDA graphs (enable_cuda_graph)"),
    ("external_cuda_graph", "CUDA graphs (external_cuda_graph)"),
    ("moe_paged_stash", "moe_paged_stash"),
)


def layer_reason(layer) -> str | None:
    """Why this MoE layer cannot run as pieces (None: it can). Decided once per layer: these are
    the layer's construction, not its input."""
    dispatcher = getattr(layer, "token_dispatcher", None)
    kind = dispatcher.__class__.__name__  # Megatron's class also behind multi-copy's per-copy dispatcher
    if kind == "MoEAllGatherTokenDispatcher":
        return "the allgather dispatcher: it moves every token to every rank (nothing to cut per expert)"
    if kind == "MoEFlexTokenDispatcher":
        return "the flex dispatcher (DeepEP / HybridEP kernels)"
    if kind != "MoEAlltoAllTokenDispatcher":
        return f"an unknown token dispatcher ({kind})"
    experts = type(getattr(layer, "experts", None)).__name__
    if experts != "SequentialMLP":
        return (f"{experts} experts (grouped GEMM, Transformer Engine): one kernel for all local experts; "
                "pieces need SequentialMLP")
    config = layer.config
    for attribute, reason in _CONFIG_GUARDS:
        if getattr(config, attribute, None) not in (None, False):
            return reason
    if getattr(config, "cuda_graph_impl", "none") not in ("none", None):
        return f"CUDA graphs (cuda_graph_impl={config.cuda_graph_impl})"
    if dispatcher.ep_size == 1:
        return "expert parallelism 1: no all-to-all to overlap"
    return None


def call_reason(layer) -> str | None:
    """Why this call cannot run as pieces although the layer can (None: it can)."""
    try:
        from megatron.core.inference.utils import InferenceMode  # 0.19: a separate inference dispatcher
    except ImportError:
        return None
    if hasattr(layer, "_inference_token_dispatcher") and InferenceMode.is_active():
        return "inference mode (Megatron's inference dispatcher)"
    return None
