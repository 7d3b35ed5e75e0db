"""Public CoC operations on plain tensors and a process group (no Megatron needed).

Layout as ``torch.nn.functional.linear``: ``x`` is ``[..., k]``, ``weight`` is ``[n, k]``,
rows are every dim but the last. Each op runs the chunked compute/communication pipeline with
``chunks`` chunks (any row count; chunks may be uneven) and supports autograd.

* ``matmul_all_reduce``: ``AllReduce(x @ Wᵀ) + bias`` (RowParallel without SP). Also the
  w8a16 form: int8 ``weight`` with an antiquant scale (and optional offset), dequantised to the
  activation dtype before the pipeline.
* ``matmul_reduce_scatter``: ``ReduceScatter_rows(x @ Wᵀ) + bias``: rank r keeps rows
  ``[r*m/TP, (r+1)*m/TP)`` (RowParallel with SP). m must divide by the group size.
* ``all_gather_matmul``: ``AllGather_rows(x) @ Wᵀ + bias`` (ColumnParallel with SP);
  ``return_gathered=True`` also returns the gathered input ("ALL_GATHER_MATMUL_V2").

``backend``: "chunked" (default, the reference pipeline), "auto" (the first fused backend that can
run the call, else chunked with one line why), or a fused backend's name ("atb", "mc2",
"symm_mem"). w8a16
through a fused kernel: MC2 only (``npu_mm_all_reduce_base`` antiquant), and only without
autograd (inference); otherwise the weight is dequantised and the pipeline runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coc_inject.pipeline.functions import (
    AllGatherMatmul,
    FusedAllGatherMatmul,
    FusedKernel,
    FusedMatmulAllReduce,
    FusedMatmulReduceScatter,
    MatmulAllReduce,
    MatmulReduceScatter,
)
from coc_inject.pipeline.matmul import MatmulLayout

_PLAIN = MatmulLayout()


def _group(group):
    return group if group is not None else dist.group.WORLD


def _with_bias(output, bias):
    return output if bias is None else output + bias


def _check_chunks(chunks):
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks={chunks!r} is invalid: expected an integer >= 1")


def _fused(op, x2d, weight, group, backend):
    """The fused backend for this call, or None (chunked): ``backend`` as in the module doc."""
    from coc_inject.linears.fused import registry

    if backend == "chunked":
        return None
    if backend not in registry.CHOICES:
        raise ValueError(f"backend={backend!r} is invalid: expected one of {', '.join(registry.CHOICES)}")
    return registry.select(op, x2d, weight, group, backend, f"coc_inject.linears.ops.{op}", "using the chunked pipeline")


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None,
                      group_size: int = 0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(weight + offset) * scale`` for an int8 ``weight [n, k]`` (w8a16 antiquant).

    Scale/offset shapes, as MC2's antiquant arguments: per tensor ``[1]``; per channel ``[n]``;
    per group ``[ceil(k / group_size), n]`` (``group_size`` > 0: k is split into groups of
    ``group_size`` columns, the last one may be shorter).
    """
    if weight.dtype != torch.int8:
        raise ValueError(f"w8a16 weight dtype={weight.dtype} is invalid: expected torch.int8")
    dtype = dtype or scale.dtype
    n, k = weight.shape
    if group_size:
        groups = -(-k // group_size)
        if tuple(scale.shape) != (groups, n):
            raise ValueError(f"per-group antiquant scale shape={tuple(scale.shape)} is invalid: expected "
                             f"[ceil(k/group_size), n] = [{groups}, {n}] for k={k}, group_size={group_size}")
        expand = lambda t: t.t().repeat_interleave(group_size, dim=1)[:, :k]  # noqa: E731 -> [n, k]
    elif scale.numel() == 1:
        expand = lambda t: t.reshape(1, 1)  # noqa: E731
    elif tuple(scale.shape) == (n,):
        expand = lambda t: t.reshape(n, 1)  # noqa: E731
    else:
        raise ValueError(f"antiquant scale shape={tuple(scale.shape)} is invalid: expected [1] (per "
                         f"tensor), [{n}] (per channel) or [ceil(k/g), {n}] with group_size=g (per group)")
    dequantized = weight.to(dtype)
    if offset is not None:
        if offset.shape != scale.shape:
            raise ValueError(f"antiquant offset shape={tuple(offset.shape)} is invalid: expected the "
                             f"scale's shape {tuple(scale.shape)}")
        dequantized = dequantized + expand(offset.to(dtype))
    return dequantized * expand(scale.to(dtype))


def matmul_all_reduce(x, weight, group=None, *, bias=None, chunks: int = 4, backend: str = "chunked",
                      antiquant_scale=None, antiquant_offset=None, antiquant_group_size: int = 0):
    _check_chunks(chunks)
    group = _group(group)
    x2d = x.reshape(-1, x.shape[-1])
    if weight.dtype == torch.int8:
        if antiquant_scale is None:
            raise ValueError("an int8 weight needs antiquant_scale (w8a16)")
        antiquant = {"scale": antiquant_scale, "offset": antiquant_offset, "group_size": antiquant_group_size}
        inference = not (torch.is_grad_enabled() and x.requires_grad)
        fused = _fused("matmul_all_reduce_w8a16", x2d, weight, group, backend) if inference else None
        if fused is not None:
            (out,) = fused.run("matmul_all_reduce", x2d, weight, group, antiquant=antiquant)
            return _with_bias(out.view(*x.shape[:-1], -1), bias)
        weight = dequantize_weight(weight, antiquant_scale, antiquant_offset, antiquant_group_size, x.dtype)
    fused = _fused("matmul_all_reduce", x2d, weight, group, backend)
    if fused is not None:
        output = FusedMatmulAllReduce.apply(x2d, weight, FusedKernel(fused, chunks), group, False, _PLAIN)
        return _with_bias(output.view(*x.shape[:-1], -1), bias)
    output = MatmulAllReduce.apply(x, weight, chunks, group, False, _PLAIN)
    return _with_bias(output, bias)


def matmul_reduce_scatter(x, weight, group=None, *, bias=None, chunks: int = 4, backend: str = "chunked"):
    _check_chunks(chunks)
    group = _group(group)
    rows = x.shape[0]
    if rows % group.size():
        raise ValueError(f"x.shape[0]={rows} is invalid for matmul_reduce_scatter: expected a multiple of "
                         f"the group size {group.size()}")
    x2d = x.reshape(-1, x.shape[-1])
    fused = _fused("matmul_reduce_scatter", x2d, weight, group, backend)
    if fused is not None:
        output = FusedMatmulReduceScatter.apply(x2d, weight, FusedKernel(fused, chunks), group, False, _PLAIN)
        return _with_bias(output.view(rows // group.size(), *x.shape[1:-1], -1), bias)
    return _with_bias(MatmulReduceScatter.apply(x, weight, chunks, group, False, _PLAIN), bias)


def all_gather_matmul(x, weight, group=None, *, bias=None, chunks: int = 4, return_gathered: bool = False,
                      backend: str = "chunked"):
    _check_chunks(chunks)
    group = _group(group)
    x2d = x.reshape(-1, x.shape[-1])
    fused = _fused("all_gather_matmul", x2d, weight, group, backend)
    # Keep the gathered input from forward for wgrad when the caller wants it anyway.
    recompute = not return_gathered
    if fused is not None:
        output, gathered = FusedAllGatherMatmul.apply(x2d, weight, FusedKernel(fused, chunks), group, False,
                                                      _PLAIN, recompute)
        output = output.view(x.shape[0] * group.size(), *x.shape[1:-1], -1)
    else:
        output, gathered = AllGatherMatmul.apply(x, weight, chunks, group, False, _PLAIN, recompute)
    output = _with_bias(output, bias)
    if not return_gathered:
        return output
    return output, gathered.view(x.shape[0] * group.size(), *x.shape[1:])
