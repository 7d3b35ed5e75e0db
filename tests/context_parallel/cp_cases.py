"""Work run on every rank of a gloo pool by the context-parallel tests (results go back to the test)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from coc_inject.attention_kernels import cpu, reference
from coc_inject.context_parallel import layout
from coc_inject.context_parallel.function import ContextParallelAttention
from coc_inject.context_parallel.schedule import HYBRID, make_schedule

_groups: dict = {}


def _group(ranks):
    """Every rank creates every group, in the same order (new_group is collective)."""
    key = tuple(ranks)
    if key not in _groups:
        _groups[key] = dist.new_group(list(ranks))
    return _groups[key]


def full_inputs(seq, batch, heads, groups, dim, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, heads, dim, generator=generator)
    k = torch.randn(seq, batch, groups, dim, generator=generator)
    v = torch.randn(seq, batch, groups, dim, generator=generator)
    dout = torch.randn(seq, batch, heads, dim, generator=generator)
    return [t.to(dtype) for t in (q, k, v, dout)]


KERNELS = {"cpu-flash": cpu.KERNEL, "reference": reference.KERNEL}


def run_schedule(algorithm, cp, causal, seq, batch, heads, groups, dim, seed, window=1, ulysses=1,
                 kernel="cpu-flash", dtype="float32"):
    """This rank's rows of out, dq, dk, dv for one call (``kernel`` on ``dtype`` inputs), plus their
    sequence positions."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cp_groups = [_group(range(start, start + cp)) for start in range(0, world, cp)]
    ulysses_groups = {}
    if algorithm == HYBRID:
        for start in range(0, world, ulysses):
            ulysses_groups[start // ulysses] = _group(range(start, start + ulysses))
    cp_rank = rank % cp
    schedule = make_schedule(algorithm, cp_groups[rank // cp], causal=causal, scale=1 / math.sqrt(dim),
                             window=window, ulysses_group=ulysses_groups.get(rank // ulysses),
                             ulysses_size=ulysses)
    q, k, v, dout = full_inputs(seq, batch, heads, groups, dim, seed, getattr(torch, dtype))
    rows = layout.global_positions(layout.rank_chunks(cp_rank, cp), seq // (2 * cp))
    local = [t[rows].clone().requires_grad_(True) for t in (q, k, v)]
    out = ContextParallelAttention.apply(*local, schedule, KERNELS[kernel])
    out.backward(dout[rows])
    return {"rows": rows, "out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
