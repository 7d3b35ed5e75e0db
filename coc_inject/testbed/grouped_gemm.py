"""A CPU stand-in for Megatron's ``grouped_gemm`` extension: the legacy ``GroupedMLP`` experts
(megatron-core 0.12 to 0.16, ``--moe-grouped-gemm`` with the local spec) build and run on CPU ranks:
the tests' (tests/fakes/grouped_gemm.py) and the bench's (``coc-inject bench --cases moe --grouped``).
Never installed in a user's job.

Megatron's ``transformer/moe/grouped_gemm_util.py`` does ``import grouped_gemm`` at its import and
``GroupedMLP`` calls ``gg.ops.gmm(a, b, batch_sizes, trans_b=False)``. The extension (tgale96's /
fanshiqing's ``grouped_gemm``, CUDA and CUTLASS / cuBLAS only) takes ``a [tokens, k]``, ``b [experts,
k, n]`` (``[experts, n, k]`` with ``trans_b``) and ``batch_sizes``, an int64 tensor ON THE HOST with one
count per expert, and returns the per-expert products ``a[rows of e] @ b[e]`` concatenated in ``a``'s
row order, ``[tokens, n]``; its autograd backward is ``grad @ b[e]^T`` for ``a`` and ``a[rows of
e]^T @ grad`` per expert for ``b`` (fp32 accumulation, as cuBLAS with CUDA_R_32F compute). This
module checks the call contract the kernel checks (``TORCH_CHECK``s of csrc/grouped_gemm.cu: a 2-D,
b 3-D, batch_sizes a 1-D int64 host tensor with one count per expert, matching contraction
dimensions, contiguous operands, one dtype) plus what the kernel silently assumes (the counts sum to
``a``'s rows: the kernel would read past the end or leave rows unwritten) and computes the true
result. One difference, stated: the CUDA kernel takes bf16 only; the stand-in also takes fp32 (and
records the dtype of every call in :data:`calls`), so that a fp32 run can be compared exactly.
Verified against this stand-in only, never against the extension on a GPU.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

NAME = "grouped_gemm"
DTYPES = (torch.bfloat16, torch.float32)  # the CUDA kernel: bf16 only (module docstring)
calls: list = []  # (rows, experts, dtype, trans_b) of every forward call since install()


def _check(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool) -> None:
    if not isinstance(batch_sizes, torch.Tensor) or batch_sizes.device.type != "cpu":
        raise RuntimeError("gmm: batch_sizes must be a tensor on the host (the kernel reads it from the CPU)")
    if batch_sizes.dim() != 1 or batch_sizes.dtype != torch.int64:
        raise RuntimeError(f"gmm: batch_sizes must be a 1-D int64 tensor, got {batch_sizes.dim()}-D "
                           f"{batch_sizes.dtype}")
    if a.dim() != 2 or b.dim() != 3:
        raise RuntimeError(f"gmm: expects a 2-D and b 3-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in DTYPES:
        raise RuntimeError(f"gmm: a and b must share one dtype of {DTYPES}, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise RuntimeError(f"gmm: a on {a.device}, b on {b.device}")
    if batch_sizes.shape[0] != b.shape[0]:
        raise RuntimeError(f"gmm: {batch_sizes.shape[0]} batch sizes for {b.shape[0]} experts")
    hidden_in = b.shape[2] if trans_b else b.shape[1]
    if a.shape[1] != hidden_in:
        raise RuntimeError(f"gmm: a has {a.shape[1]} columns, b's contraction dimension is {hidden_in}")
    if not (a.is_contiguous() and b.is_contiguous()):
        raise RuntimeError("gmm: a and b must be contiguous")
    if (batch_sizes < 0).any() or int(batch_sizes.sum()) != a.shape[0]:
        raise RuntimeError(f"gmm: batch sizes {batch_sizes.tolist()} do not sum to a's {a.shape[0]} rows")


def _products(a, b, sizes: list, trans_b: bool) -> torch.Tensor:
    """Per expert ``a[rows] @ b[e]`` (``b[e]^T`` with ``trans_b``), concatenated."""
    parts = [rows @ (b[e].t() if trans_b else b[e]) for e, rows in enumerate(torch.split(a, sizes))]
    width = b.shape[1] if trans_b else b.shape[2]
    return torch.cat(parts) if parts else a.new_empty((0, width))


class GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, batch_sizes, trans_b):
        _check(a, b, batch_sizes, trans_b)
        calls.append((a.shape[0], b.shape[0], a.dtype, trans_b))
        ctx.save_for_backward(a, b)
        ctx.sizes, ctx.trans_b = batch_sizes.tolist(), trans_b
        return _products(a, b, ctx.sizes, trans_b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = _products(grad, b, ctx.sizes, not ctx.trans_b)
        if ctx.needs_input_grad[1]:
            pairs = zip(torch.split(a, ctx.sizes), torch.split(grad, ctx.sizes))
            # per expert a_e^T grad_e ([k, n]; its transpose with trans_b), accumulated in fp32
            grad_b = torch.stack([(g.float().t() @ x.float() if ctx.trans_b else x.float().t() @ g.float()).to(b.dtype)
                                  for x, g in pairs])
        return grad_a, grad_b, None, None


def gmm(a, b, batch_sizes, trans_b=False):
    return GroupedGemm.apply(a, b, batch_sizes, trans_b)


def module() -> types.ModuleType:
    fake = types.ModuleType(NAME)
    fake.ops = types.ModuleType(f"{NAME}.ops")
    fake.ops.gmm = gmm
    fake.__doc__ = __doc__
    return fake


def install() -> types.ModuleType:
    """For the rest of this process: ``import grouped_gemm`` finds the stand-in, and Megatron's
    ``grouped_gemm_util`` (imported already or not) sees it available. Idempotent."""
    fake = sys.modules.get(NAME)
    if getattr(fake, "__doc__", None) != __doc__:
        fake = sys.modules[NAME] = module()
    _point_megatron_at(fake)
    return fake


def _point_megatron_at(fake) -> None:
    try:
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:  # megatron-core 0.17+: no legacy GroupedMLP, no grouped_gemm_util
        return
    grouped_gemm_util.grouped_gemm = fake
    grouped_gemm_util.ops = None if fake is None else fake.ops


@contextlib.contextmanager
def installed():
    """Inside, ``grouped_gemm`` is the stand-in; afterwards whatever was there before."""
    saved = sys.modules.get(NAME)
    fake = install()
    calls.clear()
    try:
        yield fake
    finally:
        if saved is None:
            sys.modules.pop(NAME, None)
        else:
            sys.modules[NAME] = saved
        _point_megatron_at(saved)
