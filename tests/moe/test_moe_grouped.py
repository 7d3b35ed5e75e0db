"""COC_MOE_OVERLAP on Megatron's grouped experts: the legacy ``GroupedMLP`` (``--moe-grouped-gemm`` with the
local spec; megatron-core 0.12 to 0.16), its ``grouped_gemm`` extension the CPU stand-in of
tests/fakes/grouped_gemm.py, and ``TEGroupedMLP`` (the TE spec; 0.17+ has only it) by its interface, over
stand-ins of Transformer Engine's grouped linears (tests/fakes/te_grouped_linear.py; never against TE
itself), on every release the suite runs (a ModuleSpec before 0.17, a builder after). A piece is a chunk of every local expert's rows, run as one call of the experts' own forward.
Output, input gradient and the weights' gradients against the same layer on Megatron's dispatcher, on
gloo ranks; the all-to-alls in one order on every rank; auto over it."""

import pytest
import torch

from coc_inject.megatron_version import importable, release
from coc_inject.moe.calls import AUTO_CHOSE_MEGATRON
from tests.fakes import grouped_gemm
from tests.moe.test_moe import check_order, not_on_oldest, train

MEGATRON = release(importable().version)
HAS_GROUPED_MLP = MEGATRON < (0, 17)
BF16_ONLY = MEGATRON >= (0, 16)  # 0.16's GroupedMLP.forward asserts config.bf16
# 0.12 runs the pieces through its dispatcher's token_permutation / token_unpermutation (permutation_stages.py)
needs_grouped = pytest.mark.skipif(not HAS_GROUPED_MLP,
                                   reason="megatron-core >= 0.17 has no legacy GroupedMLP (TEGroupedMLP only)")
# bf16: the pieces' GEMMs see fewer rows and sum the weight gradients piece by piece, each rounded to bf16
# (Megatron's: one sum over all rows): a few bf16 ulps at the tensors' scale. 2**-6 relative, stated.
BF16_BOUND = 2.0 ** -6
FP32_BOUND = 1e-5


def run(pool, **case):
    return pool.run("tests.moe.moe_cases:layer_case", grouped=True, **case)


def dtype_settings(dtype: str) -> dict:
    return {"params_dtype": torch.bfloat16, "bf16": True} if dtype == "bf16" else {}


def check_close(results, chunks, dtype):
    bound = BF16_BOUND if dtype == "bf16" else FP32_BOUND
    for rank, r in enumerate(results):
        assert r["route"] == ("pieces", chunks), (rank, r["route"])
        assert r["same_params"]
        for what, scale in (("out", r["out_scale"]), ("x_grad", r["out_scale"]),
                            ("param_grad", r["param_grad_scale"])):
            assert r[what] <= bound * max(1.0, scale), (rank, dtype, what, r[what], scale)


@pytest.fixture(scope="module")
def pool(pool4):
    return pool4


def test_the_stand_in_checks_the_kernels_contract_and_computes_the_grouped_products():
    a = torch.randn(7, 4, dtype=torch.float64).float().requires_grad_()
    b = torch.randn(3, 4, 5).requires_grad_()
    sizes = torch.tensor([2, 0, 5])
    out = grouped_gemm.gmm(a, b, sizes)
    want = torch.cat([a[:2] @ b[0], a[2:] @ b[2]])
    assert torch.allclose(out, want, atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    torch.cat([a_ref[:2] @ b_ref[0], a_ref[2:2] @ b_ref[1], a_ref[2:] @ b_ref[2]]).backward(grad)
    assert torch.allclose(a.grad, a_ref.grad, atol=1e-6) and torch.allclose(b.grad, b_ref.grad, atol=1e-6)
    bt = b.detach().transpose(1, 2).contiguous().requires_grad_()  # [experts, n, k] with trans_b
    out_t = grouped_gemm.gmm(a.detach(), bt, sizes, trans_b=True)
    assert torch.allclose(out_t, want.detach(), atol=1e-6)
    out_t.backward(grad)
    assert torch.allclose(bt.grad, b_ref.grad.transpose(1, 2), atol=1e-6)
    refused = [
        (a, b, sizes.cuda() if torch.cuda.is_available() else sizes.tolist(), "on the host"),
        (a, b, sizes.int(), "int64"),
        (a, b, torch.tensor([2, 0, 4]), "do not sum"),
        (a, b, torch.tensor([2, 5]), "batch sizes for 3 experts"),
        (a, b.transpose(1, 2), sizes, "contraction"),
        (a.t().contiguous().t(), b, sizes, "contiguous"),
        (a.double(), b, sizes, "dtype"),
        (a[0], b, sizes, "2-D"),
    ]
    for a_, b_, sizes_, words in refused:
        with pytest.raises(RuntimeError, match=words):
            grouped_gemm.gmm(a_, b_, sizes_)


def test_megatrons_grouped_mlp_sees_the_stand_in():
    if not HAS_GROUPED_MLP:
        pytest.skip("megatron-core >= 0.17: no grouped_gemm_util")
    from megatron.core.transformer.moe import grouped_gemm_util

    with grouped_gemm.installed():
        assert grouped_gemm_util.grouped_gemm_is_available()
        grouped_gemm_util.assert_grouped_gemm_is_available()
        assert grouped_gemm_util.ops.gmm is grouped_gemm.gmm


@needs_grouped
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=not_on_oldest)])
@pytest.mark.parametrize("ep,experts,topk,etp", [(2, 4, 2, 1), (2, 4, 2, 2), pytest.param(4, 8, 1, 1, marks=not_on_oldest)],
                         ids=["ep2-2local-top2", "ep2-etp2-2local-top2", "ep4-2local-top1"])
def test_grouped_pieces_equal_megatron(pool, ep, experts, topk, etp, dtype):
    if dtype == "fp32" and BF16_ONLY:
        pytest.skip("megatron-core 0.16's GroupedMLP asserts bf16")
    results = run(pool, ep=ep, experts=experts, topk=topk, etp=etp, **dtype_settings(dtype))
    check_close(results, 8, dtype)
    if etp == 1:
        check_order(results, 8)


@needs_grouped
def test_one_chunk_is_megatrons_grouped_gemm_bitwise(pool):
    dtype = "bf16" if BF16_ONLY else "fp32"
    results = pool.run("tests.moe.moe_cases:layer_case", grouped=True, ep=2, experts=4, chunks=1,
                       **dtype_settings(dtype))
    for r in results:
        assert r["route"] == ("pieces", 1)
        assert r["out"] == 0.0 and r["x_grad"] == 0.0 and r["param_grad"] == 0.0, r


@needs_grouped
def test_auto_over_grouped_experts_decides_once_alike_and_stays_close(pool):
    dtype = "bf16" if BF16_ONLY else "fp32"
    results = pool.run("tests.moe.moe_cases:auto_case", grouped=True, ep=2, experts=4, **dtype_settings(dtype))
    for group in ((0, 1), (2, 3)):
        decisions = [results[rank]["decisions"] for rank in group]
        assert len(decisions[0]) == 1 and decisions[0][0][2] == "trials" and decisions[1] == decisions[0]
        assert "grouped experts" in decisions[0][0][0]
        choice = decisions[0][0][1]
        if choice == "megatron":
            assert all(results[rank]["route"] == ("megatron", AUTO_CHOSE_MEGATRON) for rank in group)
        else:
            check_close([results[rank] for rank in group], choice, dtype)


@pytest.mark.skipif(not HAS_GROUPED_MLP, reason="megatron-core >= 0.17 has no legacy GroupedMLP")
def test_beside_mindspeeds_grouped_experts_the_wing_leaves_them_alone():
    """MindSpeed's --moe-grouped-gemm puts its own class in GroupedMLP's place (tests/fakes/mindspeed_patches.py):
    the wing takes no experts forward over (neither MindSpeed's nor Megatron's) and a layer with MindSpeed's
    experts keeps Megatron's dispatcher, naming MindSpeed's feature."""
    import types

    from megatron.core.transformer.moe import experts, moe_layer

    from coc_inject import job, mindspeed
    from coc_inject.config import CocConfig
    from coc_inject.moe import guards
    from coc_inject.moe import install as moe_install
    from tests.fakes import mindspeed_patches as fake

    megatrons = experts.GroupedMLP
    forward = megatrons.__dict__["forward"]
    applied = fake.Applied()
    job.uninstall()
    mindspeed.forget()
    try:
        fake.grouped_gemm(applied)
        replaced = experts.GroupedMLP
        assert replaced is not megatrons
        replaced_forward = replaced.__dict__["forward"]
        moe_install.install(CocConfig(moe_overlap="1"), moe_layer)
        assert replaced.__dict__["forward"] is replaced_forward and megatrons.__dict__["forward"] is forward
        layer = types.SimpleNamespace(token_dispatcher=None, experts=object.__new__(replaced))
        assert "MindSpeed's --moe-grouped-gemm" in guards.layer_reason(layer)
    finally:
        job.uninstall()
        applied.undo()
        mindspeed.forget()
    assert experts.GroupedMLP is megatrons and megatrons.__dict__["forward"] is forward


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("ep,experts,topk,etp", [(2, 4, 2, 1), (2, 4, 2, 2)], ids=["ep2-2local-top2", "ep2-etp2-2local-top2"])
def test_te_grouped_pieces_equal_megatron_by_interface(pool, ep, experts, topk, etp, dtype):
    """TEGroupedMLP's own forward per piece, over the grouped-linear stand-ins: every linear call's m_splits a
    list of ints summing to its rows (the stand-in checks), results as Megatron's dispatcher's."""
    results = pool.run("tests.moe.moe_cases:layer_case", te_grouped=True, ep=ep, experts=experts, topk=topk, etp=etp,
                       **dtype_settings(dtype))
    check_close(results, 8, dtype)
    if etp == 1:
        check_order(results, 8)


def test_auto_over_te_grouped_experts(pool):
    results = pool.run("tests.moe.moe_cases:auto_case", te_grouped=True, ep=2, experts=4)
    for group in ((0, 1), (2, 3)):
        decisions = [results[rank]["decisions"] for rank in group]
        assert len(decisions[0]) == 1 and decisions[1] == decisions[0] and "grouped experts" in decisions[0][0][0]
        choice = decisions[0][0][1]
        if choice != "megatron":
            check_close([results[rank] for rank in group], choice, "fp32")


@needs_grouped
def test_probs_on_the_input_as_grouped_mlp_applies_them(pool):
    """moe_apply_probs_on_input (top-1): GroupedMLP's forward scales each piece's rows by their probs itself."""
    dtype = "bf16" if BF16_ONLY else "fp32"
    results = run(pool, ep=2, experts=4, topk=1, moe_apply_probs_on_input=True, **dtype_settings(dtype))
    check_close(results, 8, dtype)


@needs_grouped
@pytest.mark.skipif(BF16_ONLY, reason="0.16's GroupedMLP asserts bf16; the GPT case trains in fp32 (0.12 to 0.15)")
@pytest.mark.parametrize("model", [{"ep": 2, "tp": 2, "sp": True}], ids=["ep2-tp2-sp"])
def test_gpt_with_grouped_experts_trains_as_megatron(pool, model):
    """A tiny GPT with GroupedMLP experts, TP 2 SP x EP 2, 3 SGD steps: losses and every parameter as with
    coc-inject off (within 1e-6), every MoE layer in 8 pieces."""
    got = train(pool, {"moe_overlap": "1"}, grouped=True, **model)
    for r in got:
        assert r["routes"] and all(route == ("pieces", 8) for route in r["routes"]), r["routes"]
