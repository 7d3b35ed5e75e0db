"""Multi-copy's rows: copies of the micro-batch through a whole TransformerBlock (every layer's math,
its collectives taking turns), and the sequence copies' rows on top of them (SEQUENCE_ROWS).

A batch copy is exact for whatever a layer computes sample by sample; what is not per sample (random
draws, state kept between calls, counts over the whole batch, a capture) is refused here or, for
what depends on the layer's objects or the call, in multi_copy/splits.py (arguments), moe.py (the
dispatcher's class, the router's losses), sequence.py (the attention's class, the mask).
"""

from __future__ import annotations

from coc_inject.allowlist.rows import moe_only, refused, supported, table

PARALLEL = supported(
    "the block's parallelism: its collectives take turns between the copies (TP, SP, CP, EP, expert TP)",
    "tensor_model_parallel_size", "sequence_parallel", "context_parallel_size", "cp_comm_type",
    "hierarchical_context_parallel_sizes", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "gradient_accumulation_fusion", "transformer_impl")

ATTENTION = supported(
    "the attention's math, sample by sample (sequence copies check the attention's class and mask themselves)",
    "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "masked_softmax_fusion", "attention_backend",
    "flash_attention_version", "window_size", "window_attn_skip_freq", "softmax_type", "multi_latent_attention")

NUMERICS = supported(
    "numerics the copies run as Megatron does, each copy's calls the same kernels on fewer samples",
    "deterministic_mode", "batch_invariant_mode",
    "disable_bf16_reduced_precision_matmul", "calculate_per_token_loss", "test_mode", "use_te_rng_tracker")

CHUNKED_MLP = supported(
    "chunked MLPs (megatron-core 0.19 transformer_layer.py:871-916: the MLP called once per chunk of the "
    "sequence): a batch copy's chunk i holds its samples of Megatron's chunk i, and an MoE router's meetings pair "
    "each copy's i-th arrival (multi_copy/scheduler.py CopyRun.meet; tests/multi_copy/test_multi_copy_moe.py)",
    "mlp_chunks_for_training")

AUTOCAST = supported(
    "enable_autocast runs the forward inside torch.autocast: the copies' threads take the caller's autocast "
    "(multi_copy/scheduler.py), each copy's layers run in its dtype as without copies; the copies' summed bf16 "
    "weight gradients round once per copy (tests/multi_copy/test_multi_copy.py: the first loss equal, then within "
    "bf16 rounding)",
    "enable_autocast", "autocast_dtype")

RECOMPUTE = supported(
    "recompute: the block's chunks recomputed as copies where its chunk recompute is one the copies read "
    "(multi_copy/recompute.py BLOCK_CHUNKS: Megatron's, MindSpeed's TE one); another's (MindSpeed's "
    "--recompute-method block's) recomputes one copy at a time in the backward, and an MoE block with the batch "
    "aux_loss under it runs Megatron's, naming it (multi_copy/moe.py; tests/multi_copy/test_multi_copy.py); what "
    "else cannot run exactly is refused there or in multi_copy/recompute.py",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
    "recompute_modules", "num_microbatches_with_partial_activation_checkpoints", "moe_layer_recompute")

OUTSIDE = supported(
    "outside the block (the output layer's deferred wgrad) or per call in the linears (weight sharding)",
    "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "tensor_parallel_num_weight_shards",
    "gtp_weight_remat_size", "expert_tensor_parallel_num_weight_shards", "expert_gtp_weight_remat_size",
    "async_tensor_model_parallel_allreduce")

MOE = supported(
    "MoE layers' routing and experts, per copy: a dispatcher per copy, the routing losses combined over the "
    "copies (multi_copy/moe.py, which refuses the router types and loss combinations that do not decompose)",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_topk_limited_devices",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_score_function", "moe_router_dtype", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
    "moe_router_load_balancing_type", "moe_router_quantile_balancing_ema", "moe_router_fusion", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_shared_expert_glu_interleave_size", "use_grouped_gemm_for_shared_expert", "use_grouped_gemm_for_dense_mlp",
    "moe_mlp_glu_interleave_size", "moe_apply_probs_on_input", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm",
    "moe_single_grouped_weight", "moe_single_grouped_bias", "moe_permute_fusion", "moe_router_padding_for_fp8",
    "moe_router_padding_for_quantization", "moe_token_drop_policy", "moe_token_dropping",
    "moe_pad_expert_input_to_capacity")
DISPATCHER = supported(
    "the alltoall and allgather dispatchers (another's communication manager holds a call's state)",
    "moe_token_dispatcher_type", allows=("alltoall", "allgather"))

# multi_copy/moe.py's flags before the allow-list, same words: MoE layers only.
MOE_REFUSED = table(
    refused("the shared expert keeps a call's state between stages", "moe_shared_expert_overlap", allows=moe_only),
    refused("Megatron's own overlap of another micro-batch", "overlap_moe_expert_parallel_comm", allows=moe_only),
    refused("random jitter: the copies would draw other numbers", "moe_input_jitter_eps", allows=moe_only),
    refused("random logits: the copies would draw other numbers", "moe_router_force_load_balancing",
            allows=moe_only),
    refused("random logits: the copies would draw other numbers", "moe_router_force_biased", allows=moe_only),
    refused("a capacity per copy, from its own token count", "moe_expert_capacity_factor",
            "moe_expert_rank_capacity_factor", allows=moe_only),
    refused("latent MoE (moe_latent_size): not verified as copies", "moe_latent_size", allows=moe_only),
    refused("router replay (the routing of an earlier call replayed per call)", "moe_enable_routing_replay",
            allows=moe_only),
    refused("the flex dispatcher (its communication manager holds a call's state)", "moe_enable_deepep",
            allows=moe_only),
    refused("extended tensor parallelism of the experts (0.12), not run as copies", "moe_extended_tp",
            allows=moe_only),
    refused("the experts' paged stash keeps state between calls", "moe_paged_stash", allows=moe_only),
    refused("the weight gradients run later, outside the copies' backward", "delay_wgrad_compute",
            "overlap_dispatch_backward_with_experts_wgrad"),
)

DROPOUT = refused(
    "dropout > 0: the copies would draw their masks in another order", "hidden_dropout", "attention_dropout",
    allows=lambda value, context: not value or not context.get("training", True))

REFUSED = table(
    refused("FP8 / FP4: the scaling state (amax history) would step once per copy", "fp8", "fp4", "fp8_param",
            "fp4_param", "quant_recipe", "use_kitchen", "use_kitchen_attention", "fp8_quantizer_factory",
            "fp4_quantizer_factory"),
    refused("CPU offloading: its context keeps one call's state between the layers", "cpu_offloading",
            "fine_grained_activation_offloading"),
    refused("CUDA graphs: a captured graph replays one call, not copies taking turns", "enable_cuda_graph",
            "external_cuda_graph"),
    refused("CUDA graphs: a captured graph replays one call, not copies taking turns", "cuda_graph_impl",
            allows=("none", None)),
    refused("Transformer Engine's userbuffers overlap is sized and scheduled for the whole micro-batch",
            "tp_comm_overlap"),
    refused("Transformer Engine's symmetric all-reduce: not verified with copies' smaller calls",
            "symmetric_ar_type"),
    refused("the maximum attention logit (qk_clip / log_max_attention_logit) is recorded per call: each copy "
            "would overwrite the others'", "qk_clip", "log_max_attention_logit"),
    refused("hybrid (dynamic) context parallelism: the CP group changes with each micro-batch's sequences",
            "hybrid_context_parallel"),
    refused("multimodal rotary embeddings (mrope_section) carry the batch dimension the copies would not cut",
            "mrope_section"),
    refused("experimental attention variants (DSA's indexer and its loss, linear attention): not verified as copies",
            "experimental_attention_variant", "linear_attention_freq"),
    refused("heterogeneous layers: each layer has its own config, which the block's does not describe",
            "heterogeneous_block_specs"),
)

DETAILS = supported(
    "read only with a refused setting on (FP8 / FP4, CUDA graphs, CPU offloading, userbuffers, qk_clip, hybrid "
    "CP, experimental attention, the flex dispatcher, paged stash, EP overlap)",
    "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
    "fp8_dot_product_attention", "fp8_multi_head_attention", "fp8_output_proj", "tp_only_amax_red",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
    "activation_func_fp8_input_store", "fp4_recipe", "kitchen_attention_backend",
    "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps",
    "cuda_graph_scope", "cuda_graph_modules",
    "cpu_offloading_num_layers", "_cpu_offloading_context", "cpu_offloading_activations", "cpu_offloading_weights",
    "cpu_offloading_double_buffering", "cpu_offloading_retain_pinned_cpu_buffers", "offload_modules",
    "min_offloaded_tensor_size", "activation_offload_fraction", "delay_offload_until_cuda_graph",
    "delta_offload_bytes_across_pp_ranks", "fine_grained_offloading_max_inflight_offloads",
    "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad",
    "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs", "tp_comm_atomic_rs", "tp_comm_overlap_disable_qkv",
    "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend", "disable_parameter_transpose_cache",
    "use_transformer_engine_op_fuser", "qk_clip_alpha", "qk_clip_threshold", "max_seqlen_per_dp_cp_rank",
    "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
    "dsa_indexer_use_sparse_loss", "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset", "dsa_kernel_backend",
    "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu",
    "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "moe_flex_dispatcher_backend", "moe_deepep_num_sms", "moe_hybridep_num_sms", "moe_permute_fusion_into_hybridep",
    "moe_hybridep_pad_uneven_dispatch_inputs", "moe_flex_dispatcher_num_sms", "moe_hybridep_num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute", "moe_hybridep_num_sms_preprocessing", "moe_ncclep_static_shape",
    "moe_ncclep_zero_copy", "moe_paged_stash_page_size", "moe_paged_stash_buffer_size_factor_cuda",
    "moe_paged_stash_buffer_size_factor_cpu", "ep_overlap_early_attn_memory_release", "high_priority_a2a_comm_stream")

ROWS = table(PARALLEL, ATTENTION, NUMERICS, CHUNKED_MLP, AUTOCAST, RECOMPUTE, OUTSIDE, MOE, DISPATCHER,
             MOE_REFUSED, DROPOUT, REFUSED, DETAILS)


def _load_balancing_losses(config) -> list:
    """The load-balancing losses an MoE router forms from token counts (a type other than 'none' with a
    coefficient): 0.19 takes a type and a coefficient or a list of each."""
    types = getattr(config, "moe_router_load_balancing_type", None) or "none"
    coeffs = getattr(config, "moe_aux_loss_coeff", None) or 0.0
    types = [types] if isinstance(types, str) else list(types)
    coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(types)
    return [kind for kind, coeff in zip(types, coeffs) if kind != "none" and coeff]


def _chunks_decompose(value, context) -> bool:
    """Sequence copies with chunked MLPs: a token's own math, the z-loss (a mean over tokens), the expert
    bias and the logged values (sums) decompose; a load-balancing loss does not: Megatron forms it per chunk
    of each rank's rows from that chunk's token counts, and a sequence copy's chunk i holds other positions."""
    config = context["config"]
    return (not value or value <= 1 or not context.get("training", True)
            or not getattr(config, "num_moe_experts", None) or not _load_balancing_losses(config))


# Sequence copies (sequence.py): the same block split along the sequence, the copies meeting in the
# attention. These rows override the batch copies' (sequence.reason adds its checks of the layers'
# attention class, the arguments and the mask).
SEQUENCE_ROWS = table(
    refused("recompute (the recomputed attention would not reach the earlier copies' keys)",
            "recompute_granularity", allows=(None,)),
    refused("a sliding window", "window_size", allows=(None,)),
    refused("softmax_type other than 'vanilla'", "softmax_type", allows=("vanilla", None)),
    refused("multi-latent attention (not Megatron's SelfAttention)", "multi_latent_attention",
            allows=lambda value, context: not value),
    refused("chunked MLPs with an MoE load-balancing loss: Megatron forms the loss per chunk of its sequence from "
            "that chunk's token counts, and a sequence copy's chunk i holds other positions than Megatron's",
            "mlp_chunks_for_training", allows=_chunks_decompose),
    refused("enable_autocast (torch.autocast): the copies' meeting attention is not verified against Megatron's "
            "under it", "enable_autocast", allows=lambda value, context: not value),
)
