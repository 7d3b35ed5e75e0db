"""Megatron's context-parallel sequence layout and which attention blocks it needs: pure arithmetic.

``get_batch_on_this_cp_rank`` cuts the sequence into 2*CP chunks; CP rank r keeps chunks r and
2*CP-1-r, in that order (causal load balance). Every tensor a schedule holds -- local queries,
a key/value block from another rank, a Ulysses-gathered sequence -- is a run of such chunks,
named here by their global chunk ids; the block plan says which (query chunks, key chunks)
pairs to compute, and which are diagonal (causal within the chunk). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass


def rank_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The global chunk ids CP rank ``cp_rank`` holds, in its local order."""
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def gathered_chunks(cp_ranks, cp_size: int) -> tuple:
    """Chunk ids of the concatenation of these ranks' local sequences (an all-gather / all-to-all)."""
    return tuple(chunk for rank in cp_ranks for chunk in rank_chunks(rank, cp_size))


@dataclass(frozen=True)
class Block:
    """Queries [q_start, q_stop) against keys [k_start, k_stop), both in chunk units of the local tensors."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    diagonal: bool


def plan_blocks(q_ids, k_ids, causal: bool) -> tuple:
    """The blocks of queries with chunk ids ``q_ids`` against keys with chunk ids ``k_ids``.

    Causal: key chunk j is fully visible to query chunk i when j < i, diagonal when j == i,
    skipped when j > i. Visible key chunks that sit next to each other locally form one block,
    and neighbouring query chunks with the same key range share one (fewer, larger matmuls).
    """
    per_query = []
    for a, q_id in enumerate(q_ids):
        full = [b for b, k_id in enumerate(k_ids) if not causal or k_id < q_id]
        for start, stop in _runs(full):
            per_query.append(Block(a, a + 1, start, stop, False))
        per_query.extend(Block(a, a + 1, b, b + 1, True)
                         for b, k_id in enumerate(k_ids) if causal and k_id == q_id)
    merged: list = []
    for block in sorted(per_query, key=lambda b: (b.diagonal, b.k_start, b.k_stop, b.q_start)):
        last = merged[-1] if merged else None
        if (last is not None and not block.diagonal and not last.diagonal and last.q_stop == block.q_start
                and (last.k_start, last.k_stop) == (block.k_start, block.k_stop)):
            merged[-1] = Block(last.q_start, block.q_stop, last.k_start, last.k_stop, False)
        else:
            merged.append(block)
    return tuple(merged)


def _runs(positions):
    """[0, 1, 3] -> [(0, 2), (3, 4)]"""
    runs = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1][1] = position + 1
        else:
            runs.append([position, position + 1])
    return [tuple(run) for run in runs]


def global_positions(chunk_ids, chunk_len: int) -> list:
    """Sequence position of every local row, for chunks of ``chunk_len`` rows (mask checks, tests)."""
    return [chunk * chunk_len + i for chunk in chunk_ids for i in range(chunk_len)]
