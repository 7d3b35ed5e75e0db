"""What one measured attention call takes: the algorithms a shape allows (its variants), each
variant's schedule over the local ranks, the inputs (whole sequence and this rank's rows in
Megatron's CP layout), the block kernels, and the yardstick -- ``scaled_dot_product_attention``
on the whole sequence in one process. Used by the bench's attention and flash cases and the
self-test."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from coc_inject import attention_kernels
from coc_inject.attention_kernels import reference
from coc_inject.context_parallel import layout
from coc_inject.context_parallel.schedule import make_schedule
from coc_inject.timer import seconds


@dataclass(frozen=True)
class Variant:
    name: str
    algorithm: str
    window: int = 1
    ulysses: int = 1
    kernel: str | None = None  # None: the bench's --kernel; "reference": an extra row of --kernel both

    @property
    def is_ring(self) -> bool:
        return self.algorithm == "ring" and self.kernel is None


def variants_for(cp: int, heads: int, groups: int) -> list:
    """Every algorithm this shape allows at ``cp``: Ulysses needs heads and key/value groups divisible
    by its degree; Double-Ring a window strictly between 1 and the ring size."""
    variants = [Variant("ring", "ring")]
    if cp >= 4 and cp % 2 == 0:
        variants.append(Variant("double-ring w=2", "ring", window=2))
    if heads % cp == 0 and groups % cp == 0:
        variants.append(Variant("ulysses", "ulysses"))
    if cp >= 4 and cp % 2 == 0 and heads % 2 == 0 and groups % 2 == 0:
        variants.append(Variant("hybrid u=2", "hybrid", ulysses=2))
    variants.append(Variant("allgather", "allgather"))
    return variants


def schedules(cp: int, variants: list, dim: int) -> dict:
    """One schedule per variant over the whole world (= the CP group). Every rank creates every
    group in the same order (new_group is collective), hybrid's Ulysses pairs included."""
    cp_group = dist.new_group(list(range(cp)))
    rank = dist.get_rank()
    pairs = {}
    if any(v.algorithm == "hybrid" for v in variants):
        for start in range(0, cp, 2):
            group = dist.new_group([start, start + 1])
            if rank in (start, start + 1):
                pairs[2] = group
    return {v.name: make_schedule(v.algorithm, cp_group, causal=True, scale=1 / math.sqrt(dim), window=v.window,
                                  ulysses_group=pairs.get(v.ulysses), ulysses_size=v.ulysses)
            for v in variants}


def whole_inputs(args):
    """q, k, v, dout of the whole sequence ([s, b, heads|groups, d], --dtype)."""
    generator = torch.Generator().manual_seed(1234)
    shapes = [(args.seq, args.batch, n, args.head_dim) for n in (args.heads, args.kv_groups, args.kv_groups,
                                                                 args.heads)]
    return [torch.randn(shape, generator=generator).to(getattr(torch, args.dtype)) for shape in shapes]


def local_inputs(args, cp: int, rank: int):
    """This rank's q, k, v, dout rows ([s/cp, b, heads|groups, d]), Megatron's layout."""
    rows = layout.global_positions(layout.rank_chunks(rank, cp), args.seq // (2 * cp))
    return [t[rows].contiguous() for t in whole_inputs(args)]


def kernels(args) -> dict:
    """{None: the --kernel block kernel, "reference": the reference} (the fused one of this device)."""
    primary = reference.KERNEL if args.kernel == "reference" else attention_kernels.choose(
        attention_kernels.FUSED, "cpu", getattr(torch, args.dtype), args.head_dim).kernel
    return {None: primary, "reference": reference.KERNEL}


def sdpa(whole) -> tuple:
    """The yardstick in this process: scaled_dot_product_attention on the whole sequence (causal),
    forward and backward; returns (forward s, backward s)."""
    q, k, v = (t.permute(1, 2, 0, 3).detach().clone().requires_grad_(True) for t in whole[:3])
    dout = whole[3].permute(1, 2, 0, 3)
    out, forward = seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  enable_gqa=k.shape[1] != q.shape[1]))
    return forward, seconds(lambda: out.backward(dout))[1]


def sdpa_call(whole):
    """The yardstick on rank 0 (sdpa), timed alone -- the Timer's barrier would wait for the other
    ranks, which wait at a barrier instead (and report zeros)."""
    dist.barrier()
    times = sdpa(whole) if dist.get_rank() == 0 else (0.0, 0.0)
    dist.barrier()
    return times
