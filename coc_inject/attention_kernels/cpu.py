"""CPU: torch's fused flash-attention kernel, ``aten._scaled_dot_product_flash_attention_for_cpu``
and its ``_backward`` (what ``scaled_dot_product_attention`` runs on CPU), which take and return
the log-sum-exp. Tiled inside, in the input dtype with fp32 accumulation; grouped-query attention
with fewer K/V heads, strided views and any head dim run as they are (checked on torch 2.4+).
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class CpuFlashKernel:
    name = "cpu-flash"

    def __init__(self, ops=None):
        self.ops = ops if ops is not None else torch.ops.aten

    def forward(self, q, k, v, scale: float, causal: bool):
        out, lse = self.ops._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool):
        dq, dk, dv = self.ops._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        return dq, dk, dv


KERNEL = CpuFlashKernel()


def kernel_for(dtype, head_dim: int):
    if dtype not in DTYPES:
        return None, f"the CPU flash kernel takes {', '.join(str(d).removeprefix('torch.') for d in DTYPES)}, not {dtype}"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return None, f"torch {torch.__version__} has no CPU flash-attention kernel"
    return KERNEL, None
