"""Context-parallel attention's rows: Megatron's local ``DotProductAttention`` with CP > 1 (or
COC_FLASH_ATTN at CP = 1), its scores computed by the wing's kernels over the CP group.

Megatron's local attention has no path at CP > 1 (it asserts CP = 1): a refused or unclassified
setting there is a ContextParallelError naming it at construction; at CP = 1 (COC_FLASH_ATTN) the
layer keeps Megatron's attention. context_parallel/attention.py also checks per layer the
cp_comm_type (CP_COMM_TYPES), the mask type and mask, the heads, the groups and per call the
arguments. Only what the core attention reads matters; the layers around it are Megatron's.
"""

from __future__ import annotations

from coc_inject.allowlist.common import MOE_LAYER_SETTINGS
from coc_inject.allowlist.rows import irrelevant, refused, supported, table

PARALLEL = supported(
    "context parallelism itself: the CP group and Megatron's CP layout, its cp_comm_type (checked per layer: "
    "attention.CP_COMM_TYPES) and hierarchical sizes (hybrid's Ulysses groups); the heads per TP rank",
    "context_parallel_size", "cp_comm_type", "hierarchical_context_parallel_sizes", "tensor_model_parallel_size",
    "sequence_parallel")

SCORES = supported(
    "the softmax Megatron's local attention would run: the wing's kernels compute it in fp32 with the scale "
    "Megatron's __init__ computes (query-key layer scaling included), whatever kernel Megatron would pick",
    "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "masked_softmax_fusion", "attention_backend",
    "deterministic_mode", "batch_invariant_mode", "disable_bf16_reduced_precision_matmul")

AUTOCAST = supported(
    "enable_autocast runs the forward inside torch.autocast: a call under it is not run by the wing's kernels "
    "(context_parallel/forward.AUTOCAST): at CP > 1 an error naming it (Megatron's local attention has no CP), "
    "with COC_FLASH_ATTN at CP 1 Megatron's attention (tests/context_parallel/test_cp_gpt.py)",
    "enable_autocast", "autocast_dtype")

DROPOUT = refused(
    "attention dropout > 0 (set attention_dropout=0): the wing's kernels have no dropout",
    "attention_dropout", allows=lambda value, context: not value)
WINDOW = refused("sliding-window attention (window_size)", "window_size", allows=(None,))
WINDOW_DETAILS = supported("read only with a sliding window (refused)", "window_attn_skip_freq")
SOFTMAX = refused("softmax_type other than 'vanilla' (the wing's kernels run the plain softmax)",
                  "softmax_type", allows=("vanilla", None))
MLA = refused(
    "multi-latent attention: its values' head dim differs from the queries' (the wing's kernels and output "
    "take one head dim)", "multi_latent_attention", allows=lambda value, context: not value)
MAX_LOGIT = refused(
    "the maximum attention logit (qk_clip / log_max_attention_logit): the wing's kernels do not record it",
    "qk_clip", "log_max_attention_logit")
MAX_LOGIT_DETAILS = supported("read only with qk_clip (refused)", "qk_clip_alpha", "qk_clip_threshold")
HYBRID_CP = refused(
    "hybrid (dynamic) context parallelism: the CP group changes with each micro-batch's sequences",
    "hybrid_context_parallel")
HYBRID_CP_DETAILS = supported("read only with hybrid context parallelism (refused)", "max_seqlen_per_dp_cp_rank")
CUDA_GRAPHS = refused(
    "CUDA graphs: the wing's schedule (its send / receive pairs, kernel choice, agreement) is decided per call, "
    "not replayed from a capture", "enable_cuda_graph", "external_cuda_graph")
CUDA_GRAPH_IMPL = refused(
    "CUDA graphs: the wing's schedule (its send / receive pairs, kernel choice, agreement) is decided per call, "
    "not replayed from a capture", "cuda_graph_impl", allows=("none", None))
OFFLOADING = refused(
    "activation CPU offloading: the schedules' saved blocks are not verified under Megatron's offloading",
    "cpu_offloading", "fine_grained_activation_offloading")
DETAILS = supported(
    "read only with a refused setting on (CUDA graphs, CPU offloading)",
    "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps",
    "cuda_graph_scope", "cuda_graph_modules", "cpu_offloading_num_layers", "_cpu_offloading_context",
    "cpu_offloading_activations", "cpu_offloading_weights", "cpu_offloading_double_buffering",
    "cpu_offloading_retain_pinned_cpu_buffers", "offload_modules", "min_offloaded_tensor_size",
    "activation_offload_fraction", "delay_offload_until_cuda_graph", "delta_offload_bytes_across_pp_ranks",
    "fine_grained_offloading_max_inflight_offloads")
RECOMPUTE = supported(
    "recompute: Megatron's checkpoint reruns the attention call, the same schedule again",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
    "recompute_modules", "num_microbatches_with_partial_activation_checkpoints", "moe_layer_recompute")

OTHER_ATTENTION = irrelevant(
    "another attention module (Transformer Engine's, FP8 attention, kitchen, DSA, linear attention): the wing "
    "patches Megatron's local DotProductAttention only, which never reads it",
    "flash_attention_version", "fp8_dot_product_attention", "fp8_multi_head_attention", "experimental_attention_variant",
    "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff",
    "dsa_indexer_use_sparse_loss", "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset", "dsa_kernel_backend",
    "dsa_indexer_rope_interleaved", "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu",
    "dsa_indexer_k_norm_epsilon", "dsa_indexer_k_norm_fp32", "linear_attention_freq", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "use_kitchen_attention", "kitchen_attention_backend", "transformer_impl")

NOT_READ = irrelevant(
    "outside the core attention (linears, MLP, MoE, dropout after the attention, rotary embeddings applied "
    "before it, FP8 in Transformer Engine's linears): Megatron's local DotProductAttention never reads it",
    "hidden_dropout", "mrope_section", "use_te_rng_tracker", "test_mode", "calculate_per_token_loss",
    "mlp_chunks_for_training", "heterogeneous_block_specs", "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute", "wgrad_deferral_limit", "tensor_parallel_num_weight_shards",
    "gtp_weight_remat_size", "expert_tensor_parallel_num_weight_shards", "expert_gtp_weight_remat_size",
    "delay_wgrad_compute", "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag",
    "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs",
    "tp_comm_atomic_rs", "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1", "tp_comm_bootstrap_backend",
    "symmetric_ar_type", "disable_parameter_transpose_cache", "use_transformer_engine_op_fuser",
    "async_tensor_model_parallel_allreduce", "fp8", "fp4", "fp8_param", "fp4_param", "quant_recipe", "use_kitchen",
    "fp8_quantizer_factory", "fp4_quantizer_factory", "fp8_recipe", "fp8_margin", "fp8_interval",
    "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "fp8_output_proj", "tp_only_amax_red",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
    "activation_func_fp8_input_store", "fp4_recipe",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_extended_tp",
    *MOE_LAYER_SETTINGS)

ROWS = table(PARALLEL, SCORES, AUTOCAST, DROPOUT, WINDOW, WINDOW_DETAILS, SOFTMAX, MLA, MAX_LOGIT, MAX_LOGIT_DETAILS, HYBRID_CP,
             HYBRID_CP_DETAILS, CUDA_GRAPHS, CUDA_GRAPH_IMPL, OFFLOADING, DETAILS, RECOMPUTE, OTHER_ATTENTION, NOT_READ)
