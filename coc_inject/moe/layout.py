"""Which rows each piece moves (pure arithmetic, no torch collectives).

Megatron's ``alltoall`` dispatcher permutes this rank's tokens by global expert (expert ``e = r * L
+ j`` lives on EP rank ``r`` as local expert ``j``) and sends rank ``r`` the rows of its ``L``
experts in one all-to-all. A piece is (local expert ``j``, chunk ``c``): it sends every rank ``r``
chunk ``c`` of the rows for expert ``r * L + j`` and receives from every rank ``s`` chunk ``c`` of
the rows ``s`` sends to local expert ``j``. With one chunk, piece ``j``'s received rows are exactly
the rows (and the order) Megatron hands local expert ``j``; with more chunks an expert's rows are
cut into row blocks (Tutel's capacity chunks) and every row still meets the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from coc_inject.pipeline.layout import chunk_bounds


@dataclass(frozen=True)
class Piece:
    expert: int  # local expert index
    chunk: int
    send_ranges: tuple  # (start, length) in the local permuted buffer per EP rank, rank-major
    recv_splits: tuple  # rows from each EP rank
    tp_sizes: tuple  # rows each expert-TP rank received (its all-gather's parts); (n,) without expert TP

    @property
    def send_splits(self) -> list:
        return [length for _, length in self.send_ranges]


def pieces(local_counts: list, global_counts: list, local_experts: int, chunks: int, tp_rank: int = 0) -> list:
    """The pieces of one dispatch.

    ``local_counts[e]``: rows this rank sends to global expert ``e`` (its permuted buffer holds them
    in expert order); ``global_counts[t][s][j]``: rows EP rank ``s`` of expert-TP rank ``t`` sends
    to local expert ``j`` (Megatron's ``num_global_tokens_per_local_expert``); this rank is ``tp_rank``.
    An expert's input is its rows rank-major: TP rank, then EP rank, as Megatron's sort leaves them."""
    ep = len(global_counts[0])
    offsets = [0]
    for count in local_counts:
        offsets.append(offsets[-1] + count)
    result = []
    for j in range(local_experts):
        sent = [_lengths(local_counts[r * local_experts + j], chunks) for r in range(ep)]
        received = [[_lengths(per_rank[s][j], chunks) for s in range(ep)] for per_rank in global_counts]
        for c in range(chunks):
            ranges = tuple((offsets[r * local_experts + j] + sent[r][c][0], sent[r][c][1]) for r in range(ep))
            tp_sizes = tuple(sum(bounds[s][c][1] for s in range(ep)) for bounds in received)
            result.append(Piece(j, c, ranges, tuple(received[tp_rank][s][c][1] for s in range(ep)), tp_sizes))
    return result


def _lengths(rows: int, chunks: int) -> list[tuple[int, int]]:
    """(start, length) of exactly ``chunks`` row blocks of ``rows`` (empty ones too: every rank issues
    every piece)."""
    return [(start, stop - start) for start, stop in chunk_bounds(rows, chunks, every_chunk=True)]
