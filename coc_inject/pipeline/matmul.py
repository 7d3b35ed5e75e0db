"""Chunk matmuls: writing into strided chunk views, and the ``matmul_soc_friendly`` layout.

``matmul_into`` computes ``a @ b`` straight into a chunk view of a larger output. Under
sequence parallelism a chunk is ``[TP, c, h]`` with rank stride ``B*h``: each rank's slab is
contiguous but the whole is not, which ``torch.matmul(out=)`` rejects when it folds a
contiguous ``a`` to 2-D. Writing slab by slab needs no temporary and no copy.

``matmul_soc_friendly``: present forward matmul operands the way Ascend NPUs like them.

Ascend's matmul units read 512-byte blocks; a contraction size k whose row is not a
multiple of 512 bytes takes a slower path. MindSpeed therefore zero-pads k (inside a
``[k_min, k_max]`` window, where padding pays for its copy) and feeds contiguous operands.
Zero columns in both operands leave ``x @ Wᵀ`` unchanged.

Applied only when the input lives on an ``npu`` device: on CPU and CUDA it is a no-op, since
their BLAS libraries handle any k and the copies would only cost time. Not verified on real
Ascend hardware (none was available); the arithmetic is tested on CPU with ``device_type``
forced to "npu".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ALIGN_BYTES = 512


def padded_k(k: int, itemsize: int) -> int:
    """Smallest k' >= k whose row of ``k' * itemsize`` bytes is a multiple of 512 bytes."""
    per_block = ALIGN_BYTES // itemsize if ALIGN_BYTES % itemsize == 0 else ALIGN_BYTES
    return -(-k // per_block) * per_block


def pads(k: int, itemsize: int, k_min: int, k_max: int) -> bool:
    return k_min <= k <= k_max and padded_k(k, itemsize) != k


def matmul_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[...] = a @ b`` for 2-D ``a``/``out``, or 3-D ``[TP, c, h]`` chunk views with any
    rank stride: one plain matmul per rank slab (each slab is contiguous), which beats a
    broadcast ``bmm`` on the CPU (benchmarks/RESULTS.md)."""
    if a.dim() == 2:
        return torch.matmul(a, b, out=out)
    for a_slab, out_slab in zip(a, out):
        torch.matmul(a_slab, b, out=out_slab)
    return out


@dataclass(frozen=True)
class MatmulLayout:
    """The ``matmul_soc_friendly`` settings of one configuration."""

    soc_friendly: bool = False
    k_min: int = 1024
    k_max: int = 4096

    @classmethod
    def from_config(cls, config) -> "MatmulLayout":
        return cls(config.matmul_soc_friendly, config.k_min, config.k_max)

    def forward_matmul(self, weight: torch.Tensor, device_type: str) -> "ForwardMatmul":
        if not self.soc_friendly or device_type != "npu":
            return ForwardMatmul(weight.t(), pad=0, contiguous=False)
        k, itemsize = weight.shape[1], weight.element_size()
        extra = padded_k(k, itemsize) - k if pads(k, itemsize, self.k_min, self.k_max) else 0
        return ForwardMatmul(F.pad(weight, (0, extra)).t().contiguous(), pad=extra, contiguous=True)


@dataclass(frozen=True)
class ForwardMatmul:
    """``x @ Wᵀ`` for the forward chunks of one call, in the layout chosen for the device."""

    weight_t: torch.Tensor  # [k (+ pad), n]
    pad: int  # zero columns appended to each x chunk
    contiguous: bool  # copy strided chunk views to contiguous memory first

    def __call__(self, x_chunk: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.pad:
            x_chunk = F.pad(x_chunk, (0, self.pad))
        elif self.contiguous:
            x_chunk = x_chunk.contiguous()
        if out is None:
            return torch.matmul(x_chunk, self.weight_t)
        return matmul_into(x_chunk, self.weight_t, out)
