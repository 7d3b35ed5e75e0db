"""Where sequence copies meet under context parallelism (CP > 1): each copy's attention runs the
layer's CP algorithm (coc_inject.context_parallel), against the earlier copy's keys and values too.

Megatron's CP layout gives CP rank ``r`` the chunks ``r`` and ``2 CP - 1 - r`` of the sequence's
``2 CP`` (load-balanced causal attention). Two copies split each rank's rows in two: copy 0 is the
rank's first chunk, copy 1 its second (sequence.py's split of this rank's rows, unchanged). Over the
CP group copy 0 holds the sequence's first half (chunk ``r`` on rank ``r``) and copy 1 the second
half (in reversed rank order): every key copy 0's queries see is copy 0's, and copy 1's queries see
all of copy 0's keys and its own causally. Copy 0 never needs copy 1, so the copies take their
turns as everywhere else (meeting.py). More than two copies would interleave the chunks of one
half between copies: refused (:func:`reason`).

One autograd node per copy and layer (:class:`CopyContextParallelAttention`) runs the layer's
algorithm with its usual collectives, in program order, on the copy's queries and on the keys and
values of every copy so far, each rank's part being its earlier copies' chunks and then its own:

* ring and Double-Ring: the ring carries each rank's part; the block plan (context_parallel.layout)
  reads each part's chunk ids, so copy 0's keys are fully visible to copy 1's queries;
* Ulysses and hybrid: one all-to-all takes the copy's queries, keys and values and the earlier
  copy's keys and values to the head split (every rank of the Ulysses group: its heads, the group's
  rows), then the ring (of one for Ulysses), then one all-to-all back for the out (and, in the
  backward, for every gradient);
* all-gather: the parts gathered, the key/value gradients reduce-scattered to their owners.

The earlier copy's keys and values are inputs of the later copy's node: their gradients leave it and
join the earlier copy's own before its key/value projection's backward (segments.py keeps every node
in its copy's band). The later copy sends the earlier copy's keys and values again (its own
collective), so each node holds all of its call's collectives, as the CP wing's do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coc_inject import job
from coc_inject.context_parallel import allgather, attention, layout, masks, ring as ring_schedule, ulysses
from coc_inject.context_parallel.ring import Ring
from coc_inject.context_parallel.schedule import ALLGATHER, HYBRID, ULYSSES
from coc_inject.routes import AttentionRoute

COPIES = 2  # Megatron's CP layout holds two chunks per rank: one per copy


def _to_kernel(t: torch.Tensor) -> torch.Tensor:
    """[S, B, H, D] -> [B, H, S, D] (contiguous)."""
    return t.permute(1, 2, 0, 3).contiguous()


def _from_kernel(t: torch.Tensor, dtype) -> torch.Tensor:
    """[B, H, S, D] -> [S, B, H, D] in ``dtype``."""
    return t.permute(2, 0, 1, 3).to(dtype)


def reason(block, copies: int, arguments: dict, seq: int) -> str | None:
    """Why this call cannot run as sequence copies under context parallelism (``seq``: this CP rank's
    rows of the sequence), or None."""
    cp = block.config.context_parallel_size
    if copies != COPIES:
        return (f"context parallelism (CP {cp}) with {copies} copies: Megatron's CP layout holds two chunks of "
                "the sequence per rank, one per copy (2 copies only)")
    if seq % 2:
        return f"context parallelism needs this rank's {seq} rows in two chunks"
    mask = arguments.get("attention_mask")
    for layer in block.layers:
        core = layer.self_attention.core_attention
        plan = getattr(core, "_coc_cp", None)
        if plan is None or plan.local:
            return f"context parallelism (CP {cp}) without coc-inject's context-parallel attention on a layer"
        if plan.auto:
            return ("COC_CP_ALGO=auto (its trials time each layer's attention on this rank's whole sequence; "
                    "sequence copies split it: set the algorithm)")
        ignored = mask is not None and masks.megatron_ignores_mask(core, block_batch(arguments), seq * cp)
        try:
            causal = attention.is_causal(plan, core.attn_mask_type, mask,
                                         layout.rank_chunks(plan.cp_group.rank(), plan.cp_size), seq // 2, ignored)
        except attention.ContextParallelError as exc:
            return str(exc)
        if not causal:
            return "attention that is not causal under context parallelism (a copy would need a later copy's keys)"
    return None


def block_batch(arguments: dict) -> int:
    """The block call's micro-batch: the hidden states' ``[s, b, h]`` middle dim."""
    return arguments["hidden_states"].shape[1]


@dataclass(frozen=True)
class CopySchedule:
    """How one rank runs one copy's attention in one layer: the queries' chunk ids (after the
    all-to-all, if any), the ring whose parts hold every copy so far (ring, Ulysses, hybrid) or each
    rank's chunk ids in rank order (all-gather)."""

    algorithm: str
    cp_group: object
    cp_size: int
    q_ids: tuple
    scale: float
    ring: Ring | None = None
    rank_ids: tuple = ()  # all-gather: the chunk ids of the gathered parts, rank after rank
    heads_group: object = None
    heads_size: int = 1


def _chunks(ranks, size: int, copies) -> tuple:
    """Chunk ids of these ranks' parts of ``copies``, copy after copy (each copy: the ranks in order)."""
    return tuple(layout.rank_chunks(rank, size)[copy] for copy in copies for rank in ranks)


def schedule_for(plan, variant, copy: int) -> CopySchedule:
    """Copy ``copy``'s schedule for a layer's ``variant`` (kept on the plan)."""
    key = ("sequence copy", variant, copy)
    found = plan.schedules.get(key)
    if found is not None:
        return found
    group, size = plan.cp_group, plan.cp_size
    rank = group.rank()
    so_far = range(copy + 1)
    common = dict(algorithm=variant.algorithm, cp_group=group, cp_size=size, scale=plan.scale)
    if variant.algorithm == ALLGATHER:
        schedule = CopySchedule(q_ids=_chunks([rank], size, [copy]),
                                rank_ids=tuple(i for p in range(size) for i in _chunks([p], size, so_far)), **common)
    else:
        import torch.distributed as dist

        u = variant.ulysses_degree if variant.algorithm in (ULYSSES, HYBRID) else 1
        mine, offset = divmod(rank, u)
        members = [range(g * u, (g + 1) * u) for g in range(size // u)]
        global_ranks = [dist.get_global_rank(group, r) for r in range(size)]
        window = 1 if variant.algorithm == ULYSSES else variant.window
        ring = Ring(group, tuple(global_ranks[g * u + offset] for g in range(size // u)), mine, window,
                    tuple(_chunks(m, size, so_far) for m in members))
        schedule = CopySchedule(q_ids=_chunks(members[mine], size, [copy]), ring=ring,
                                heads_group=variant.ulysses_group if u > 1 else None, heads_size=u, **common)
    plan.schedules[key] = schedule
    return schedule


class CopyContextParallelAttention(torch.autograd.Function):
    """One copy's attention: q ``[s, b, heads, d]``, k/v ``[s, b, groups, d]`` (this rank's chunk of the
    copy) and the earlier copies' k, v (their chunks on this rank) -> out ``[s, b, heads, d]``. Returns
    gradients for q, k, v and every earlier k, v."""

    @staticmethod
    def forward(ctx, q, k, v, schedule: CopySchedule, kernel, *earlier):
        tensors = [q, k, v, *earlier]
        if schedule.heads_size > 1:
            tensors = ulysses.to_head_split(schedule.heads_group, schedule.heads_size, tensors)
        q, *kv_parts = tensors
        keys, values = kv_parts[2::2] + kv_parts[:1], kv_parts[3::2] + kv_parts[1:2]  # earlier copies first
        chunk_len = q.shape[0] // len(schedule.q_ids)
        q4 = _to_kernel(q)
        kv = torch.stack([torch.cat(keys), torch.cat(values)]).permute(0, 2, 3, 1, 4).contiguous()
        if schedule.algorithm == ALLGATHER:
            out, lse = allgather.forward(schedule.cp_group, schedule.cp_size, kernel, q4, kv, schedule.q_ids, True,
                                         chunk_len, schedule.scale, k_ids=schedule.rank_ids)
        else:
            out, lse = ring_schedule.forward(schedule.ring, kernel, q4, kv, schedule.q_ids, True, chunk_len,
                                             schedule.scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q4, kv, out, lse)
        ctx.schedule, ctx.kernel, ctx.chunk_len = schedule, kernel, chunk_len
        ctx.part_rows = keys[0].shape[0]
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
        args = (kernel, q4, kv, dout4, out, lse, schedule.q_ids, True, ctx.chunk_len, schedule.scale)
        if schedule.algorithm == ALLGATHER:
            dq, dkv = allgather.backward(schedule.cp_group, schedule.cp_size, *args, k_ids=schedule.rank_ids)
        else:
            dq, dkv = ring_schedule.backward(schedule.ring, *args)
        dks = _from_kernel(dkv[0], kv.dtype).split(ctx.part_rows)
        dvs = _from_kernel(dkv[1], kv.dtype).split(ctx.part_rows)
        grads = [_from_kernel(dq, q4.dtype), dks[-1], dvs[-1]]
        for dk, dv in zip(dks[:-1], dvs[:-1]):
            grads += [dk, dv]
        if schedule.heads_size > 1:
            grads = ulysses.to_sequence_split(schedule.heads_group, schedule.heads_size, grads)
        return grads[0], grads[1], grads[2], None, None, *grads[3:]


def repeated(plan, key, value) -> tuple:
    """The layer's keys and values as its variant runs them (K/V groups repeated for the all-to-all)."""
    repeats = plan.variants[0].kv_repeats
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, dim=2), value.repeat_interleave(repeats, dim=2)
    return key, value


def attend(plan, layer, copy: int, query, key, value, earlier: list):
    """Copy ``copy``'s attention in ``layer`` (``key``, ``value``: :func:`repeated`; ``earlier``: the earlier
    copies' (key, value)) -> ``[s, b, heads * d]``, counted as the layer's CP route."""
    variant = plan.variants[0]
    choice = attention.kernel_for(plan, query, f"attention layer {getattr(layer, 'layer_number', '?')}")
    flat = [t for pair in earlier for t in pair]
    out = CopyContextParallelAttention.apply(query, key, value, schedule_for(plan, variant, copy), choice.kernel, *flat)
    coverage = getattr(job.current(), "coverage", None)
    if coverage is not None:
        coverage.count_attention(layer, AttentionRoute(variant.describe() + " (sequence copies)", plan.cp_size,
                                                       choice.name))
    s, b, heads, d = query.shape
    return out.reshape(s, b, heads * d)
