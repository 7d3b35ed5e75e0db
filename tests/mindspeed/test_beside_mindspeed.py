"""Each wing beside MindSpeed's patches (stand-ins, tests/fakes/mindspeed_patches.py: MindSpeed itself
imports torch_npu and never runs here): it steps aside where MindSpeed replaced what it would wrap,
naming MindSpeed's feature, and runs where MindSpeed did not."""

import json
import logging
import types

import pytest

layers = pytest.importorskip("megatron.core.tensor_parallel.layers")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.transformer import dot_product_attention, transformer_block  # noqa: E402
from megatron.core.transformer.moe import experts, moe_layer, token_dispatcher  # noqa: E402

from coc_inject import job, log, mindspeed  # noqa: E402
from coc_inject.config import CocConfig  # noqa: E402
from coc_inject.context_parallel import install as cp_install  # noqa: E402
from coc_inject.linears import forward as linears_forward  # noqa: E402
from coc_inject.linears import install as linears  # noqa: E402
from coc_inject.moe import guards as moe_guards  # noqa: E402
from coc_inject.moe import install as moe_install  # noqa: E402
from coc_inject.multi_copy import install as copies_install  # noqa: E402
from coc_inject.routes import MegatronPath  # noqa: E402
from tests.fakes import mindspeed_patches as fake  # noqa: E402

COLUMN, ROW = layers.ColumnParallelLinear, layers.RowParallelLinear
ATTENTION = dot_product_attention.DotProductAttention
ORIGINALS = {(COLUMN, "forward"): COLUMN.__dict__["forward"], (ROW, "forward"): ROW.__dict__["forward"],
             (ATTENTION, "forward"): ATTENTION.__dict__["forward"], (ATTENTION, "__init__"): ATTENTION.__dict__["__init__"],
             (moe_layer.MoELayer, "forward"): moe_layer.MoELayer.__dict__["forward"],
             (transformer_block.TransformerBlock, "forward"): transformer_block.TransformerBlock.__dict__["forward"]}
INITIALIZE = parallel_state.initialize_model_parallel
MOE_LAYER = moe_layer.MoELayer
HAS_GROUPED_MLP = hasattr(experts, "GroupedMLP")


@pytest.fixture()
def applied(caplog):
    caplog.set_level(logging.DEBUG, logger=log.logger.name)
    job.uninstall()
    mindspeed.forget()
    linears_forward._beside.clear()
    patches = fake.Applied()
    yield patches
    patches.undo()  # MindSpeed's first: applied after coc-inject's, it holds coc-inject's wrappers
    job.uninstall()
    mindspeed.forget()
    linears_forward._beside.clear()
    for (owner, name), original in ORIGINALS.items():
        assert owner.__dict__[name] is original
    assert parallel_state.initialize_model_parallel is INITIALIZE


def _unpatched(*keys):
    return all(owner.__dict__[name] is ORIGINALS[(owner, name)] for owner, name in keys)


def test_the_table_names_each_feature_the_stand_ins_apply():
    features = {row.feature for row in mindspeed.REPLACEMENTS}
    for flag in ("--use-ascend-coc", "--use-ascend-mc2", "--moe-alltoall-overlap-comm", "--moe-permute-fusion"):
        assert flag in features
    assert any("--context-parallel-algo" in f for f in features) and any("--moe-grouped-gemm" in f for f in features)


@pytest.mark.parametrize("patch, flag", [(fake.ascend_coc, "--use-ascend-coc"), (fake.ascend_mc2, "--use-ascend-mc2")])
def test_linears_step_aside_from_mindspeeds_linears_patched_before_the_hook(applied, caplog, patch, flag):
    patch(applied)
    assert linears.install(CocConfig(parallel_num=4), layers)
    assert _unpatched((COLUMN, "forward"), (ROW, "forward"))  # neither Megatron's nor MindSpeed's touched
    assert not getattr(layers.ColumnParallelLinear.__dict__["forward"], "__coc_inject__", False)  # MindSpeed's own
    banner = linears.banner(CocConfig(parallel_num=4), "0.12.1")
    assert f"MindSpeed's {flag}" in banner and "beside MindSpeed" in banner
    assert f"MindSpeed's {flag}" in caplog.text


@pytest.mark.parametrize("patch, flag", [(fake.ascend_coc, "--use-ascend-coc"), (fake.ascend_mc2, "--use-ascend-mc2")])
def test_a_mindspeed_linear_built_after_the_hook_takes_megatrons_path(applied, patch, flag):
    """MindSpeed's real order: its setattr comes after coc-inject's hook patched Megatron's class; a
    call MindSpeed's forward leaves to Megatron's (super().forward) takes Megatron's path, named."""
    assert linears.install(CocConfig(parallel_num=4), layers)
    assert not _unpatched((COLUMN, "forward"))
    patch(applied)
    for cls in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        path = linears_forward.beside_mindspeed(cls)
        assert isinstance(path, MegatronPath) and f"MindSpeed's {flag}" in path.reason
    assert linears_forward.beside_mindspeed(COLUMN) is None and linears_forward.beside_mindspeed(ROW) is None


def test_linears_chunk_where_only_mindspeeds_moe_is_patched(applied):
    fake.moe_alltoall_overlap_comm(applied)
    if HAS_GROUPED_MLP:
        fake.grouped_gemm(applied)
    assert linears.install(CocConfig(parallel_num=4), layers)
    for cls in (COLUMN, ROW):
        assert cls.__dict__["forward"].__coc_inject__ and linears_forward.beside_mindspeed(cls) is None
    assert "beside MindSpeed" not in linears.banner(CocConfig(parallel_num=4), "0.12.1")


def test_attention_steps_aside_from_mindspeeds_context_parallel(applied, caplog):
    fake.context_parallel(applied)
    cp_install.install(CocConfig(cp_algo="ring"), dot_product_attention, parallel_state)
    replaced = dot_product_attention.DotProductAttention
    assert replaced is not ATTENTION and "forward" in replaced.__dict__
    assert not getattr(replaced.__dict__["forward"], "__coc_inject__", False)
    assert "__init__" not in replaced.__dict__  # MindSpeed's class left as MindSpeed made it
    assert _unpatched((ATTENTION, "forward"), (ATTENTION, "__init__"))
    assert mindspeed.is_mindspeed(parallel_state.initialize_model_parallel)  # MindSpeed's groups, not ours too
    assert "--context-parallel-algo" in caplog.text and "coc-inject steps aside" in caplog.text


def test_attention_runs_where_mindspeed_patched_only_the_linears(applied):
    fake.ascend_coc(applied)
    cp_install.install(CocConfig(cp_algo="ring"), dot_product_attention, parallel_state)
    assert getattr(ATTENTION.__dict__["forward"], "__coc_inject__", False) or not _unpatched((ATTENTION, "forward"))
    assert parallel_state.initialize_model_parallel is not INITIALIZE


def test_a_mindspeed_attention_class_after_the_hook_is_named(applied):
    cp_install.install(CocConfig(cp_algo="ring"), dot_product_attention, parallel_state)
    fake.context_parallel(applied)
    feature = mindspeed.class_feature(dot_product_attention.DotProductAttention, mindspeed.ATTENTION)
    assert feature == "MindSpeed's --context-parallel-algo (context parallel size > 1)"


@pytest.mark.parametrize("patch, flag", [(fake.moe_alltoall_overlap_comm, "--moe-alltoall-overlap-comm"),
                                         (fake.moe_permute_fusion, "--moe-permute-fusion")])
def test_moe_steps_aside_from_mindspeeds_moe_layer_or_dispatch(applied, caplog, patch, flag):
    patch(applied)
    config = CocConfig(moe_overlap="1")
    moe_install.install(config, moe_layer)
    assert _unpatched((MOE_LAYER, "forward"))
    assert not getattr(moe_layer.MoELayer.__dict__.get("forward"), "__coc_inject__", False)
    assert "MoE overlap not installed" in moe_install.banner(config) and f"MindSpeed's {flag}" in moe_install.banner(config)
    assert f"MindSpeed's {flag}" in caplog.text


@pytest.mark.skipif(not HAS_GROUPED_MLP, reason="megatron-core without the legacy GroupedMLP (MindSpeed's 0.12 has it)")
def test_moe_layer_with_mindspeeds_grouped_experts_keeps_megatrons_dispatcher(applied):
    fake.grouped_gemm(applied)
    layer = types.SimpleNamespace(token_dispatcher=None, experts=object.__new__(experts.GroupedMLP))
    assert "MindSpeed's --moe-grouped-gemm" in moe_guards.layer_reason(layer)


def test_a_mindspeed_moe_layer_keeps_megatrons_dispatcher(applied):
    fake.moe_alltoall_overlap_comm(applied)
    ms_layer = object.__new__(moe_layer.MoELayer)
    assert "MindSpeed's --moe-alltoall-overlap-comm" in moe_guards.layer_reason(ms_layer)


def test_moe_runs_where_mindspeed_patched_only_the_linears(applied):
    fake.ascend_coc(applied)
    config = CocConfig(moe_overlap="1")
    moe_install.install(config, moe_layer)
    assert not _unpatched((MOE_LAYER, "forward"))
    assert "beside MindSpeed" not in moe_install.banner(config)
    assert token_dispatcher.MoEAlltoAllTokenDispatcher  # the dispatcher as Megatron made it


def test_multi_copy_steps_aside_from_mindspeeds_recompute(applied, caplog):
    fake.ripipe_checkpoint(applied)
    config = CocConfig(multi_copy=2)
    copies_install.install(config, transformer_block)
    assert _unpatched((transformer_block.TransformerBlock, "forward"))
    assert "multi-copy not installed" in copies_install.banner(config) and "ripipe" in copies_install.banner(config)


def test_multi_copy_runs_where_mindspeed_patched_only_the_moe_and_linears(applied):
    fake.moe_alltoall_overlap_comm(applied)
    fake.ascend_coc(applied)
    config = CocConfig(multi_copy=2)
    copies_install.install(config, transformer_block)
    assert not _unpatched((transformer_block.TransformerBlock, "forward"))
    assert "beside MindSpeed" not in copies_install.banner(config)


# -- what a job says of it: the first-step summary, its warnings, COC_REPORT ----------------------------------

def test_a_wing_left_to_mindspeed_is_named_in_the_summary_warnings_and_report(applied):
    """#5 of the rules, beside MindSpeed: a wing whose layers all run MindSpeed's code counts no call, so
    the first step's line, the "no call ran" warning and COC_REPORT name MindSpeed's feature (the
    warning guessed "context_parallel_size 1, or no local DotProductAttention" before)."""
    from coc_inject import coverage

    fake.context_parallel(applied)
    config = CocConfig(cp_algo="ring")
    cp_install.install(config, dot_product_attention, parallel_state)
    accounting = coverage.Coverage(config, {})
    line = accounting.summary_line()
    said = "DotProductAttention is replaced by MindSpeed's --context-parallel-algo"
    assert "; beside MindSpeed: attention: " in line and f"attention: {said}" in line, line
    (warning,) = [w for w in accounting.warnings() if w.startswith("COC_CP_ALGO=ring")]
    assert "(beside MindSpeed: " in warning and said in warning and "context_parallel_size 1" not in warning
    report = accounting.report()
    assert list(report["beside_mindspeed"]) == [mindspeed.ATTENTION]
    assert any(said in text for text in report["beside_mindspeed"][mindspeed.ATTENTION])
    json.dumps(report)  # the report file's content


def test_without_mindspeed_the_warning_keeps_its_guess_and_the_report_is_empty(applied):
    from coc_inject import coverage

    accounting = coverage.Coverage(CocConfig(cp_algo="ring", multi_copy=2), {})
    assert "beside MindSpeed" not in accounting.summary_line()
    warnings = accounting.warnings()
    assert any("(context_parallel_size 1, or no local DotProductAttention)" in w for w in warnings)
    assert any("(no TransformerBlock was called)" in w for w in warnings)
    assert accounting.report()["beside_mindspeed"] == {}


def test_a_linear_counted_on_megatrons_path_is_not_said_twice(applied):
    """A MindSpeed linear built after the hook is counted as Megatron's path naming the feature: the
    summary's reasons say it, and its beside-MindSpeed tail does not repeat it."""
    from coc_inject import coverage, routes

    assert linears.install(CocConfig(parallel_num=4), layers)
    fake.ascend_coc(applied)
    path = linears_forward.beside_mindspeed(layers.ColumnParallelLinear)
    accounting = coverage.Coverage(CocConfig(parallel_num=4), {})

    class ColumnParallelLinear:  # a stand-in layer: Coverage keeps a weak reference and the class name
        pass

    accounting.count(ColumnParallelLinear(), path, None, lambda layer, x: [4, 2, 2])
    line = accounting.summary_line()
    assert line.count("is replaced by MindSpeed's --use-ascend-coc") == 1, line
    assert "Megatron's path because: MindSpeedCoCColumnParallelLinear is replaced by" in line
    assert isinstance(path, routes.MegatronPath)


def test_a_block_forward_set_after_the_hook_that_coc_inject_does_not_read_is_warned_about_and_reported(applied):
    """A TransformerBlock.forward of MindSpeed's that the copies do not read (multi_copy/install.py
    READ_BLOCK_FORWARDS), set after coc-inject's hook patched it: the copies never run there, and the first
    step's warnings and COC_REPORT say so, naming it."""
    config = CocConfig(multi_copy=2)
    copies_install.install(config, transformer_block)
    assert not _unpatched((transformer_block.TransformerBlock, "forward"))
    fake.unread_block_forward(applied)
    accounting = job.current().armed_coverage()
    row = accounting.report()["taken_over"]["TransformerBlock.forward"]
    name = "mindspeed.core.transformer.transformer_block.transformer_block_forward"
    assert row == {"now": name, "ours_still_runs": False, "mindspeed": f"MindSpeed's {name}"}
    (warning,) = [w for w in accounting.warnings() if w.startswith("TransformerBlock.forward was replaced")]
    assert name in warning and warning.endswith("what coc-inject put there does NOT run")


def test_mindspeeds_block_forward_set_before_the_hook_is_read_as_megatrons(applied):
    """MindSpeed 26.0+'s block forward (every job) already in place when multi-copy installs: the copies wrap
    it as they wrap Megatron's (tests/multi_copy/test_multi_copy.py runs them under it, set after the hook);
    uninstalling leaves MindSpeed's in place."""
    fake.te_basic_block_forward(applied)
    mindspeeds = transformer_block.TransformerBlock.__dict__["forward"]
    config = CocConfig(multi_copy=2)
    copies_install.install(config, transformer_block)
    ours = transformer_block.TransformerBlock.__dict__["forward"]
    assert ours is not mindspeeds and ours.__wrapped__ is mindspeeds
    assert "beside MindSpeed" not in copies_install.banner(config)
    job.uninstall()
    assert transformer_block.TransformerBlock.__dict__["forward"] is mindspeeds


def test_a_mindspeed_wrapper_around_coc_injects_patch_is_reported_not_warned_about(applied):
    copies_install.install(CocConfig(multi_copy=2), transformer_block)
    fake.tp_2d_block_forward(applied)  # functools.wraps around coc-inject's forward: it still runs inside
    accounting = job.current().armed_coverage()
    row = accounting.report()["taken_over"]["TransformerBlock.forward"]
    assert row["ours_still_runs"] is True and row["mindspeed"] == "MindSpeed's --tp-2d"
    assert not any("TransformerBlock.forward was replaced" in w for w in accounting.warnings())


def test_mindspeeds_permute_fusion_set_after_the_hook_keeps_megatrons_dispatcher(applied):
    """--moe-permute-fusion sets the dispatcher's methods on Megatron's own class, after coc-inject's install:
    each MoE layer finds them there and keeps Megatron's dispatcher, naming the feature."""
    moe_install.install(CocConfig(moe_overlap="1"), moe_layer)
    assert not _unpatched((MOE_LAYER, "forward"))
    fake.moe_permute_fusion(applied)
    layer = types.SimpleNamespace(token_dispatcher=object.__new__(token_dispatcher.MoEAlltoAllTokenDispatcher),
                                  experts=None)
    assert "MindSpeed's --moe-permute-fusion" in moe_guards.layer_reason(layer)


def test_what_was_said_beside_mindspeed_goes_with_the_installation_that_said_it(applied):
    """A re-install says its own step-asides afresh (log.once is reset with them): the last installation's
    lines are not carried into the next one's summary and report, nor said twice there."""
    fake.context_parallel(applied)
    cp_install.install(CocConfig(cp_algo="ring"), dot_product_attention, parallel_state)
    assert mindspeed.said.get(mindspeed.ATTENTION)
    job.uninstall(forget_said=False)  # the CP wing's own re-install: nothing is said again, the lines are kept
    assert mindspeed.said.get(mindspeed.ATTENTION)
    job.uninstall()
    assert mindspeed.said == {}
    cp_install.install(CocConfig(cp_algo="ring"), dot_product_attention, parallel_state)
    lines = mindspeed.said[mindspeed.ATTENTION]
    assert len(lines) == len(set(lines))
