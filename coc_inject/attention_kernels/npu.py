"""Ascend: ``torch_npu.npu_fusion_attention`` and ``npu_fusion_attention_grad`` (the kernel
MindSpeed's context parallelism runs per block), layout ``BNSD``.

The kernel keeps the softmax statistics as ``softmax_max`` and ``softmax_sum`` (fp32
``[B, N, S, 8]``, the value repeated 8 times): ``lse = max + log(sum)``. Backward recomputes the
probabilities as ``exp(s - max) / sum``, so the final lse goes in as ``softmax_max = lse``,
``softmax_sum = 1``. ``head_num`` is the query heads; fewer K/V heads (GQA) run as they are.
A causal (diagonal, square) block passes the compressed 2048 x 2048 upper-triangle mask (True =
masked) with ``sparse_mode=3``, as MindSpeed does; a full block passes no mask.
Not verified on Ascend hardware in this repository: tested against a fake of this call contract
(``mindspeed/core/context_parallel/ring_context_parallel``, torch_npu's op schema).
"""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 512
CAUSAL_SPARSE_MODE = 3  # rightDownCausal; equal to leftUpCausal on square blocks
MASK_SIZE = 2048
STATS_WIDTH = 8


class NpuFusionKernel:
    name = "npu-fusion"

    def __init__(self, torch_npu=None):
        self._torch_npu = torch_npu
        self._masks: dict = {}

    @property
    def library(self):
        if self._torch_npu is None:
            import torch_npu

            self._torch_npu = torch_npu
        return self._torch_npu

    def _mask_args(self, q, causal: bool) -> dict:
        if not causal:
            return {"atten_mask": None, "sparse_mode": 0}
        mask = self._masks.get(q.device)
        if mask is None:
            mask = self._masks[q.device] = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=q.device).triu_(1)
        return {"atten_mask": mask, "sparse_mode": CAUSAL_SPARSE_MODE}

    def forward(self, q, k, v, scale: float, causal: bool):
        out, softmax_max, softmax_sum, *_ = self.library.npu_fusion_attention(
            q, k, v, q.shape[1], "BNSD", scale=scale, keep_prob=1.0, **self._mask_args(q, causal))
        return out, softmax_max[..., 0] + torch.log(softmax_sum[..., 0])

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool):
        stats_shape = (*lse.shape, STATS_WIDTH)
        softmax_max = lse.unsqueeze(-1).expand(stats_shape).contiguous()
        grads = self.library.npu_fusion_attention_grad(
            q, k, v, dout, q.shape[1], "BNSD", softmax_max=softmax_max,
            softmax_sum=torch.ones(stats_shape, dtype=torch.float32, device=lse.device), attention_in=out,
            scale_value=scale, keep_prob=1.0, **self._mask_args(q, causal))
        return grads[0], grads[1], grads[2]


KERNEL = NpuFusionKernel()


def kernel_for(dtype, head_dim: int):
    if dtype not in DTYPES or head_dim > MAX_HEAD_DIM:
        return None, (f"npu_fusion_attention takes fp16/bf16 and head dims up to {MAX_HEAD_DIM}, not {dtype} with "
                      f"head dim {head_dim}")
    try:
        KERNEL.library
    except ImportError as exc:
        return None, f"torch_npu cannot be imported ({exc})"
    return KERNEL, None
