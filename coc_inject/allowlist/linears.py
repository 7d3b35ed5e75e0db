"""The tensor-parallel linears' rows: one Column / Row call of Megatron's local linears
(``megatron.core.tensor_parallel.layers``), its matmul chunked against its collective.

Those layers read few settings (their parallel sizes, sequence parallelism, fused gradient
accumulation, CPU offloading, the deferred embedding wgrad, initialisation); a call that cannot run
exactly is also refused per call (linears/guards.py: shapes, expert layers, weight sharding, the
offloading context, arguments). Everything outside the linear call is irrelevant here.
"""

from __future__ import annotations

from coc_inject.allowlist.common import MOE_LAYER_SETTINGS
from coc_inject.allowlist.rows import irrelevant, refused, supported, table

PARALLEL = supported(
    "the linears' own parallelism: the tensor-parallel group, sequence parallelism's all-gather / "
    "reduce-scatter, expert layers (whose communication is the dispatcher's: Megatron's path per call)",
    "tensor_model_parallel_size", "sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "moe_extended_tp")

GRADIENTS = supported(
    "fused weight-gradient accumulation into main_grad, written as Megatron writes it (tests/gpu_defaults)",
    "gradient_accumulation_fusion")

AUTOCAST = supported(
    "enable_autocast runs the forward inside torch.autocast, which Megatron's linear Function honours "
    "(custom_fwd / custom_bwd): the chunked and fused Functions cast their matmul operands to autocast_dtype "
    "themselves (pipeline/autocast.py), outputs, dgrads and collectives in it, the input all-gathers in the "
    "input's dtype, as Megatron's (tests/linears/test_autocast.py)",
    "enable_autocast", "autocast_dtype")

IMPL = supported(
    "the layers' implementation: 'inference_optimized' output all-gather handled (linears/guards.GUARDS)",
    "transformer_impl")

OFFLOADING = supported(
    "activation CPU offloading: a call inside Megatron's offloading context takes Megatron's path "
    "(linears/guards: checked per call)",
    "cpu_offloading", "cpu_offloading_num_layers", "_cpu_offloading_context", "cpu_offloading_activations",
    "cpu_offloading_weights", "cpu_offloading_double_buffering", "cpu_offloading_retain_pinned_cpu_buffers")

FINE_GRAINED_OFFLOADING = supported(
    "fine-grained activation offloading moves saved tensors through autograd's saved-tensor hooks, which the "
    "chunked autograd Functions' saved tensors go through as Megatron's do",
    "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
    "activation_offload_fraction", "delay_offload_until_cuda_graph", "delta_offload_bytes_across_pp_ranks",
    "fine_grained_offloading_max_inflight_offloads")

SHARDING = supported(
    "tensor-parallel weight sharding: a layer whose weight is a shard takes Megatron's path per call "
    "(linears/guards: gtp_remat_size, the weight's shape)",
    "tensor_parallel_num_weight_shards", "gtp_weight_remat_size", "expert_tensor_parallel_num_weight_shards",
    "expert_gtp_weight_remat_size")

DEFERRED = refused(
    "defer_embedding_wgrad_compute keeps its own wgrad buffers (a column linear: the output layer)",
    "defer_embedding_wgrad_compute", allows=lambda value, context: not value or context.get("kind") == "row")

DEFERRAL_LIMIT = supported("read only with defer_embedding_wgrad_compute (refused for column linears)",
                           "wgrad_deferral_limit")

QUANTISED = refused(
    "FP8 / FP4 / quantised linears: Megatron quantises in Transformer Engine's (or kitchen's) layers; "
    "coc-inject's chunked matmuls are not quantised, so it steps aside rather than guess",
    "fp8", "fp4", "fp8_param", "fp4_param", "quant_recipe", "use_kitchen", "fp8_quantizer_factory",
    "fp4_quantizer_factory")

QUANTISED_DETAILS = supported(
    "read only with FP8 / FP4 on (refused)",
    "fp8_recipe", "fp8_margin", "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad",
    "fp8_dot_product_attention", "fp8_multi_head_attention", "fp8_output_proj", "tp_only_amax_red",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
    "activation_func_fp8_input_store", "fp4_recipe")

CUDA_GRAPHS = refused(
    "CUDA graphs: a captured graph replays fixed kernels and collectives; the chunked path's per-call "
    "decisions (routes, auto's trials, agreement) cannot run inside a capture",
    "enable_cuda_graph", "external_cuda_graph")
CUDA_GRAPH_IMPL = refused(
    "CUDA graphs: a captured graph replays fixed kernels and collectives; the chunked path's per-call "
    "decisions (routes, auto's trials, agreement) cannot run inside a capture",
    "cuda_graph_impl", allows=("none", None))
CUDA_GRAPH_DETAILS = supported(
    "read only with CUDA graphs on (refused)",
    "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps",
    "cuda_graph_scope", "cuda_graph_modules")

TE_ONLY = irrelevant(
    "Transformer Engine's linears only (userbuffers, symmetric all-reduce, transposes, op fuser): Megatron's "
    "local linears never read it",
    "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
    "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs", "tp_comm_atomic_rs",
    "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend", "symmetric_ar_type",
    "disable_parameter_transpose_cache", "use_transformer_engine_op_fuser", "async_tensor_model_parallel_allreduce",
    "delay_wgrad_compute")

NOT_READ = irrelevant(
    "not read by Megatron's ColumnParallelLinear / RowParallelLinear: one linear call computes the same "
    "whatever it says (the layers around it are Megatron's)",
    # attention, its kernels and context parallelism
    "attention_dropout", "attention_backend", "attention_softmax_in_fp32", "apply_query_key_layer_scaling",
    "masked_softmax_fusion", "window_size", "window_attn_skip_freq", "softmax_type", "context_parallel_size",
    "cp_comm_type", "hierarchical_context_parallel_sizes", "hybrid_context_parallel", "max_seqlen_per_dp_cp_rank",
    "flash_attention_version", "multi_latent_attention", "qk_clip", "qk_clip_alpha", "qk_clip_threshold",
    "log_max_attention_logit", "experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
    "dsa_indexer_topk", "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "dsa_indexer_topk_freq",
    "dsa_indexer_skip_topk_offset", "dsa_kernel_backend", "dsa_indexer_rope_interleaved",
    "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon",
    "dsa_indexer_k_norm_fp32", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "use_kitchen_attention",
    "kitchen_attention_backend", "mrope_section",
    # the block: dropout, recompute, RNG, heterogeneous layers, MLP chunks
    "hidden_dropout", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "distribute_saved_activations", "recompute_modules", "num_microbatches_with_partial_activation_checkpoints",
    "use_te_rng_tracker", "heterogeneous_block_specs", "mlp_chunks_for_training", "calculate_per_token_loss",
    "deterministic_mode", "batch_invariant_mode", "test_mode",
    "moe_layer_recompute",
    "disable_bf16_reduced_precision_matmul",
    *MOE_LAYER_SETTINGS)

ROWS = table(PARALLEL, GRADIENTS, AUTOCAST, IMPL, OFFLOADING, FINE_GRAINED_OFFLOADING, SHARDING, DEFERRED, DEFERRAL_LIMIT, QUANTISED, QUANTISED_DETAILS,
             CUDA_GRAPHS, CUDA_GRAPH_IMPL, CUDA_GRAPH_DETAILS, TE_ONLY, NOT_READ)
