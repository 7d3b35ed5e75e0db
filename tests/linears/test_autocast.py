"""Megatron's enable_autocast (torch.autocast around the forward) through coc-inject's linears.

Megatron's ColumnParallelLinear -> gelu -> RowParallelLinear at TP 2 on gloo, fp32 weights, forward and
backward under CPU autocast in bf16 (the backward too: Megatron's custom_bwd runs it under the forward's
autocast on CUDA), unpatched against COC_PARALLEL_NUM=4: every output and gradient in Megatron's dtype
and within bf16 rounding, and every collective carrying the bytes of Megatron's, dtype by dtype.
"""

import pytest

from layer_checks import BF16_BOUND

# (sequence parallel, the column's input dtype, bias). Megatron's own Column SP backward cannot take an
# fp32 input under autocast (its reduce-scatter gets a bf16 dgrad into an fp32 buffer), so the SP chains
# start in bf16; with bias the Row gets an fp32 input (the bias add promotes), without it a bf16 one.
CHAINS = [(False, "float32", False), (False, "bfloat16", True), (True, "bfloat16", True), (True, "bfloat16", False)]
CHAIN_IDS = ["fp32-input", "bf16-input-bias", "sp-bias", "sp"]


def check(result, *, fused_kernel=False):
    assert result["coc_calls"] == 2, result
    for name, (megatron, coc) in result["dtypes"].items():
        assert coc == megatron, f"{name}: CoC gives {coc}, Megatron {megatron}"
    assert max(result["errors"].values()) <= BF16_BOUND, result["errors"]
    if not fused_kernel:  # the fake fused kernels gather in fp32 (tests/fakes/symm_mem_cpu.py)
        megatron, coc = result["bytes"]
        assert coc == megatron, f"bytes carried: CoC {coc}, Megatron {megatron}"


@pytest.mark.parametrize("sp,input_dtype,bias", CHAINS, ids=CHAIN_IDS)
def test_column_row_under_autocast_as_megatron(pool2, sp, input_dtype, bias):
    for result in pool2.run("autocast_cases:column_row", chunks=4, sequence_parallel=sp, input_dtype=input_dtype,
                            bias=bias):
        check(result)
    if input_dtype == "float32":  # Megatron's matmul output under autocast: bf16 from an fp32 input
        assert result["dtypes"]["output"][0] == "torch.bfloat16"


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_fused_wgrad_into_main_grad_under_autocast(pool2, sp):
    # bf16 activations, fp32 weights and main_grad: Megatron's kernel takes the bf16 operands as they are.
    for result in pool2.run("autocast_cases:column_row", chunks=4, sequence_parallel=sp, input_dtype="bfloat16",
                            main_grad=True):
        check(result)
        operands = "(torch.bfloat16, torch.bfloat16)"
        assert result["wgrad_kernel_operands"] == [operands, operands], result["wgrad_kernel_operands"]


def test_fused_kernels_under_autocast(pool2):
    # symm_mem's fake CPU kernels: the Row's input is fp32 (bias), cast to bf16 as autocast does before its
    # matmul + reduce-scatter; the Column's bf16 input is all-gathered and multiplied by the cast weight.
    for result in pool2.run("autocast_cases:column_row", chunks=4, sequence_parallel=True, input_dtype="bfloat16",
                            bias=True, fused_kernel=True):
        check(result, fused_kernel=True)
        assert sorted(set(result["fused_kernels"])) == ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"]


def test_gpt_steps_under_autocast_as_megatron(pool2):
    """A megatron-core GPT (TP 2, fp32 parameters) trained 2 SGD steps with forward and backward inside CPU
    torch.autocast in bf16, COC_PARALLEL_NUM=4 (COC_ENABLE_IN_COLUMN_BACKWARD=1) against Megatron's own
    linears: the same losses and parameters. (Megatron's forward_backward_func opens torch.autocast("cuda")
    for enable_autocast, a no-op on the CPU: the test opens the CPU's around the model's step.)"""
    from tests.context_parallel.test_cp_gpt import assert_same_training

    options = dict(tp=2, sp=False, b=2, steps=2, autocast=True)
    want = pool2.run("tests.multi_copy.multi_copy_cases:train", copies=1, **options)
    got = pool2.run("tests.multi_copy.multi_copy_cases:train", copies=1, chunks=4,
                    coc={"enable_coc_in_column_backward": True}, **options)
    assert_same_training(got, want)
