"""The settings allow-list (coc_inject/allowlist): every field of every supported megatron-core
release's TransformerConfig is classified by every wing; an unclassified field with a value other
than its default, or a refused one, sends the layer, call or block to Megatron's path naming it.

megatron_config_fields.json holds the field names of TransformerConfig (ModelParallelConfig's
included) and MLATransformerConfig's own, read from each release's sources (0.12.1 to 0.19.2); a new
release adds its names there (the test of the installed release says when they are missing).
"""

import dataclasses
import json
import pathlib
import types

import pytest
import torch

from coc_inject.allowlist import check, subclasses
from coc_inject.allowlist.rows import IRRELEVANT, REFUSED, SUPPORTED

FIELDS = json.loads((pathlib.Path(__file__).parent / "megatron_config_fields.json").read_text())
WINGS = sorted(check.WINGS)


def installed_fields() -> dict:
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    names = [f.name for f in dataclasses.fields(TransformerConfig)]
    return {"TransformerConfig": names,
            "MLATransformerConfig": [f.name for f in dataclasses.fields(MLATransformerConfig) if f.name not in names]}


@pytest.mark.parametrize("wing", WINGS)
def test_every_field_of_the_installed_release_is_classified(wing):
    names = [name for group in installed_fields().values() for name in group]
    assert check.unclassified(names, wing) == [], f"classify these for {wing} in coc_inject/allowlist/"


@pytest.mark.parametrize("release", sorted(FIELDS))
@pytest.mark.parametrize("wing", WINGS)
def test_every_field_of_every_supported_release_is_classified(wing, release):
    names = FIELDS[release]["TransformerConfig"] + FIELDS[release]["MLATransformerConfig"]
    assert check.unclassified(names, wing) == [], f"{release}: classify these for {wing} in coc_inject/allowlist/"


def test_the_installed_release_has_no_field_the_committed_lists_miss():
    """A newer megatron-core's new fields must be classified and added to megatron_config_fields.json."""
    import megatron.core

    committed = FIELDS.get(megatron.core.__version__)
    known = {name for release in FIELDS.values() for group in release.values() for name in group}
    installed = installed_fields()
    assert sorted(n for group in installed.values() for n in group if n not in known) == []
    if committed is not None:
        assert {k: sorted(v) for k, v in installed.items()} == committed


def test_every_row_names_a_field_of_some_release_and_says_why():
    known = {name for release in FIELDS.values() for group in release.values() for name in group}
    known |= subclasses.READ_UNDECLARED  # read by Megatron where a subclass declares them (allowlist/subclasses.py)
    for wing in check.WINGS.values():
        assert sorted(set(wing.rows) - known) == [], wing.name
        for row in wing.rows.values():
            assert row.verdict in (IRRELEVANT, SUPPORTED, REFUSED) and len(row.why) > 12, row


# -- what a wing does with a config --------------------------------------------------------------

def small_config(cls=None, **settings):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2,
                sequence_parallel=True, context_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0,
                num_moe_experts=4, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2,
                add_bias_linear=False, use_cpu_initialization=True, gradient_accumulation_fusion=False,
                bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                persist_layer_norm=False, apply_rope_fusion=False)
    return (cls or TransformerConfig)(**{**base, **settings})


def guard_reasons(config) -> dict:
    """Each wing's own guard on a layer / block of ``config`` (stand-ins: the allow-list is asked first)."""
    from coc_inject.context_parallel import attention
    from coc_inject.linears import guards as linear_guards
    from coc_inject.moe import guards as moe_guards
    from coc_inject.multi_copy import sequence, splits

    layer = types.SimpleNamespace(config=config, tp_group=None, token_dispatcher=None, experts=None, weight=None,
                                  bias=None, input_size=8, input_size_per_partition=8, output_size=8,
                                  output_size_per_partition=8, sequence_parallel=False, input_is_parallel=True,
                                  gather_output=False, skip_bias_add=False, gradient_accumulation_fusion=False)
    block = types.SimpleNamespace(config=config, training=True, layers=[])
    coc = types.SimpleNamespace(cp_algorithm="ring", cp_ulysses_degree=None, cp_window=1, cp_mask_type=None,
                                attn_kernel="auto")
    try:
        attention.plan_layer(coc, config, 1, None, None, None, None)
        cp = None
    except attention.ContextParallelError as exc:
        cp = str(exc)
    row = linear_guards.row_guards(layer, torch.zeros(4, 1, 8), (), {})
    column = linear_guards.column_guards(None, layer, torch.zeros(4, 1, 8), None, (), {})
    return {"row": getattr(row, "reason", row), "column": getattr(column, "reason", column),
            "moe": moe_guards.layer_reason(layer), "multi_copy": splits.block_reason(block, 2),
            "sequence": _or_error(sequence.reason, block, 1, 8, 2, {}, 8), "context_parallel": cp}


def _or_error(function, *args):
    """The stand-in block has no layers or inputs: past the allow-list a guard may fail on that."""
    try:
        return function(*args)
    except Exception as exc:  # noqa: BLE001
        return f"past the allow-list: {exc!r}"


def test_the_configurations_users_run_are_not_refused():
    """Megatron-LM's GPU defaults (bf16, fused kernels, fused wgrad accumulation, recompute) and the
    MoE routing the copies combine: no wing refuses a setting of them."""
    configs = [
        small_config(),
        small_config(bf16=True, params_dtype=torch.bfloat16, gradient_accumulation_fusion=True, add_bias_linear=True, num_moe_experts=None,
                     moe_token_dispatcher_type="allgather", expert_model_parallel_size=1,
                     bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=True,
                     persist_layer_norm=True, deallocate_pipeline_outputs=True, cross_entropy_loss_fusion=True,
                     recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        small_config(moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3,
                     moe_router_load_balancing_type="seq_aux_loss", moe_router_enable_expert_bias=True,
                     moe_router_score_function="sigmoid", moe_shared_expert_intermediate_size=64,
                     moe_expert_capacity_factor=None, num_query_groups=2, qk_layernorm=True,
                     normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu),
    ]
    for config in configs:
        for wing in (check.LINEARS, check.CONTEXT_PARALLEL, check.MULTI_COPY, check.MOE):
            if wing != check.MOE or config.num_moe_experts:
                assert check.refusal(config, wing, training=True, kind="column") is None, (wing, config)
        if config.num_moe_experts is None:
            assert check.refusal(config, check.MOE) is not None  # its default dispatcher: allgather
        recompute = check.refusal(config, check.SEQUENCE_COPIES, training=True)
        assert recompute is None if config.recompute_granularity is None else "recompute_granularity='full'" in recompute


@dataclasses.dataclass
class _Newer:
    coc_test_new_knob: int = 0  # a field some future release adds


def test_an_unclassified_field_set_sends_every_wing_to_megatrons_path_naming_it():
    from megatron.core.transformer.transformer_config import TransformerConfig

    newer = dataclasses.make_dataclass("NewerTransformerConfig", [("coc_test_new_knob", int, 0)],
                                       bases=(TransformerConfig,))
    newer.__module__ = TransformerConfig.__module__  # Megatron's own (a subclass's field is not read: subclasses.py)
    for wing in (check.LINEARS, check.CONTEXT_PARALLEL, check.MULTI_COPY, check.SEQUENCE_COPIES, check.MOE):
        assert check.refusal(small_config(newer), wing, training=True) is None  # at its default: nothing to say
    reasons = guard_reasons(small_config(newer, coc_test_new_knob=3))
    for where, reason in reasons.items():
        assert reason is not None and "coc_test_new_knob=3 is not classified for" in reason, (where, reason)
    assert "running Megatron's path" in reasons["row"] and "running Megatron's dispatcher" in reasons["moe"]
    assert "running Megatron's block" in reasons["multi_copy"]


def test_a_refused_field_names_the_field_and_the_reason():
    config = small_config()
    config.fp8 = "hybrid"  # set after construction: Megatron's __post_init__ wants Transformer Engine for it
    reasons = guard_reasons(config)
    for where in ("row", "column", "moe", "multi_copy"):
        assert reasons[where].startswith("fp8='hybrid' is refused by "), (where, reasons[where])
    assert "amax history" in reasons["multi_copy"] and "FP8" in reasons["moe"]
    assert "fp8" not in reasons["context_parallel"]  # the local attention has no FP8 path: irrelevant there
    cp = guard_reasons(small_config(window_size=(8, 0)))["context_parallel"]
    assert "window_size=(8, 0) is refused by context-parallel attention: sliding-window" in cp


def test_values_a_row_accepts_depend_on_the_layer_and_the_call():
    config = small_config(hidden_dropout=0.1)
    config.defer_embedding_wgrad_compute = True  # Megatron wants pipeline parallelism for it at construction
    assert "dropout > 0" in check.refusal(config, check.MULTI_COPY, training=True)
    assert check.refusal(config, check.MULTI_COPY, training=False) is None  # eval: no dropout drawn
    assert check.refusal(config, check.LINEARS, kind="row") is None  # only the output layer defers its wgrad
    assert "defer_embedding_wgrad_compute=True" in check.refusal(config, check.LINEARS, kind="column")
    dropout = small_config(attention_dropout=0.1)  # the layer's own attention_dropout argument wins
    assert check.refusal(dropout, check.CONTEXT_PARALLEL, values={"attention_dropout": 0.0}) is None
    assert "attention_dropout=0.1" in check.refusal(dropout, check.CONTEXT_PARALLEL)


def test_cuda_graphs_of_every_release_are_refused_by_the_copies():
    """external_cuda_graph (0.13 to 0.15) slipped through the copies' old deny-list."""
    for name, value in (("external_cuda_graph", True), ("enable_cuda_graph", True), ("cuda_graph_impl", "local")):
        stand_in = types.SimpleNamespace(**{name: value})  # not Megatron's dataclass: the rows that can refuse
        assert check.refusal(stand_in, check.MULTI_COPY).startswith(f"{name}={value!r} is refused by multi-copy")
        assert check.refusal(stand_in, check.MOE) is not None


def test_moe_only_rows_leave_dense_blocks_alone():
    dense = small_config(num_moe_experts=None, expert_model_parallel_size=1)
    dense.moe_expert_capacity_factor = 1.0  # a leftover MoE setting in a dense model
    assert check.refusal(dense, check.MULTI_COPY, training=True) is None
    moe = small_config(moe_expert_capacity_factor=1.0)
    assert "moe_expert_capacity_factor=1.0 is refused by multi-copy: a capacity per copy" in \
        check.refusal(moe, check.MULTI_COPY, training=True)


def test_enable_autocast_is_refused_by_the_sequence_copies_only():
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, attention_dropout=0.0,
                               hidden_dropout=0.0, enable_autocast=True,
                               autocast_dtype=torch.bfloat16)
    for wing in (check.LINEARS, check.CONTEXT_PARALLEL, check.MULTI_COPY):  # each honours it or steps aside per call
        assert check.refusal(config, wing, training=True, kind="column") is None, wing
    assert "enable_autocast=True is refused by sequence copies" in check.refusal(config, check.SEQUENCE_COPIES,
                                                                                     training=True)
