"""Which rows each piece moves (pure arithmetic, no torch collectives).

Megatron's ``alltoall`` dispatcher permutes this rank's tokens by global expert (expert ``e = r * L
+ j`` lives on EP rank ``r`` as local expert ``j``) and sends rank ``r`` the rows of its ``L``
experts in one all-to-all. A piece is (local expert ``j``, chunk ``c``): it sends every rank ``r``
chunk ``c`` of the rows for expert ``r * L + j`` and receives from every rank ``s`` chunk ``c`` of
the rows ``s`` sends to local expert ``j``. With one chunk, piece ``j``'s received rows are exactly
the rows (and the order) Megatron hands local expert ``j``; with more chunks an expert's rows are
cut into row blocks (Tutel's capacity chunks) and every row still meets the same weights.

Grouped experts (``GroupedMLP``: one grouped GEMM over all local experts) take a piece per chunk
``c`` instead: chunk ``c`` of EVERY local expert's rows, sent to rank ``r`` as its experts' chunks in
expert order, received rank-major (TP rank, EP rank, then local expert) and run as ONE call of the
experts with the piece's rows per expert; :attr:`Piece.blocks` says how to put them expert-major
(Megatron's ``sort_chunks_by_idxs`` order: local expert, then TP rank, then EP rank) and back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from coc_inject.pipeline.layout import chunk_bounds


@dataclass(frozen=True)
class Piece:
    expert: int | None  # local expert index; None: every local expert (grouped experts)
    chunk: int
    send_ranges: tuple  # (start, length) in the local permuted buffer per EP rank (and local expert), rank-major
    recv_splits: tuple  # rows from each EP rank
    tp_sizes: tuple  # rows each expert-TP rank received (its all-gather's parts); (n,) without expert TP
    blocks: tuple = ()  # grouped: rows per (TP rank, EP rank, local expert) as received, in that order

    @property
    def send_splits(self) -> list:
        per_rank = len(self.send_ranges) // len(self.recv_splits)  # ranges per EP rank: 1, or local experts
        lengths = [length for _, length in self.send_ranges]
        return [sum(lengths[r * per_rank:(r + 1) * per_rank]) for r in range(len(self.recv_splits))]

    def tokens_per_expert(self, local_experts: int) -> list:
        """Grouped: the piece's rows per local expert."""
        return [sum(self.blocks[j::local_experts]) for j in range(local_experts)]

    def expert_major(self, local_experts: int) -> list:
        """Grouped: the indices of :attr:`blocks` in expert-major order (local expert, TP rank, EP rank)."""
        return [b for j in range(local_experts) for b in range(j, len(self.blocks), local_experts)]


def pieces(local_counts: list, global_counts: list, local_experts: int, chunks: int, tp_rank: int = 0) -> list:
    """The pieces of one dispatch.

    ``local_counts[e]``: rows this rank sends to global expert ``e`` (its permuted buffer holds them
    in expert order); ``global_counts[t][s][j]``: rows EP rank ``s`` of expert-TP rank ``t`` sends
    to local expert ``j`` (Megatron's ``num_global_tokens_per_local_expert``); this rank is ``tp_rank``.
    An expert's input is its rows rank-major: TP rank, then EP rank, as Megatron's sort leaves them."""
    ep = len(global_counts[0])
    offsets = _offsets(local_counts)
    result = []
    for j in range(local_experts):
        sent = [_lengths(local_counts[r * local_experts + j], chunks) for r in range(ep)]
        received = [[_lengths(per_rank[s][j], chunks) for s in range(ep)] for per_rank in global_counts]
        for c in range(chunks):
            ranges = tuple((offsets[r * local_experts + j] + sent[r][c][0], sent[r][c][1]) for r in range(ep))
            tp_sizes = tuple(sum(bounds[s][c][1] for s in range(ep)) for bounds in received)
            result.append(Piece(j, c, ranges, tuple(received[tp_rank][s][c][1] for s in range(ep)), tp_sizes))
    return result


def _offsets(counts: list) -> list:
    """Where each expert's rows start in the permuted buffer (and the end)."""
    return [0, *itertools.accumulate(counts)]


def _lengths(rows: int, chunks: int) -> list[tuple[int, int]]:
    """(start, length) of exactly ``chunks`` row blocks of ``rows`` (empty ones too: every rank issues
    every piece)."""
    return [(start, stop - start) for start, stop in chunk_bounds(rows, chunks, every_chunk=True)]


def grouped_pieces(local_counts: list, global_counts: list, local_experts: int, chunks: int, tp_rank: int = 0) -> list:
    """The pieces of one dispatch for grouped experts: piece ``c`` is chunk ``c`` of every local
    expert's rows (arguments as :func:`pieces`)."""
    ep = len(global_counts[0])
    offsets = _offsets(local_counts)
    sent = [[_lengths(local_counts[r * local_experts + j], chunks) for j in range(local_experts)] for r in range(ep)]
    received = [[[_lengths(per_rank[s][j], chunks) for j in range(local_experts)] for s in range(ep)]
                for per_rank in global_counts]
    result = []
    for c in range(chunks):
        ranges = tuple((offsets[r * local_experts + j] + sent[r][j][c][0], sent[r][j][c][1])
                       for r in range(ep) for j in range(local_experts))
        blocks = tuple(received[t][s][j][c][1] for t in range(len(global_counts)) for s in range(ep)
                       for j in range(local_experts))
        per_tp = ep * local_experts
        tp_sizes = tuple(sum(blocks[t * per_tp:(t + 1) * per_tp]) for t in range(len(global_counts)))
        mine = blocks[tp_rank * per_tp:(tp_rank + 1) * per_tp]
        recv = tuple(sum(mine[s * local_experts:(s + 1) * local_experts]) for s in range(ep))
        result.append(Piece(None, c, ranges, recv, tp_sizes, blocks))
    return result
