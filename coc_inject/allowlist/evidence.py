"""The evidence behind every row that says supported or irrelevant (issue 51): a test that runs the wing
with the field off its default against Megatron, or the source lines of each release that read it (all
outside the code the wings run in), or why it cannot be tested here.

* tested: the field has a value valid on the CPU (:data:`CPU_VALUES`) and the wing has a case
  (:data:`CASES`): ``tests/settings/test_evidence.py`` builds the wing's smallest real case with it,
  runs the wing on and off and compares (node id: :func:`node_id`);
* cited: every line of every release that reads it (``field_reads.json``, made by
  ``python -m coc_inject.allowlist.evidence --reads RELEASE=SRC ...``) lies outside :data:`MEETS`,
  the modules the wings' code runs in or under (the block and its layers, the linears, the fusions,
  the schedule's forward step); the config's own files are left out: what ``__post_init__`` derives
  from a field is another field, with its own row and evidence;
* cannot test here: :data:`CANNOT_TEST`, a reason per field.

``python -m coc_inject.allowlist.evidence`` prints the counts per kind and the rows with neither a test
nor a citation, each with why: it cannot be tested here, or its evidence is not built yet (:data:`NOT_YET`,
the list of what is left). Read by the tests and the command only, never by a wing.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

from coc_inject.allowlist import check
from coc_inject.allowlist.rows import IRRELEVANT, SUPPORTED

TEST = "tests/settings/test_evidence.py::test_field_off_default"
READS = pathlib.Path(__file__).with_name("field_reads.json")
RELEASES = ("0.12.1", "0.13.1", "0.14.0", "0.15.0", "0.16.1", "0.19.2")
MEETS = ("megatron/core/transformer/", "megatron/core/tensor_parallel/", "megatron/core/fusions/",
         "megatron/core/pipeline_parallel/schedules.py")
CONFIG_FILES = ("megatron/core/model_parallel_config.py", "megatron/core/transformer/transformer_config.py")

# The wing's case in test_evidence.py: "dense" (a TransformerBlock, TP 2 with SP: the linears, batch copies,
# sequence copies at micro-batch 1) and "moe" (a block of MoE layers, TP 2 x EP 2: the pieces, linears, batch
# copies) and "cp" (tests/context_parallel's tiny GPT, local spec, at CP 2 with COC_CP_ALGO=ring against
# Megatron at CP 1 on the whole sequence: dense layers only).
CASES = {"linears": ("dense", "pair", "moe"), "multi_copy": ("dense", "moe"), "moe": ("moe",),
         "sequence_copies": ("dense",), "context_parallel": ("cp",)}
# Applied by Megatron's schedule around the forward, on the CPU as torch.autocast("cpu"): Megatron's own local
# block does not run under CPU autocast (a bf16 / fp32 matmul in its layers), its linears do: the linears' case
# for it is Megatron's ColumnParallelLinear -> RowParallelLinear ("pair").
IN_LINEAR_PAIR = frozenset({"enable_autocast"})
# Read by Megatron's MoE layers too (0.19 transformer_layer.py:871-916 calls the MoE layer once per chunk): the
# copies' MoE case runs them.
# The expert-parallel sizes: read by the MoE layers, held by the MoE case (EP 2, expert TP 1).
EXPERT_SIZES = frozenset({"expert_model_parallel_size", "expert_tensor_parallel_size"})
IN_MOE_LAYERS = frozenset({"mlp_chunks_for_training"}) | EXPERT_SIZES
# Read only where rotary embeddings are applied: the CP case's GPT has them, the blocks of the other cases none.
WITH_ROPE = frozenset({"rotary_interleaved", "no_rope_freq"})


def _v(value, **companions) -> dict:
    return {"value": value, **companions}


_bf16 = "torch.bfloat16"
# Per field: a value other than its default that the cases' blocks build and run with on the CPU, and the
# settings that must come with it (a dict: the field's own name is the value; strings "torch.X" are dtypes).
CPU_VALUES = {name: settings for name, settings in {
    "activation_func": _v("torch.nn.functional.silu"),
    "add_bias_linear": _v(False),
    "add_qkv_bias": _v(True),
    "apply_query_key_layer_scaling": _v(True),
    "attention_backend": _v("AttnBackend.local"),
    "attention_dropout": _v(0.1),
    "attention_output_gate": _v(True),
    "attention_softmax_in_fp32": _v(False),
    "autocast_dtype": _v(_bf16),
    "barrier_with_L1_time": _v(False),
    "batch_invariant_mode": _v(True),
    "bf16": _v(True, params_dtype=_bf16),
    "calculate_per_token_loss": _v(True),
    "deterministic_mode": _v(True),
    "disable_bf16_reduced_precision_matmul": _v(True),
    "enable_autocast": _v(True, autocast_dtype=_bf16),
    "fp32_residual_connection": _v(True),
    "ffn_hidden_size": _v(24),
    "gated_linear_unit": _v(True),
    "glu_linear_offset": _v(0.5, gated_linear_unit=True),
    "activation_func_clamp_value": _v(3.0, gated_linear_unit=True),
    "hidden_dropout": _v(0.1),
    "kv_channels": _v(4),
    "layernorm_epsilon": _v(1e-3),
    "layernorm_zero_centered_gamma": _v(True),
    "memory_efficient_layer_norm": _v(True),
    "mlp_chunks_for_training": _v(2),
    "normalization": _v("LayerNorm"),
    "num_layers": _v(3),
    "num_attention_heads": _v(8),
    "use_cpu_initialization": _v(True),  # every case builds with it (its default is False)
    "init_method": _v("torch.nn.init.xavier_uniform_"),
    "output_layer_init_method": _v("torch.nn.init.xavier_uniform_"),
    # swiglu: the fusion Megatron allows in the MoE experts too (gelu asks for a bias, and the experts refuse it)
    "bias_activation_fusion": _v(True, gated_linear_unit=True, activation_func="torch.nn.functional.silu"),
    "bias_dropout_fusion": _v(True),
    "num_query_groups": _v(2),
    "params_dtype": _v(_bf16),
    "qk_layernorm": _v(True),
    # the parallel sizes the dense and MoE cases run at (TP 2 with SP, EP 2 with expert TP 1): set as they hold them
    "tensor_model_parallel_size": _v(2),
    "sequence_parallel": _v(True),
    "expert_model_parallel_size": _v(2),
    "expert_tensor_parallel_size": _v(1),
    "hidden_size": _v(16),  # the dense and MoE cases' own (8 a rank); the CP case's GPT takes it too
    # apex's kernel, stood in for by tests/fakes/fused_wgrad.py (the case allocates main_grad as Megatron's DDP)
    "gradient_accumulation_fusion": _v(True),
    "fp16": _v(True, params_dtype="torch.float16"),
    "cp_comm_type": _v("a2a"),
    "rotary_interleaved": _v(True),
    "no_rope_freq": _v([1]),  # the CP case's one layer without rotary embeddings
    "qk_l2_norm": _v(True),
    "softmax_scale": _v(0.3),
    "test_mode": _v(True),
    "transformer_impl": _v("local"),
    "use_te_rng_tracker": _v(True),
    "softmax_type": _v("off-by-one"),
    "use_mup": _v(True),
    "mup_width_mult": _v(2.0, use_mup=True),
    "mup_attn_scale_power": _v(0.5, use_mup=True),
    # MoE layers' settings (the MoE case)
    "moe_router_topk": _v(1, moe_router_pre_softmax=True),
    "moe_router_pre_softmax": _v(True),
    "moe_router_score_function": _v("sigmoid"),
    "moe_router_enable_expert_bias": _v(True, moe_router_score_function="sigmoid"),
    "moe_router_topk_scaling_factor": _v(2.0),
    "moe_router_num_groups": _v(2, moe_router_group_topk=1),
    "moe_router_group_topk": _v(1, moe_router_num_groups=2),
    "moe_router_dtype": _v("fp32"),
    "moe_router_load_balancing_type": _v("seq_aux_loss"),
    "moe_aux_loss_coeff": _v(0.1),
    "moe_z_loss_coeff": _v(1e-2),
    "moe_ffn_hidden_size": _v(24),
    "moe_shared_expert_intermediate_size": _v(16),
    "moe_shared_expert_gate": _v(True, moe_shared_expert_intermediate_size=16),
    "moe_apply_probs_on_input": _v(True, moe_router_topk=1, moe_router_pre_softmax=True),
    "moe_token_drop_policy": _v("position", moe_expert_capacity_factor=1.0),
    "moe_expert_capacity_factor": _v(1.0),
    "moe_layer_freq": _v([1, 0]),
    "num_moe_experts": _v(8),
}.items()}

# Fields Megatron's __post_init__ refuses or rewrites on a CPU build: set on the config once it is built.
SET_AFTER_INIT = frozenset({"batch_invariant_mode", "use_te_rng_tracker"})


def _why(why: str, *names: str) -> dict:
    return {name: why for name in names}


# Rows with no generated test and no citation: why they cannot be tested here (per field, every wing).
CANNOT_TEST = {
    **_why("FP8 / FP4: Transformer Engine's quantised kernels on a GPU (read only with fp8 / fp4 on, which the "
           "linears, copies and pieces refuse)", "fp8_recipe", "fp8_wgrad", "fp4_recipe", "tp_only_amax_red",
           "activation_func_fp8_input_store", "moe_router_padding_for_fp8", "moe_router_padding_for_quantization"),
    **_why("CUDA graphs: a capture needs CUDA (read only with CUDA graphs on, refused by every wing)",
           "cuda_graph_modules", "cuda_graph_retain_backward_graph", "cuda_graph_scope", "cuda_graph_use_single_mempool",
           "cuda_graph_warmup_steps", "inference_cuda_graph_scope", "delay_offload_until_cuda_graph"),
    **_why("read only by transformer/cuda_graphs.py's vision-encoder capture (0.19), which needs CUDA",
           "spatial_merge_size", "max_vision_cuda_graph_seq_length", "num_position_embeddings"),
    **_why("pipeline parallelism: the cases are one pipeline stage on their 2 ranks (TP / EP / CP take both) and "
           "call the block, not Megatron's pipeline schedule and p2p communication, which read it",
           "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout",
           "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
           "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
           "microbatch_group_size_per_vp_stage", "overlap_p2p_comm", "overlap_p2p_comm_warmup_flush", "batch_p2p_comm",
           "deallocate_pipeline_outputs", "variable_seq_lengths", "timers"),
    **_why("a callback Megatron's forward-backward schedule calls around the step (loss scaling, DDP's gradient / "
           "parameter sync, finalize): the cases call the block, not the schedule",
           "grad_scale_func", "moe_grad_scale_func", "mtp_grad_scale_func", "grad_sync_func", "param_sync_func",
           "no_sync_func", "finalize_model_grads_func"),
    **_why("activation CPU offloading moves a CUDA device's activations to pinned host memory: nothing to move on "
           "a CPU rank", "_cpu_offloading_context", "cpu_offloading", "cpu_offloading_activations",
           "cpu_offloading_double_buffering", "cpu_offloading_num_layers", "cpu_offloading_retain_pinned_cpu_buffers",
           "cpu_offloading_weights", "offload_modules", "fine_grained_activation_offloading"),
    **_why("the flex dispatcher's DeepEP / HybridEP / NCCL-EP kernels need CUDA (refused with moe_enable_deepep)",
           "moe_deepep_num_sms", "moe_flex_dispatcher_backend", "moe_flex_dispatcher_num_sms",
           "moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute", "moe_hybridep_num_sms",
           "moe_hybridep_num_sms_preprocessing", "moe_hybridep_pad_uneven_dispatch_inputs", "moe_ncclep_static_shape",
           "moe_ncclep_zero_copy", "moe_permute_fusion_into_hybridep", "moe_enable_deepep"),
    **_why("DSA's indexer and linear attention run CUDA-only kernels (tilelang / flash-linear-attention)",
           *("dsa_indexer_head_dim dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32 dsa_indexer_loss_coeff "
             "dsa_indexer_n_heads dsa_indexer_rope_interleaved dsa_indexer_rotate_activation dsa_indexer_scoring_relu "
             "dsa_indexer_skip_topk_offset dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_use_sparse_loss "
             "dsa_kernel_backend experimental_attention_variant experimental_attention_variant_loss_scale_func "
             "linear_attention_freq").split()),
    **_why("fused kernels of Transformer Engine / apex / CUDA (Megatron's CPU path is the unfused one the cases run)",
           "use_te_activation_func", "use_transformer_engine_op_fuser", "fused_single_qkv_rope", "apply_rope_fusion",
           "use_fused_weighted_squared_relu", "persist_layer_norm", "masked_softmax_fusion", "moe_router_fusion",
           "moe_permute_fusion", "flash_attention_version", "moe_grouped_gemm", "symmetric_ar_type"),
    **_why("a sliding window: Megatron's local attention makes its window mask on CUDA", "window_size",
           "window_attn_skip_freq"),
    **_why("read only under an inference context or InferenceMode, which a training step never passes",
           "flash_decode", "mlp_chunks_for_prefill", "inference_disable_triton_nvls_kernels",
           "inference_fuse_tp_communication", "inference_grouped_gemm_backend",
           "inference_moe_disable_fused_quant_kernels", "inference_moe_token_dispatcher_type"),
}

# The fields only Megatron's MLATransformerConfig defines (0.19.2; earlier releases a subset).
MLA_ONLY = ("beta_fast", "beta_slow", "cache_mla_latents", "kv_lora_rank", "mla_down_proj_fusion", "mscale",
            "mscale_all_dim", "original_max_position_embeddings", "q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
            "rope_type", "rotary_base", "rotary_percent", "rotary_scaling_factor", "v_head_dim")

CANNOT_TEST_IN = {
    ("multi_copy", "enable_autocast"): "Megatron's own local TransformerBlock fails under CPU autocast (bf16 over "
                                       "fp32 weights: 'expected m1 and m2 to have the same dtype'): no CPU reference; "
                                       "the copies run Megatron's linears, the linears' own row is tested",
    ("sequence_copies", "enable_autocast"): "as for multi_copy: Megatron's local block has no CPU autocast run",
    **{("context_parallel", name): "defined only by MLATransformerConfig, whose multi_latent_attention the CP wing "
                                   "refuses: no CP run reads it" for name in MLA_ONLY},
    **{("context_parallel", name): "the CP case's 2 ranks are both taken by CP 2 (TP 2 x CP 2 needs 4): run by hand "
                                   "on 4 ranks in tests/context_parallel/test_cp_gpt.py::test_tp2_cp2_sequence_parallel_gqa"
       for name in ("tensor_model_parallel_size", "sequence_parallel")},
    **{(wing, "context_parallel_size"): "the dense and MoE cases' 2 ranks are taken by TP 2 (and EP 2): CP 2 needs "
                                        "ranks of its own" for wing in ("linears", "multi_copy", "sequence_copies",
                                                                        "moe")},
    ("context_parallel", "hidden_dropout"): "dropout draws its masks over each rank's rows: at CP 2 other masks than "
                                            "Megatron's at CP 1 on the whole sequence, so no exact reference",
}

# Rows whose evidence is still to be built (issue 51: the lead's list of what is left), with why.
NOT_YET_WINGS = {
    "context_parallel": "no CPU value for the context-parallel case yet, or an MoE field (the case's GPT is dense: "
                        "MoE layers at CP 2 against CP 1 are not built there yet)",
}
NOT_YET_FIELDS = {name: "recompute in the generated case: the pool stopped answering (a rank failed inside "
                         "Megatron's checkpoint on the CPU) in this round; tests/multi_copy and tests/moe cover recompute "
                         "by hand" for name in ("distribute_saved_activations", "recompute_granularity", "recompute_method",
                                                "num_microbatches_with_partial_activation_checkpoints",
                                                "recompute_modules", "recompute_num_layers", "moe_layer_recompute")}
NOT_YET_FIELDS.update({name: "multi-token prediction: built only by a GPTModel given an mtp_block_spec; no case "
                              "builds one yet" for name in ("mtp_num_layers", "mtp_use_repeated_layer",
                                                            "mtp_loss_scaling_factor", "mtp_detach_heads")})
NOT_YET_IN = {
    ("context_parallel", "gradient_accumulation_fusion"): "the CP case's training step (cp_gpt_cases.train) "
                                                          "allocates no main_grad buffers, which the fused "
                                                          "accumulation adds into",
}
NOT_YET = "no CPU value chosen for the generated case yet (read inside the block's modules, so not citable)"


def needs_evidence(row) -> bool:
    return row.verdict in (SUPPORTED, IRRELEVANT)


def case_of(wing: str, name: str) -> str | None:
    """The case the generated test runs ``name`` in for ``wing`` (None: not tested there)."""
    if name not in CPU_VALUES:
        return None
    cases = CASES.get(wing, ())
    moe_field = name.startswith("moe_") or name == "num_moe_experts" or name in EXPERT_SIZES
    if cases == ("cp",):
        return None if moe_field or (wing, name) in CANNOT_TEST_IN or (wing, name) in NOT_YET_IN else "cp"
    if name in WITH_ROPE:
        return None
    if name in IN_LINEAR_PAIR:
        return "pair" if "pair" in CASES.get(wing, ()) else None
    moe_field = moe_field or name in IN_MOE_LAYERS
    if "moe" in cases and (moe_field or cases == ("moe",)):
        return "moe"
    return "dense" if "dense" in cases and not moe_field else None


def node_id(wing: str, name: str) -> str:
    return f"{TEST}[{wing}-{name}]"


def tested() -> list:
    """(wing, field, case) of every row the generated test runs."""
    return [(wing, name, case_of(wing, name)) for wing, spec in sorted(check.WINGS.items())
            for name, row in sorted(spec.rows.items()) if needs_evidence(row) and case_of(wing, name)]


def _reads() -> dict:
    return json.loads(READS.read_text()) if READS.exists() else {}


def citation(name: str) -> dict | None:
    """Per release, the lines that read ``name`` (empty: none outside the config's own files), where every
    release is listed and no line lies in :data:`MEETS`; otherwise None."""
    reads = _reads().get(name)
    if reads is None or set(reads) != set(RELEASES):
        return None
    if any(line.startswith(MEETS) for lines in reads.values() for line in lines):
        return None
    return reads


def of(wing: str, name: str) -> tuple | None:
    """The evidence for ``wing``'s row of ``name``: ("test", node id), ("cited", reads per release),
    ("cannot test here", why), ("not yet", why); a refused row: ("refused", its reason: the wing steps aside)."""
    row = check.classification(wing, name)
    if row is not None and not needs_evidence(row):
        return "refused", row.why
    if case_of(wing, name):
        return "test", node_id(wing, name)
    cited = citation(name)
    if cited is not None:
        return "cited", cited
    if (wing, name) in CANNOT_TEST_IN:
        return "cannot test here", CANNOT_TEST_IN[(wing, name)]
    if name in CANNOT_TEST:
        return "cannot test here", CANNOT_TEST[name]
    if (wing, name) in NOT_YET_IN:
        return "not yet", NOT_YET_IN[(wing, name)]
    if name in NOT_YET_FIELDS:
        return "not yet", NOT_YET_FIELDS[name]
    if wing in NOT_YET_WINGS:
        return "not yet", NOT_YET_WINGS[wing]
    return "not yet", NOT_YET


def gaps() -> list:
    """(wing, field, why) of the rows that say supported or irrelevant with neither a test nor a citation."""
    return [(wing, name, found[1]) for wing, spec in sorted(check.WINGS.items())
            for name, row in sorted(spec.rows.items())
            if needs_evidence(row) and (found := of(wing, name))[0] in ("cannot test here", "not yet")]


def counts() -> dict:
    found: dict = {}
    for wing, spec in check.WINGS.items():
        for name, row in spec.rows.items():
            if needs_evidence(row):
                kind = of(wing, name)[0]
                found.setdefault(wing, {}).setdefault(kind, 0)
                found[wing][kind] += 1
    return found


def reads_in(source: pathlib.Path, names) -> dict:
    """``name -> [file:line, ...]``: the lines of a release's ``megatron/core`` that read each name (an attribute
    ``.name`` or a string ``"name"``), the config's own files left out (they define the fields)."""
    root = source.parent.parent
    found: dict = {name: [] for name in names}
    patterns = {name: re.compile(r"\.%s\b|['\"]%s['\"]" % (name, name)) for name in names}
    for path in sorted(source.rglob("*.py")):
        where = str(path.relative_to(root))
        if where in CONFIG_FILES:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            for name, pattern in patterns.items():
                if pattern.search(line):
                    found[name].append(f"{where}:{number}")
    return found


def main(argv) -> int:
    if argv[:1] == ["--reads"]:  # --reads 0.12.1=/path/to/megatron/core ...: rewrite field_reads.json
        names = sorted({name for spec in check.WINGS.values() for name in spec.rows})
        reads: dict = {}
        for pair in argv[1:]:
            release, source = pair.split("=", 1)
            for name, lines in reads_in(pathlib.Path(source), names).items():
                reads.setdefault(name, {})[release] = lines
        kept = {name: per_release for name, per_release in reads.items()  # only what can be cited
                if not any(line.startswith(MEETS) for lines in per_release.values() for line in lines)}
        READS.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
        return 0
    for wing, kinds in sorted(counts().items()):
        print(wing, ", ".join(f"{kind}: {count}" for kind, count in sorted(kinds.items())))
    missing = gaps()
    print(f"{len(missing)} rows say supported or irrelevant with neither a test nor a citation" +
          (":" if missing else ""))
    for wing, name, why in missing:
        print(f"  {wing}: {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
