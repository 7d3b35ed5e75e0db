"""COC_ALLOW_UNTESTED_MEGATRON=1 never crashes a wing's guard (issue 42 item 4).

On a release outside the tested range a layer may lack an attribute (or a stage) a wing reads: the
guard sends that layer to Megatron's path naming what is missing, never raises. Each case below
builds a stand-in layer with everything the guard reads, checks that it passes, then removes each
attribute in turn. (0.12.1 itself: ColumnParallelLinear without ``tp_group`` raised AttributeError in
the linears' guard; the MoE wing's install raised KeyError 'token_dispatch'.)
"""

from types import SimpleNamespace

import pytest
import torch

from coc_inject.context_parallel import forward as cp_forward
from coc_inject.linears import adapters, guards as linear_guards
from coc_inject.moe import guards as moe_guards, stages

TP = 2


class _Group:
    def size(self):
        return TP


def _linear(kind: str, *, missing: str | None = None):
    """A stand-in Row / Column layer (TP 2, SP) with what the guards read, less ``missing``."""
    hidden, ffn = 8, 16
    attributes = dict(
        config=SimpleNamespace(), bias=None, sequence_parallel=True, input_is_parallel=True, skip_bias_add=False,
        gradient_accumulation_fusion=False, gather_output=False, tp_group=_Group(),
    )
    if kind == "row":
        attributes.update(weight=torch.zeros(hidden, ffn // TP), input_size_per_partition=ffn // TP,
                          output_size=hidden)
    else:
        attributes.update(weight=torch.zeros(ffn // TP, hidden), input_size=hidden, output_size_per_partition=ffn // TP)
    attributes.pop(missing, None)
    return type("RowParallelLinear" if kind == "row" else "ColumnParallelLinear", (), attributes)()


def _linear_guard(kind, layer, x):
    if kind == "row":
        return linear_guards.row_guards(layer, x, (), {})
    config = SimpleNamespace(enable_coc_in_column_backward=False)
    return linear_guards.column_guards(config, layer, x, None, (), {})


def _linear_cases():
    reads = {"row": linear_guards.ROW_READS, "column": linear_guards.COLUMN_READS}
    return [(kind, name) for kind, names in reads.items() for name in (*names, "tp_group")]


@pytest.fixture
def released_after_013(monkeypatch):
    """A release from 0.13 on (a layer without tp_group is not 0.12's)."""
    monkeypatch.setattr(linear_guards, "_before_013", lambda: False)


@pytest.mark.parametrize("kind", ["row", "column"])
def test_the_linears_stand_in_passes_its_guard(released_after_013, kind):
    assert _linear_guard(kind, _linear(kind), torch.zeros(4, 1, 8 if kind == "column" else 8)) is None


@pytest.mark.parametrize("kind,missing", _linear_cases(), ids=[f"{k}-{m}" for k, m in _linear_cases()])
def test_a_linear_lacking_an_attribute_takes_megatrons_path_naming_it(released_after_013, kind, missing):
    layer, x = _linear(kind, missing=missing), torch.zeros(4, 1, 8)
    path = _linear_guard(kind, layer, x)
    assert path is not None and f"has no attribute {missing!r}" in path.reason, path
    shape = (adapters.row_shape if kind == "row" else adapters.column_shape)(layer, x)  # the coverage's count
    assert len(shape) == 3


def test_on_0_12_a_linear_without_tp_group_uses_parallel_states_group(monkeypatch):
    """0.12's layers have no tp_group: their forwards use parallel_state's TP group, and so does CoC."""
    from megatron.core import parallel_state

    group = _Group()
    monkeypatch.setattr(linear_guards, "_before_013", lambda: True)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda *a, **k: group)
    layer = _linear("row", missing="tp_group")
    assert linear_guards.tp_group(layer) is group and linear_guards.group_argument(layer) == {}
    assert _linear_guard("row", layer, torch.zeros(4, 1, 8)) is None


# -- the MoE pieces -----------------------------------------------------------------------------------

def _moe(*, missing: tuple = (), stage_owner: str = "layer", experts_class: str = "SequentialMLP"):
    """A stand-in MoE layer (alltoall dispatcher, SequentialMLP or GroupedMLP experts, EP 2) less
    ``missing`` = (owner, name); its stages on the layer (0.16+) or on the dispatcher (0.13-0.15)."""
    def build(owner, name, attributes):
        attributes = {key: value for key, value in attributes.items() if (owner, key) != missing}
        return type(name, (), attributes)()

    stage = lambda self, *args: None  # noqa: E731
    config = SimpleNamespace()
    dispatcher = build("dispatcher", "MoEAlltoAllTokenDispatcher", {
        **{name: 1 for name in ("tp_size", "tp_rank", "num_local_experts")}, "ep_size": 2, "config": config,
        "local_expert_indices": [0], "ep_group": _Group(), "tp_group": None, "tp_ep_group": _Group(),
        "preprocess": stage, "_maybe_dtoh_and_synchronize": stage,
        **({name: stage for name in stages.DISPATCHER_STAGES} if stage_owner == "dispatcher" else {})})
    experts = build("experts", experts_class, {"config": config, "local_experts": [], "num_local_experts": 1,
                                               "forward": stage})
    return build("layer", "MoELayer", {
        "config": config, "token_dispatcher": dispatcher, "experts": experts,
        **({name: stage for name in stages.LAYER_STAGES} if stage_owner == "layer" else {})})


def _moe_cases():
    return ([("layer", name) for name in moe_guards.LAYER_READS]
            + [("dispatcher", name) for name in moe_guards.DISPATCHER_READS]
            + [("experts", name) for name in moe_guards.EXPERTS_READS])


@pytest.mark.parametrize("name", moe_guards.GROUPED_EXPERTS_READS)
def test_grouped_experts_lacking_an_attribute_run_megatrons_dispatcher_naming_it(name):
    assert moe_guards.layer_reason(_moe(experts_class="GroupedMLP")) is None
    why = moe_guards.layer_reason(_moe(missing=("experts", name), experts_class="GroupedMLP"))
    assert why is not None and f"has no attribute {name!r}" in why, why


@pytest.mark.parametrize("stage_owner", ["layer", "dispatcher"])
def test_the_moe_stand_in_runs_as_pieces(stage_owner):
    assert moe_guards.layer_reason(_moe(stage_owner=stage_owner)) is None


@pytest.mark.parametrize("owner,name", _moe_cases(), ids=[f"{o}-{n}" for o, n in _moe_cases()])
def test_an_moe_layer_lacking_an_attribute_runs_megatrons_dispatcher_naming_it(owner, name):
    why = moe_guards.layer_reason(_moe(missing=(owner, name)))
    assert why is not None and f"has no attribute {name!r}" in why, why


@pytest.mark.parametrize("stage_owner,name", [("layer", name) for name in stages.LAYER_STAGES]
                         + [("dispatcher", name) for name in stages.DISPATCHER_STAGES])
def test_an_moe_layer_lacking_a_stage_runs_megatrons_dispatcher_naming_it(stage_owner, name):
    """0.12 has neither the layer's nor the dispatcher's stages: the reason names the dispatcher's."""
    layer = _moe(missing=(stage_owner, name), stage_owner=stage_owner)
    why = moe_guards.layer_reason(layer)
    assert why is not None and "no stage for the pieces to take over" in why, why
    assert (name if stage_owner == "dispatcher" else stages.DISPATCHER_STAGES[0]) in why


def test_the_moe_install_wraps_no_stage_a_release_lacks():
    """0.12's classes (token_permutation, no stages): nothing to wrap instead of KeyError 'token_dispatch'."""
    dispatcher = type("MoEAlltoAllTokenDispatcher", (), {"preprocess": lambda self, m: m})
    experts = type("SequentialMLP", (), {"forward": lambda self, *a: a})
    assert not stages.has_layer_stages(type("MoELayer", (), {"forward": lambda self, x: x}))
    assert not stages.has_dispatcher_stages(dispatcher, experts)


def test_0_12s_token_permutation_is_taken_over_only_as_0_12_wrote_it(monkeypatch):
    """permutation_stages.py restates 0.12's lines: a dispatcher class of another module, or 0.12's own
    class name and module in another release, or one lacking what those lines read: Megatron's path."""
    from coc_inject import megatron_version
    from coc_inject.moe import permutation_stages

    methods = {name: (lambda self, *args: args) for name in moe_guards.PERMUTATION_STAGES}
    dispatcher = type("MoEAlltoAllTokenDispatcher", (), methods)
    monkeypatch.setattr(megatron_version, "imported", lambda: SimpleNamespace(version="0.12.1"))
    assert not permutation_stages.has_permutation_stages(dispatcher)  # this module's class, not Megatron's
    assert "taken over only as megatron-core 0.12's own" in moe_guards.permutation_reason(dispatcher)
    dispatcher.__module__ = moe_guards.PERMUTATION_MODULE
    assert permutation_stages.has_permutation_stages(dispatcher)
    why = moe_guards.permutation_reason(dispatcher, dispatcher())
    assert why is not None and "has no attribute 'preprocess'" in why, why
    monkeypatch.setattr(megatron_version, "imported", lambda: SimpleNamespace(version="0.13.1"))
    why = moe_guards.permutation_reason(dispatcher)
    assert why is not None and "megatron-core 0.13" in why, why


# -- context-parallel attention (COC_FLASH_ATTN's plan on a CP = 1 layer) --------------------------------

@pytest.mark.parametrize("missing", [None, *cp_forward.LAYER_READS])
def test_an_attention_layer_lacking_an_attribute_keeps_megatrons_attention_naming_it(missing, caplog):
    from coc_inject.config import CocConfig

    attributes = {"softmax_scale": 0.5, "scale_mask_softmax": SimpleNamespace(scale=None)}
    attributes.pop(missing, None)
    layer = type("DotProductAttention", (), attributes)()
    with caplog.at_level("WARNING", logger="coc_inject"):
        plan = cp_forward._flash_plan(CocConfig(flash_attn=True), layer, SimpleNamespace(), None)
    if missing is None:
        assert plan is not None and plan.scale == 0.5
    else:
        assert plan is None
        assert f"has no attribute {missing!r}" in cp_forward._lacks(layer)
