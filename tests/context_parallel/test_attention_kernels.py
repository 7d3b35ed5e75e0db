"""Every attention block kernel against float64 attention with autograd: out, lse, dq, dk, dv;
diagonal (causal), full and rectangular blocks; GQA; fp32 within 1e-5, bf16 within 2e-2.

The CPU flash kernel and the reference run for real. CUDA's SDPA kernels and Ascend's
npu_fusion_attention run through fakes of their documented call contracts (tests/fakes), which
compute the true result: what is tested there is the call, the layouts and the statistics.
"""

import sys
from pathlib import Path

import pytest
import torch

from coc_inject import attention_kernels
from coc_inject.attention_kernels import cpu, cuda, npu, reference
from coc_inject.attention_kernels.merge import merge_into, new_accumulators

FAKES = str(Path(__file__).resolve().parents[1] / "fakes")


@pytest.fixture(scope="module")
def fakes():
    sys.path.insert(0, FAKES)
    import cuda_attention_ops
    import torch_npu

    yield cuda_attention_ops, torch_npu
    sys.path.remove(FAKES)
    sys.modules.pop("torch_npu", None)


def make_kernel(name, fakes):
    fake_aten, fake_npu = fakes
    return {"reference": reference.KERNEL, "cpu-flash": cpu.KERNEL,
            "cuda-flash": cuda.CudaFlashKernel(fake_aten), "cuda-efficient": cuda.CudaEfficientKernel(fake_aten),
            "npu-fusion": npu.NpuFusionKernel(fake_npu)}[name]


KERNEL_DTYPES = [("reference", "float32"), ("reference", "bfloat16"), ("cpu-flash", "float32"),
                 ("cpu-flash", "bfloat16"), ("cuda-flash", "bfloat16"), ("cuda-efficient", "float32"),
                 ("cuda-efficient", "bfloat16"), ("npu-fusion", "bfloat16")]
BLOCKS = {"diagonal": (24, 24, True), "full": (24, 24, False), "rectangular": (16, 40, False)}
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def inputs(sq, sk, heads, groups, dtype, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, sq, dim, generator=generator)
    k = torch.randn(2, groups, sk, dim, generator=generator)
    v = torch.randn(2, groups, sk, dim, generator=generator)
    dout = torch.randn(2, heads, sq, dim, generator=generator)
    return [t.to(dtype) for t in (q, k, v, dout)]


def truth(q, k, v, dout, scale, causal):
    """float64 autograd: (out, lse, dq, dk, dv), K/V repeated per group as Megatron does."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    repeat = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(repeat, 1).transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v.repeat_interleave(repeat, 1)
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(scores, -1).detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("heads,groups", [(4, 2), (2, 2)])
@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("name,dtype", KERNEL_DTYPES)
def test_kernel_equals_float64_attention(fakes, name, dtype, block, heads, groups):
    sq, sk, causal = BLOCKS[block]
    kernel, dtype, tol = make_kernel(name, fakes), getattr(torch, dtype), TOLERANCE[dtype]
    q, k, v, dout = inputs(sq, sk, heads, groups, dtype)
    scale = 0.3
    want_out, want_lse, *want_grads = truth(q, k, v, dout, scale, causal)
    # Forward over two key blocks, merged (the schedules' online softmax); one block when causal.
    splits = [slice(0, sk)] if causal else [slice(0, sk // 3), slice(sk // 3, sk)]
    acc_out, acc_lse = new_accumulators(q)
    for cols in splits:
        out, lse = kernel.forward(q, k[..., cols, :], v[..., cols, :], scale, causal)
        assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        merge_into(acc_out, acc_lse, out, lse)
    torch.testing.assert_close(acc_out.double(), want_out, rtol=tol, atol=tol)
    torch.testing.assert_close(acc_lse.double(), want_lse, rtol=tol, atol=tol)
    # Backward of each key block from the FINAL out and lse, summed.
    final_out = acc_out.to(dtype)
    dq = torch.zeros(q.shape, dtype=torch.float64)
    dk, dv = torch.zeros(k.shape, dtype=torch.float64), torch.zeros(v.shape, dtype=torch.float64)
    for cols in splits:
        dq_b, dk_b, dv_b = kernel.backward(dout, q, k[..., cols, :], v[..., cols, :], final_out, acc_lse, scale, causal)
        assert dq_b.dtype == dk_b.dtype == dv_b.dtype == dtype and dk_b.shape == k[..., cols, :].shape
        dq += dq_b.double()
        dk[..., cols, :] += dk_b.double()
        dv[..., cols, :] += dv_b.double()
    for got, want, what in zip((dq, dk, dv), want_grads, ("dq", "dk", "dv")):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{name} {what}: {m}")


def test_fused_kernels_called_the_documented_ops(fakes):
    """The fakes saw the calls (not the reference math standing in for them)."""
    fake_aten, fake_npu = fakes
    fake_aten.CALLS.clear()
    fake_npu.ATTENTION_CALLS.clear()
    q, k, v, dout = inputs(24, 24, 4, 2, torch.bfloat16)
    for kernel in (cuda.CudaFlashKernel(fake_aten), cuda.CudaEfficientKernel(fake_aten), npu.NpuFusionKernel(fake_npu)):
        out, lse = kernel.forward(q, k, v, 0.25, True)
        kernel.backward(dout, q, k, v, out, lse, 0.25, True)
    assert [c[0] for c in fake_aten.CALLS] == ["flash", "flash-backward", "efficient", "efficient-backward"]
    assert fake_aten.CALLS[0][2] == (2, 2, 24, 16)  # flash: K/V with their 2 heads, not repeated
    assert fake_aten.CALLS[2][2] == (2, 4, 24, 16)  # efficient: K/V repeated to the 4 query heads
    assert [c[0] for c in fake_npu.ATTENTION_CALLS] == ["npu_fusion_attention", "npu_fusion_attention_grad"]
    assert all(c[3] for c in fake_npu.ATTENTION_CALLS) and fake_npu.ATTENTION_CALLS[0][2] == (2, 2, 24, 16)


def test_strided_row_slices_run_on_the_cpu_flash_kernel():
    """The schedules pass row slices (views) of q, out, dout and lse; no copy is needed."""
    q, k, v, dout = inputs(32, 32, 4, 2, torch.float32)
    out, lse = cpu.KERNEL.forward(q, k, v, 0.3, False)
    rows = slice(8, 24)
    got = cpu.KERNEL.backward(dout[..., rows, :], q[..., rows, :], k, v, out[..., rows, :], lse[..., rows], 0.3, False)
    want = cpu.KERNEL.backward(*(t[..., rows, :].contiguous() for t in (dout, q)), k, v,
                               out[..., rows, :].contiguous(), lse[..., rows].contiguous(), 0.3, False)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("sq,sk,causal", [(10, 10, True), (7, 19, False)])
def test_reference_is_tiled_and_no_transient_exceeds_a_tile(monkeypatch, sq, sk, causal):
    q, k, v, dout = inputs(sq, sk, 4, 2, torch.float32)
    want_out, want_lse, *want_grads = truth(q, k, v, dout, 0.3, causal)
    shapes = []
    scores = reference._scores
    monkeypatch.setattr(reference, "_scores", lambda *a: shapes.append(tuple((s := scores(*a)).shape)) or s)
    monkeypatch.setattr(reference, "TILE", 4)
    out, lse = reference.KERNEL.forward(q, k, v, 0.3, causal)
    grads = reference.KERNEL.backward(dout, q, k, v, out, lse, 0.3, causal)
    assert len(shapes) > 4 and max(s[-1] for s in shapes) <= 4 and max(s[-2] for s in shapes) <= 4
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_choose_per_device_dtype_and_head_dim(monkeypatch):
    choose = attention_kernels.choose
    assert choose("auto", "cpu", torch.float32, 64).name == "cpu-flash"
    assert choose("auto", "cpu", torch.bfloat16, 256).fallback_reason is None
    assert choose("reference", "cpu", torch.float32, 64).name == "reference"
    assert choose("auto", "cuda", torch.bfloat16, 128).name == "cuda-flash"
    assert choose("auto", "cuda", torch.float32, 128).name == "cuda-efficient"
    assert choose("auto", "cuda", torch.bfloat16, 100).name == "cuda-efficient"  # not a multiple of 8
    over = choose("auto", "cuda", torch.bfloat16, 320)
    assert over.name == "reference" and "head dim 320" in over.fallback_reason
    assert choose("auto", "xpu", torch.float32, 64).fallback_reason == "no fused attention kernel for xpu tensors"
    with pytest.raises(attention_kernels.KernelUnavailable, match="COC_ATTN_KERNEL=fused.*head dim 320"):
        choose("fused", "cuda", torch.bfloat16, 320)
    assert "fp16/bf16" in choose("auto", "npu", torch.float32, 128).fallback_reason
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed: import fails
    npu.KERNEL._torch_npu = None
    assert "torch_npu cannot be imported" in choose("auto", "npu", torch.bfloat16, 128).fallback_reason


def test_a_layer_falls_back_to_the_reference_once_with_its_reason(caplog):
    """A call no fused kernel can run (here: tensors on the meta device) runs the reference kernel,
    decided once per call shape, with one warning naming why; COC_ATTN_KERNEL=fused stops instead."""
    from coc_inject import log
    from coc_inject.config import CocConfig
    from coc_inject.context_parallel import attention

    log.reset_once()
    query = torch.empty(8, 1, 4, 16, device="meta")
    plan = attention.plan_local(CocConfig(flash_attn=True))
    with caplog.at_level("WARNING", logger="coc_inject"):
        choices = [attention.kernel_for(plan, query, "attention layer 1") for _ in range(3)]
    assert {c.name for c in choices} == {"reference"} and len(plan.kernels) == 1
    lines = [r.getMessage() for r in caplog.records if "reference kernel" in r.getMessage()]
    assert lines == ["attention on meta in float32, head dim 16 runs the reference kernel (tiled fp32 torch ops, "
                     "slower): no fused attention kernel for meta tensors"]
    forced = attention.plan_local(CocConfig(flash_attn=True, attn_kernel="fused"))
    with pytest.raises(attention.ContextParallelError, match="attention layer 1: COC_ATTN_KERNEL=fused: no fused "
                                                             "attention kernel can run this call"):
        attention.kernel_for(forced, query, "attention layer 1")
    assert attention.kernel_for(attention.plan_local(CocConfig(flash_attn=True, attn_kernel="reference")),
                                torch.empty(8, 1, 4, 16), "x").fallback_reason == "COC_ATTN_KERNEL=reference"


def test_the_config_offers_exactly_the_kernel_preferences():
    from coc_inject.config import ATTN_KERNELS  # the config stays torch-free, so it keeps its own copy

    assert ATTN_KERNELS == attention_kernels.PREFERENCES
