"""One autograd Function per attention call: all of the call's transfers, forward and backward,
in one node, issued in the same order on every rank.

The algorithms are compositions of two schedules: Ulysses' all-to-all over heads (``heads_size``
ranks) around a ring of key/value blocks (``ring``). Ring and Double-Ring: no all-to-all, a ring
over the CP group. Ulysses: an all-to-all over the CP group, a ring of one (the local block).
Hybrid: an all-to-all over groups of u ranks, a ring across them. All-gather has its own
schedule (``allgather``).
"""

from __future__ import annotations

import torch

from coc_inject.context_parallel import allgather, ring as ring_schedule, ulysses
from coc_inject.context_parallel.schedule import ALLGATHER, Schedule


def _to_kernel(t: torch.Tensor) -> torch.Tensor:
    """[S, B, H, D] -> [B, H, S, D] (contiguous)."""
    return t.permute(1, 2, 0, 3).contiguous()


def _from_kernel(t: torch.Tensor, dtype) -> torch.Tensor:
    """[B, H, S, D] -> [S, B, H, D] in ``dtype``."""
    return t.permute(2, 0, 1, 3).to(dtype)


class ContextParallelAttention(torch.autograd.Function):
    """q ``[s, b, heads, d]``, k/v ``[s, b, groups, d]`` in Megatron's CP layout -> out ``[s, b, heads, d]``,
    every block through ``kernel`` (coc_inject.attention_kernels)."""

    @staticmethod
    def forward(ctx, q, k, v, schedule: Schedule, kernel):
        if schedule.heads_size > 1:
            q, k, v = ulysses.to_head_split(schedule.heads_group, schedule.heads_size, [q, k, v])
        chunk_len = q.shape[0] // len(schedule.q_ids)
        q4 = _to_kernel(q)
        s, b, g, d = k.shape
        kv = torch.empty((2, b, g, s, d), dtype=k.dtype, device=k.device)  # one transfer per ring hop
        kv[0].copy_(k.permute(1, 2, 0, 3))
        kv[1].copy_(v.permute(1, 2, 0, 3))
        if schedule.algorithm == ALLGATHER:
            out, lse = allgather.forward(schedule.cp_group, schedule.cp_size, kernel, q4, kv, schedule.q_ids,
                                         schedule.causal, chunk_len, schedule.scale)
        else:
            out, lse = ring_schedule.forward(schedule.ring, kernel, q4, kv, schedule.q_ids, schedule.causal,
                                             chunk_len, schedule.scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q4, kv, out, lse)
        ctx.schedule, ctx.kernel, ctx.chunk_len = schedule, kernel, chunk_len
        result = _from_kernel(out, q.dtype)
        if schedule.heads_size > 1:
            (result,) = ulysses.to_sequence_split(schedule.heads_group, schedule.heads_size, [result])
        return result

    @staticmethod
    def backward(ctx, dout):
        schedule, kernel = ctx.schedule, ctx.kernel
        q4, kv, out, lse = ctx.saved_tensors
        if schedule.heads_size > 1:
            (dout,) = ulysses.to_head_split(schedule.heads_group, schedule.heads_size, [dout])
        dout4 = _to_kernel(dout.to(q4.dtype))
        args = (kernel, q4, kv, dout4, out, lse, schedule.q_ids, schedule.causal, ctx.chunk_len, schedule.scale)
        if schedule.algorithm == ALLGATHER:
            dq, dkv = allgather.backward(schedule.cp_group, schedule.cp_size, *args)
        else:
            dq, dkv = ring_schedule.backward(schedule.ring, *args)
        grads = [_from_kernel(dq, q4.dtype), _from_kernel(dkv[0], kv.dtype), _from_kernel(dkv[1], kv.dtype)]
        if schedule.heads_size > 1:
            grads = ulysses.to_sequence_split(schedule.heads_group, schedule.heads_size, grads)
        return grads[0], grads[1], grads[2], None, None
