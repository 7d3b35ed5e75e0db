"""Rows every wing shares: settings with one verdict for all four wings. A wing's own table
overrides a row here; a setting whose verdict differs between wings is in each wing's table instead."""

from __future__ import annotations

from coc_inject.allowlist import subclasses
from coc_inject.allowlist.rows import irrelevant, supported, table

PIPELINE = irrelevant(
    "pipeline parallelism: between the stages, outside every layer, attention and block",
    "pipeline_model_parallel_comm_backend", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "pipeline_model_parallel_split_rank", "pipeline_model_parallel_layout", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "microbatch_group_size_per_vp_stage", "overlap_p2p_comm",
    "overlap_p2p_comm_warmup_flush", "batch_p2p_comm", "batch_p2p_sync", "use_ring_exchange_p2p",
    "deallocate_pipeline_outputs", "variable_seq_lengths", "pipeline_dtype")

INITIALISATION = irrelevant(
    "initialisation: the parameters' first values, set before any call",
    "perform_initialization", "use_cpu_initialization", "init_method", "output_layer_init_method",
    "init_method_std", "init_model_with_meta_device", "embedding_init_method", "embedding_init_method_std")

LOOP = irrelevant(
    "the training loop's hooks (gradient scaling and reduction, timers, logging, checkpoints), outside a "
    "layer's forward and backward",
    "timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func", "param_sync_func",
    "moe_grad_scale_func", "mtp_grad_scale_func", "barrier_with_L1_time", "config_logger_dir",
    "moe_per_layer_logging", "experimental_attention_variant_loss_scale_func", "hetereogenous_dist_checkpoint")

OUTSIDE = irrelevant(
    "the embedding, the output layer, the loss and multi-token prediction's head: outside the TransformerBlock "
    "(their linears are checked per call)",
    "clone_scatter_output_in_embedding", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "mtp_num_layers",
    "mtp_loss_scaling_factor", "mtp_standalone", "mtp_use_repeated_layer", "mtp_detach_heads",
    "mtp_hybrid_override_pattern")

INFERENCE = irrelevant(
    "inference only: training never reads it (the wings' inference calls are refused per call)",
    "flash_decode", "inference_rng_tracker", "inference_sampling_seed", "inference_fuse_tp_communication",
    "nccl_all_reduce_for_prefill", "inference_disable_triton_nvls_kernels", "inference_grouped_gemm_backend",
    "inference_moe_disable_fused_quant_kernels", "inference_moe_token_dispatcher_type", "inference_cuda_graph_scope",
    "mlp_chunks_for_prefill", "moe_pad_experts_for_cuda_graph_inference", "cache_mla_latents",
    "use_inference_optimized_layers")

MAMBA = irrelevant(
    "Mamba's layers (hybrid models' MambaStack, not a TransformerBlock, a DotProductAttention or an MoE layer)",
    "is_hybrid_model", "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
    "use_mamba_mem_eff_path", "mamba_training_ssm_states_dtype")

SHAPE = supported(
    "the model's shape and dtype: every wing takes any (each checks the shapes and dtypes of its calls)",
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels", "num_query_groups",
    "softmax_scale", "params_dtype", "bf16", "fp16")

TOKENWISE = supported(
    "the layers' own math around the wing's part, token by token, run as Megatron wrote it",
    "activation_func", "activation_func_clamp_value", "glu_linear_offset", "gated_linear_unit",
    "use_te_activation_func", "use_fused_weighted_squared_relu", "normalization", "layernorm_epsilon",
    "layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm", "fused_residual_rmsnorm",
    "qk_layernorm", "qk_l2_norm", "add_bias_linear", "add_qkv_bias", "bias_activation_fusion",
    "bias_dropout_fusion", "apply_rope_fusion", "fused_single_qkv_rope", "rotary_interleaved", "no_rope_freq",
    "fp32_residual_connection", "apply_residual_connection_post_layernorm", "attention_output_gate",
    "use_mup", "mup_width_mult", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
    "mup_base_head_dim", "mup_attn_scale_power")

MLA_SHAPE = supported(
    "multi-latent attention's shape and rope (its layers' own math; multi_latent_attention itself is "
    "classified per wing)",
    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_base",
    "rotary_percent", "rotary_scaling_factor", "max_position_embeddings", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "mla_down_proj_fusion")

# The MoE layer's own settings (routing, dispatchers, experts): no dense layer, linear or attention reads
# them (linears.py and context_parallel.py: not read; moe.py and multi_copy.py classify each).
MOE_LAYER_SETTINGS = (
    "num_moe_experts", "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap", "moe_layer_freq",
    "moe_ffn_hidden_size", "moe_router_load_balancing_type", "moe_router_topk", "moe_router_topk_limited_devices",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_score_function", "moe_router_dtype", "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate", "moe_grouped_gemm", "moe_use_legacy_grouped_gemm", "moe_aux_loss_coeff",
    "moe_z_loss_coeff", "moe_input_jitter_eps", "moe_token_dropping", "moe_token_dispatcher_type",
    "moe_enable_deepep", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    "moe_permute_fusion", "moe_apply_probs_on_input", "moe_deepep_num_sms", "moe_router_padding_for_fp8",
    "moe_router_force_load_balancing", "overlap_moe_expert_parallel_comm", "moe_router_fusion",
    "moe_shared_expert_gate", "moe_enable_routing_replay", "moe_router_padding_for_quantization",
    "moe_flex_dispatcher_backend", "moe_latent_size", "moe_hybridep_num_sms",
    "ep_overlap_early_attn_memory_release", "overlap_dispatch_backward_with_experts_wgrad",
    "high_priority_a2a_comm_stream", "use_grouped_gemm_for_shared_expert", "moe_shared_expert_glu_interleave_size",
    "moe_router_quantile_balancing_ema", "moe_router_force_biased", "use_grouped_gemm_for_dense_mlp",
    "moe_single_grouped_weight", "moe_single_grouped_bias", "moe_permute_fusion_into_hybridep",
    "moe_hybridep_pad_uneven_dispatch_inputs", "moe_flex_dispatcher_num_sms", "moe_hybridep_num_blocks_permute",
    "moe_hybridep_num_blocks_unpermute", "moe_hybridep_num_sms_preprocessing", "moe_ncclep_static_shape",
    "moe_ncclep_zero_copy", "moe_mlp_glu_interleave_size", "moe_expert_rank_capacity_factor", "moe_paged_stash",
    "moe_paged_stash_page_size", "moe_paged_stash_buffer_size_factor_cuda",
    "moe_paged_stash_buffer_size_factor_cpu",)

ROWS = table(PIPELINE, INITIALISATION, LOOP, OUTSIDE, INFERENCE, MAMBA, SHAPE, TOKENWISE, MLA_SHAPE,
             subclasses.ROWS)  # names Megatron reads off a subclass's fields
