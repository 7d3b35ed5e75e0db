"""CUDA: the kernels behind ``scaled_dot_product_attention``, called with their log-sum-exp, as
PyTorch's own context parallelism calls them (``torch/distributed/tensor/experimental/_attention``):

* fp16 / bf16, head dim a multiple of 8 up to 256: ``aten._scaled_dot_product_flash_attention``
  and ``_backward`` (FlashAttention-2; grouped-query attention with fewer K/V heads as it is).
* otherwise fp32 / fp16 / bf16 up to head dim 256: ``aten._scaled_dot_product_efficient_attention``
  and ``_backward`` (memory-efficient; same head count for q and k/v, so K/V heads are repeated
  for GQA and their gradients summed back; its lse is padded to a multiple of 32 rows).

Causal blocks are square, so the kernels' top-left / bottom-right alignment agree. Dropout is
0 (the schedules refuse attention dropout), so the random-state arguments are placeholders.
Not verified on a GPU in this repository: tested against a fake of this call contract.
"""

from __future__ import annotations

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
LSE_ALIGN = 32  # the memory-efficient kernel's logsumexp rows: a multiple of 32


def _rng_placeholders(device):
    return torch.zeros(2, dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


class CudaFlashKernel:
    name = "cuda-flash"

    def __init__(self, ops=None):
        self.ops = ops if ops is not None else torch.ops.aten

    def forward(self, q, k, v, scale: float, causal: bool):
        out, lse, *_ = self.ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool):
        seed, offset = _rng_placeholders(q.device)
        dq, dk, dv = self.ops._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
            scale=scale)
        return dq, dk, dv


class CudaEfficientKernel:
    name = "cuda-efficient"

    def __init__(self, ops=None):
        self.ops = ops if ops is not None else torch.ops.aten

    @staticmethod
    def _repeat(q, t):
        repeats = q.shape[1] // t.shape[1]
        return t if repeats == 1 else t.repeat_interleave(repeats, dim=1)

    def forward(self, q, k, v, scale: float, causal: bool):
        out, lse, *_ = self.ops._scaled_dot_product_efficient_attention(
            q, self._repeat(q, k), self._repeat(q, v), None, True, 0.0, causal, scale=scale)
        return out, lse[..., :q.shape[2]]

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool):
        rows = q.shape[2]
        padded = torch.zeros((*lse.shape[:-1], -(-rows // LSE_ALIGN) * LSE_ALIGN), dtype=lse.dtype, device=lse.device)
        padded[..., :rows] = lse
        seed, offset = _rng_placeholders(q.device)
        dq, dk, dv, _ = self.ops._scaled_dot_product_efficient_attention_backward(
            dout, q, self._repeat(q, k), self._repeat(q, v), None, out, padded, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale)
        b, groups, sk, d = k.shape
        if dk.shape[1] != groups:  # the repeated heads' gradients, summed per K/V head
            dk = dk.view(b, groups, -1, sk, d).sum(dim=2)
            dv = dv.view(b, groups, -1, sk, d).sum(dim=2)
        return dq, dk, dv


FLASH, EFFICIENT = CudaFlashKernel(), CudaEfficientKernel()


def kernel_for(dtype, head_dim: int):
    if dtype in FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM:
        return FLASH, None
    if dtype in EFFICIENT_DTYPES and head_dim <= MAX_HEAD_DIM:
        return EFFICIENT, None
    return None, (f"CUDA's fused attention kernels take fp16/bf16/fp32 and head dims up to {MAX_HEAD_DIM}, "
                  f"not {dtype} with head dim {head_dim}")
