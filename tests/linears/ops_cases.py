"""Rank-side checks of coc_inject.linears.ops against a dense float64 reference (see dist_harness.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from coc_inject.linears import ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _gather(tensor):
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def _rel(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _tensors(rows, k, n, seed, dtype=torch.float32, same_x=False):
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed + (0 if same_x else 100 * rank))
    x = torch.randn(rows, 2, k, generator=gen).to(dtype)
    gen_w = torch.Generator().manual_seed(seed + 7 + 100 * rank)
    weight = torch.randn(n, k, generator=gen_w).to(dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 3)).to(dtype)
    return x, weight, bias


def check_op(op, *, chunks, rows=13, k=16, n=24, seed=0, dtype="float32", backend="chunked"):
    """Output and gradients of one op against dense float64 math on the gathered operands."""
    dtype = DTYPES[dtype]
    world, rank = dist.get_world_size(), dist.get_rank()
    x, weight, bias = _tensors(rows, k, n, seed, dtype)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    grad_seed = torch.Generator().manual_seed(seed + 11 + rank)
    if op == "matmul_all_reduce":
        out = ops.matmul_all_reduce(x, weight, bias=bias, chunks=chunks, backend=backend)
        xs, ws = _gather(x.detach()), _gather(weight.detach())
        expected = sum(xi.double() @ wi.double().t() for xi, wi in zip(xs, ws)) + bias.double()
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 11)).to(dtype)
        expected_dx = grad.double() @ weight.detach().double()
        expected_dw = grad.double().reshape(-1, n).t() @ x.detach().double().reshape(-1, k)
        extra = {}
    elif op == "matmul_reduce_scatter":
        out = ops.matmul_reduce_scatter(x, weight, bias=bias, chunks=chunks, backend=backend)
        xs, ws = _gather(x.detach()), _gather(weight.detach())
        full = sum(xi.double() @ wi.double().t() for xi, wi in zip(xs, ws))
        block = rows // world
        expected = full[rank * block:(rank + 1) * block] + bias.double()
        grad = torch.randn(out.shape, generator=grad_seed).to(dtype)
        grad_full = torch.cat([g.double() for g in _gather(grad)])
        expected_dx = grad_full @ weight.detach().double()
        expected_dw = grad_full.reshape(-1, n).t() @ x.detach().double().reshape(-1, k)
        extra = {}
    else:  # all_gather_matmul (V2)
        out, gathered = ops.all_gather_matmul(x, weight, bias=bias, chunks=chunks, return_gathered=True,
                                              backend=backend)
        xs = _gather(x.detach())
        full_x = torch.cat([xi.double() for xi in xs])
        expected = full_x @ weight.detach().double().t() + bias.double()
        grad = torch.randn(out.shape, generator=grad_seed).to(dtype)
        dx_full = sum(g.double() @ w.double() for g, w in zip(_gather(grad), _gather(weight.detach())))
        block = rows
        expected_dx = dx_full[rank * block:(rank + 1) * block]
        expected_dw = grad.double().reshape(-1, n).t() @ full_x.reshape(-1, k)
        extra = {"gathered": _rel(gathered, full_x)}
    out.backward(grad)
    return {"output": _rel(out.detach(), expected), "input_grad": _rel(x.grad, expected_dx),
            "weight_grad": _rel(weight.grad, expected_dw), **extra}


def check_w8a16(*, granularity, dtype, chunks=3, rows=10, k=40, n=24, group_size=16, with_offset=True,
                backend="chunked"):
    """int8 weight + antiquant scale/offset vs dequantise-then-matmul, summed over ranks."""
    dtype = DTYPES[dtype]
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(50 + rank)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    shape = {"tensor": (1,), "channel": (n,), "group": (-(-k // group_size), n)}[granularity]
    scale = (torch.rand(shape, generator=gen) * 0.02 + 0.001).to(dtype)
    offset = torch.randint(-8, 8, shape, generator=gen).to(dtype) if with_offset else None
    group_arg = group_size if granularity == "group" else 0
    out = ops.matmul_all_reduce(x, weight, antiquant_scale=scale, antiquant_offset=offset,
                                antiquant_group_size=group_arg, chunks=chunks, backend=backend)
    # Independent reference: dequantise column by column with explicit loops over groups.
    w = weight.double()
    columns = []
    for col in range(k):
        if granularity == "tensor":
            s, o = scale.double().reshape(()), (offset.double().reshape(()) if with_offset else 0.0)
        elif granularity == "channel":
            s, o = scale.double(), (offset.double() if with_offset else 0.0)
        else:
            s, o = scale.double()[col // group_size], (offset.double()[col // group_size] if with_offset else 0.0)
        columns.append((w[:, col] + o) * s)
    dequantized = torch.stack(columns, dim=1)
    mine = x.double() @ dequantized.t()
    expected = sum(_gather(mine))
    return {"error": _rel(out, expected)}


def bad_input_messages():
    messages = []
    x = torch.randn(5, 8)
    for call in (
        lambda: ops.matmul_all_reduce(x, torch.randn(4, 8), chunks=0),
        lambda: ops.matmul_reduce_scatter(torch.randn(5, 8), torch.randn(4, 8)),
        lambda: ops.matmul_all_reduce(x, torch.zeros(4, 8, dtype=torch.int8)),
        lambda: ops.matmul_all_reduce(x, torch.zeros(4, 8, dtype=torch.int8), antiquant_scale=torch.ones(3)),
    ):
        try:
            call()
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages
