"""The weight gradient into ``main_grad`` (coc_inject/pipeline/wgrad.py, issue 44 item 6): the GEMM gets
its operands in their own dtype -- Megatron's kernel where its linears module has one, torch's mixed-dtype
addmm where the running torch has it for the device, else the stated upcast -- and fp32 is what ran before."""

import logging

import pytest
import torch

from coc_inject.pipeline import wgrad
from coc_inject.pipeline.functions import WeightGrad
from tests.fakes import fused_wgrad

M, N, K = 12, 6, 8


@pytest.fixture(autouse=True)
def fresh_choices():
    wgrad.choose.cache_clear()
    yield
    wgrad.choose.cache_clear()


@pytest.fixture
def said():
    """The package logger's lines while the test runs."""
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("coc_inject")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def operands(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(M, N, generator=generator).to(dtype)
    input_ = torch.randn(M, K, generator=generator).to(dtype)
    start = torch.randn(N, K, generator=generator)
    return grad, input_, start


def fused_weight(dtype, start):
    weight = torch.nn.Parameter(torch.zeros(N, K, dtype=dtype))
    weight.main_grad = start.clone()
    weight.grad_added_to_main_grad = False
    return weight


def test_bf16_operands_reach_megatrons_kernel_in_their_own_dtype():
    """bf16 input and grad_output, fp32 main_grad: wgrad_gemm_accum_fp32 gets them as they are (before: an
    fp32 copy of both and torch's fp32 addmm_, the kernel never called)."""
    grad, input_, start = operands(torch.bfloat16)
    weight = fused_weight(torch.bfloat16, start)
    with fused_wgrad.installed():
        dummy = WeightGrad(weight, gradient_accumulation_fusion=True).compute(weight, grad, input_)
        assert fused_wgrad.calls == [("wgrad_gemm_accum_fp32", (N, K), torch.bfloat16, torch.bfloat16)]
    assert weight.main_grad.dtype == torch.float32 and weight.grad_added_to_main_grad is True
    assert dummy.shape == (N, K) and dummy.dtype == torch.bfloat16
    want = start + grad.float().t() @ input_.float()
    torch.testing.assert_close(weight.main_grad, want, rtol=1e-5, atol=1e-5)


def test_strided_operands_reach_the_kernel_contiguous():
    """The kernel reads raw pointers: a transposed activation is made contiguous first, as Megatron does."""
    grad, input_, start = operands(torch.bfloat16)
    strided = input_.t().contiguous().t()
    assert not strided.is_contiguous()
    accum = start.clone()
    with fused_wgrad.installed():
        wgrad.into_main_grad(accum, grad, strided)
        assert len(fused_wgrad.calls) == 1
    torch.testing.assert_close(accum, start + grad.float().t() @ input_.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_same_dtype_is_the_plain_addmm_that_ran_before(dtype):
    """fp32 into fp32 (and bf16 into bf16): the in-place addmm_ of before, bit for bit; no kernel call."""
    grad, input_, start = operands(dtype)
    accum, before = start.to(dtype), start.to(dtype)
    with fused_wgrad.installed():
        wgrad.into_main_grad(accum, grad, input_)
        assert fused_wgrad.calls == []
    before.addmm_(grad.t(), input_)
    assert torch.equal(accum, before)


def test_without_a_kernel_the_cpu_upcasts_and_says_so_once(said, monkeypatch):
    monkeypatch.setattr(wgrad, "megatron_kernel", lambda: None)
    grad, input_, start = operands(torch.bfloat16)
    accum = start.clone()
    for _ in range(3):
        wgrad.into_main_grad(accum, grad, input_)
    assert wgrad.choose("cpu", torch.bfloat16, torch.bfloat16, torch.float32, None, False) == wgrad.UPCAST
    assert len(said) == 1 and "operands copied to torch.float32" in said[0], said
    torch.testing.assert_close(accum, start + 3 * (grad.float().t() @ input_.float()), rtol=1e-5, atol=1e-5)


def test_the_probe_finds_no_mixed_addmm_on_the_cpu_and_runs_it_where_registered():
    """No CPU kernel for aten::addmm.dtype_out: False without a call or an exception; on the meta device
    (a kernel registered) its 1x1 call runs. fp32 operands never ask."""
    assert wgrad.torch_mixed_addmm("cpu", torch.bfloat16, torch.float32) is False
    assert wgrad.torch_mixed_addmm("meta", torch.bfloat16, torch.float32) is True
    assert wgrad.torch_mixed_addmm("meta", torch.float32, torch.float32) is False


def test_the_probe_says_no_for_an_old_torch_or_a_refused_call(monkeypatch):
    """An op this torch lacks (before 2.8), or a kernel whose dtype rules refuse an fp32 accumulator (2.8):
    False, the exception caught once inside the probe."""
    def missing(name, key):
        raise RuntimeError(f"operator {name} does not exist")

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", missing)
    assert wgrad.torch_mixed_addmm.__wrapped__("cuda", torch.bfloat16, torch.float32) is False
    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", lambda name, key: True)
    assert wgrad.torch_mixed_addmm.__wrapped__("cpu", torch.bfloat16, torch.float32) is False  # the call refused


@pytest.mark.parametrize("kernel,mixed,want", [
    (True, True, wgrad.KERNEL), (True, False, wgrad.KERNEL), (False, True, wgrad.MIXED), (False, False, wgrad.UPCAST)])
def test_the_choice_order_kernel_then_mixed_dtype_then_upcast(monkeypatch, kernel, mixed, want):
    probed = []
    monkeypatch.setattr(wgrad, "torch_mixed_addmm", lambda *key: probed.append(key) or mixed)
    module = fused_wgrad.module() if kernel else None
    for _ in range(3):  # decided once
        assert wgrad.choose("cuda", torch.bfloat16, torch.bfloat16, torch.float32, module, False) == want
    assert len(probed) == (0 if kernel else 1)
    # Megatron-FSDP's buffer is written, not added to: torch's GEMM, never the accumulating kernel.
    assert wgrad.choose("cuda", torch.bfloat16, torch.bfloat16, torch.float32, module, True) == (
        wgrad.MIXED if mixed else wgrad.UPCAST)
    # Operands of two dtypes, or a half main_grad under fp32 operands: the upcast.
    assert wgrad.choose("cuda", torch.bfloat16, torch.float32, torch.float32, module, False) == wgrad.UPCAST
    assert wgrad.choose("cuda", torch.float32, torch.float32, torch.bfloat16, module, False) == wgrad.UPCAST


@pytest.mark.parametrize("overwrite", [False, True], ids=["accumulate", "fsdp-overwrite"])
def test_the_mixed_dtype_call_is_one_torch_accepts(monkeypatch, overwrite):
    """With the probe forced on, the mixed-dtype addmm runs on meta tensors (torch's schema and shapes):
    bf16 operands as they are, the fp32 buffer as out."""
    monkeypatch.setattr(wgrad, "torch_mixed_addmm", lambda *key: True)
    monkeypatch.setattr(wgrad, "megatron_kernel", lambda: None)
    grad = torch.empty(M, N, dtype=torch.bfloat16, device="meta")
    input_ = torch.empty(M, K, dtype=torch.bfloat16, device="meta")
    accum = torch.empty(N, K, device="meta")
    seen = []
    original = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: seen.append((a[1].dtype, a[2].dtype, k)) or original(*a, **k))
    assert wgrad.into_main_grad(accum, grad, input_, overwrite=overwrite) is accum
    assert seen == [(torch.bfloat16, torch.bfloat16,
                     {"out_dtype": torch.float32, "beta": 0 if overwrite else 1, "out": accum})]


def test_fsdp_buffer_is_overwritten_from_bf16_operands():
    grad, input_, _ = operands(torch.bfloat16)
    stale = torch.full((N, K), 7.0)
    with fused_wgrad.installed():
        wgrad.into_main_grad(stale, grad, input_, overwrite=True)
        assert fused_wgrad.calls == []
    torch.testing.assert_close(stale, grad.float().t() @ input_.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,sp", [("row", False), ("row", True), ("column", True)],
                         ids=["row", "row-sp", "column-sp"])
def test_chunked_linears_hand_megatrons_kernel_bf16_operands(pool2, kind, sp):
    """A bf16 Megatron linear, fused accumulation and apex's kernel on, CoC's chunks running: one kernel call per
    backward with the bf16 operands, into the fp32 main_grad, within bf16 rounding of Megatron's bf16 grad."""
    from layer_checks import BF16_BOUND

    for result in pool2.run("wgrad_cases:bf16_main_grad", kind=kind, chunks=3, sequence_parallel=sp):
        assert result["coc_calls"] > 0
        assert [(name, a, b) for name, _, a, b in result["kernel_calls"]] == [
            ("wgrad_gemm_accum_fp32", "torch.bfloat16", "torch.bfloat16")], result["kernel_calls"]
        assert result["main_grad_dtype"] == "torch.float32"
        assert result["main_grad_error"] <= BF16_BOUND
