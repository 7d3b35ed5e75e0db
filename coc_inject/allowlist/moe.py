"""The MoE pieces' rows: Megatron's ``alltoall`` dispatcher's dispatch and combine cut into pieces
around ``SequentialMLP``'s local experts or grouped experts (``GroupedMLP``, ``TEGroupedMLP``; moe/guards.py
also checks the layer's dispatcher and experts classes, EP 1 and inference per layer or call). Routing,
permutation, the shared expert, the aux losses and recompute run as Megatron wrote them; the attention and
the dense layers are irrelevant.
"""

from __future__ import annotations

from coc_inject.allowlist.rows import irrelevant, refused, supported, table

PARALLEL = supported(
    "the groups the pieces run over: expert parallelism (the all-to-all), expert tensor parallelism (its "
    "all-gather / reduce-scatter), TP x CP tokens, sequence parallelism (tests/moe)",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "tensor_model_parallel_size", "sequence_parallel",
    "context_parallel_size")

ROUTING = supported(
    "routing and its losses: Megatron's router runs as it is, the pieces take its probabilities and map",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_topk_limited_devices",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_score_function", "moe_router_dtype", "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
    "moe_router_load_balancing_type", "moe_router_quantile_balancing_ema", "moe_router_fusion",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_router_force_load_balancing",
    "moe_router_force_biased", "moe_enable_routing_replay", "calculate_per_token_loss")

EXPERTS = supported(
    "the experts' own math and the token drops Megatron makes before the dispatch (capacity: tests/moe), "
    "the shared expert beside the pieces, probabilities on the input (moe/calls.py)",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_shared_expert_glu_interleave_size",
    "use_grouped_gemm_for_shared_expert", "moe_mlp_glu_interleave_size", "moe_apply_probs_on_input",
    "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_token_dropping", "gradient_accumulation_fusion",
    "mlp_chunks_for_training")

DISPATCHER = supported(
    "the pieces run Megatron's alltoall dispatcher only (the allgather dispatcher moves every token to every "
    "rank: nothing to cut per expert; flex: DeepEP / HybridEP kernels)",
    "moe_token_dispatcher_type", allows=("alltoall",))

FLEX = refused("the flex dispatcher (DeepEP / HybridEP kernels)", "moe_enable_deepep")
FLEX_DETAILS = supported(
    "read only by the flex dispatcher (refused)",
    "moe_flex_dispatcher_backend", "moe_deepep_num_sms", "moe_hybridep_num_sms", "moe_permute_fusion_into_hybridep",
    "moe_hybridep_pad_uneven_dispatch_inputs", "moe_flex_dispatcher_num_sms", "moe_hybridep_num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute", "moe_hybridep_num_sms_preprocessing", "moe_ncclep_static_shape",
    "moe_ncclep_zero_copy", "moe_expert_rank_capacity_factor")

GROUPED = supported(
    "grouped experts run as pieces, each a chunk of every local expert's rows in one call of the experts' forward "
    "(moe/grouped.py; tests/moe/test_moe_grouped.py): the legacy GroupedMLP (the local spec, 0.12 to 0.16; one "
    "grouped GEMM, against a CPU stand-in of grouped_gemm) and TEGroupedMLP by its interface (against stand-ins of "
    "Transformer Engine's grouped linears, never TE itself; its op-fuser path refused by moe/guards.py)",
    "moe_grouped_gemm", "moe_use_legacy_grouped_gemm")
GROUPED_DETAILS = supported(
    "read only inside TEGroupedMLP's grouped linears: the pieces call its forward as Megatron's dispatcher does",
    "moe_single_grouped_weight", "moe_single_grouped_bias")

# The feature each reason names (moe/guards.py's deny-list before the allow-list, same words).
REFUSED = table(
    refused("FP8: its quantised expert inputs are padded per expert inside Megatron's experts", "fp8", "fp8_param"),
    refused("FP4: its quantised expert inputs are padded per expert inside Megatron's experts", "fp4", "fp4_param"),
    refused("quantised experts (kitchen / a quantisation recipe): their inputs are padded inside the experts",
            "use_kitchen", "quant_recipe", "fp8_quantizer_factory", "fp4_quantizer_factory"),
    refused("moe_permute_fusion (Transformer Engine's fused permute kernels)", "moe_permute_fusion"),
    refused("padding expert inputs to capacity (moe_pad_expert_input_to_capacity): the all-to-all is dense per "
            "capacity", "moe_pad_expert_input_to_capacity"),
    refused("router padding for quantization", "moe_router_padding_for_quantization"),
    refused("router padding for FP8", "moe_router_padding_for_fp8"),
    refused("Megatron's own shared-expert overlap (moe_shared_expert_overlap) runs inside the dispatcher's "
            "all-to-alls", "moe_shared_expert_overlap"),
    refused("Megatron's own EP overlap (overlap_moe_expert_parallel_comm) is on: coc-inject steps aside",
            "overlap_moe_expert_parallel_comm"),
    refused("delay_wgrad_compute (the experts' weight gradients run later, outside the layer)",
            "delay_wgrad_compute"),
    refused("overlap_dispatch_backward_with_experts_wgrad", "overlap_dispatch_backward_with_experts_wgrad"),
    refused("latent MoE (moe_latent_size)", "moe_latent_size"),
    refused("CUDA graphs (enable_cuda_graph)", "enable_cuda_graph"),
    refused("CUDA graphs (external_cuda_graph)", "external_cuda_graph"),
    refused("CUDA graphs (cuda_graph_impl)", "cuda_graph_impl", allows=("none", None)),
    refused("moe_paged_stash", "moe_paged_stash"),
    refused("extended tensor parallelism of the experts (0.12): not run by the pieces", "moe_extended_tp"),
    refused("expert weight sharding: the experts' weights are shards Megatron gathers (not run by the pieces)",
            "expert_tensor_parallel_num_weight_shards", "expert_gtp_weight_remat_size",
            allows=lambda value, context: value in (None, 1)),
    refused("activation CPU offloading: the pieces' saved tensors are not verified under Megatron's offloading "
            "context", "cpu_offloading", "fine_grained_activation_offloading"),
)

DETAILS = supported(
    "read only with a refused setting on (FP8 / FP4, CUDA graphs, CPU offloading, paged stash, EP overlap)",
    "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
    "fp8_dot_product_attention", "fp8_multi_head_attention", "fp8_output_proj", "tp_only_amax_red",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
    "activation_func_fp8_input_store", "fp4_recipe", "cuda_graph_use_single_mempool",
    "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps", "cuda_graph_scope", "cuda_graph_modules",
    "cpu_offloading_num_layers", "_cpu_offloading_context", "cpu_offloading_activations", "cpu_offloading_weights",
    "cpu_offloading_double_buffering", "cpu_offloading_retain_pinned_cpu_buffers", "offload_modules",
    "min_offloaded_tensor_size", "activation_offload_fraction", "delay_offload_until_cuda_graph",
    "delta_offload_bytes_across_pp_ranks", "fine_grained_offloading_max_inflight_offloads",
    "moe_paged_stash_page_size", "moe_paged_stash_buffer_size_factor_cuda", "moe_paged_stash_buffer_size_factor_cpu",
    "ep_overlap_early_attn_memory_release", "high_priority_a2a_comm_stream")

RECOMPUTE = supported(
    "recompute: Megatron's checkpoint reruns the layer's forward, the pieces again (tests/moe: recompute)",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
    "recompute_modules", "num_microbatches_with_partial_activation_checkpoints", "moe_layer_recompute")

NUMERICS = supported(
    "numerics around the pieces that Megatron's experts and unpermute apply as they would (deterministic and "
    "batch-invariant kernels)",
    "deterministic_mode", "batch_invariant_mode", "disable_bf16_reduced_precision_matmul")

AUTOCAST = supported(
    "enable_autocast runs the forward inside torch.autocast: a layer call under it runs Megatron's dispatcher "
    "(moe/guards.AUTOCAST, checked per call; tests/moe/test_moe.py)",
    "enable_autocast", "autocast_dtype")

NOT_READ = irrelevant(
    "outside the MoE layer (attention, dense linears, dropout, the block): the pieces never see it",
    "attention_dropout", "attention_backend", "attention_softmax_in_fp32", "apply_query_key_layer_scaling",
    "masked_softmax_fusion", "window_size", "window_attn_skip_freq", "softmax_type", "cp_comm_type",
    "hierarchical_context_parallel_sizes", "hybrid_context_parallel", "max_seqlen_per_dp_cp_rank",
    "flash_attention_version", "multi_latent_attention", "qk_clip", "qk_clip_alpha", "qk_clip_threshold",
    "log_max_attention_logit", "experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
    "dsa_indexer_topk", "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_indexer_topk_freq",
    "dsa_indexer_skip_topk_offset", "dsa_kernel_backend", "dsa_indexer_rope_interleaved",
    "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon",
    "dsa_indexer_k_norm_fp32", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "use_kitchen_attention",
    "kitchen_attention_backend", "mrope_section", "hidden_dropout", "use_te_rng_tracker", "heterogeneous_block_specs",
    "test_mode", "use_grouped_gemm_for_dense_mlp", "defer_embedding_wgrad_compute", "wgrad_deferral_limit",
    "tensor_parallel_num_weight_shards", "gtp_weight_remat_size", "transformer_impl",
    "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
    "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs", "tp_comm_atomic_rs",
    "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend", "symmetric_ar_type",
    "disable_parameter_transpose_cache", "use_transformer_engine_op_fuser", "async_tensor_model_parallel_allreduce")

ROWS = table(PARALLEL, ROUTING, EXPERTS, DISPATCHER, FLEX, FLEX_DETAILS, GROUPED, GROUPED_DETAILS, REFUSED, DETAILS,
             RECOMPUTE, NUMERICS, AUTOCAST, NOT_READ)
