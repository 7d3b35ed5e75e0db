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


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """(start, length) of ``chunks`` row blocks covering ``rows``; lengths differ by at most one."""
    base, extra = divmod(rows, chunks)
    bounds, start = [], 0
    for c in range(chunks):
        length = base + (1 if c < extra else 0)
        bounds.append((start, length))
        start += length
    return bounds


@dataclass(frozen=True)
class Piece:
    expert: int  # local expert index
    chunk: int
    send_ranges: tuple  # (start, length) in the local permuted buffer per EP rank, rank-major
    recv_splits: tuple  # rows from each EP rank (the expert's input, rank-major)

    @property
    def send_splits(self) -> list:
        return [length for _, length in self.send_ranges]


def pieces(local_counts: list, global_counts: list, ep: int, local_experts: int, chunks: int) -> list[Piece]:
    """The pieces of one dispatch.

    ``local_counts[e]``: rows this rank sends to global expert ``e`` (its permuted buffer holds them
    in expert order); ``global_counts[s][j]``: rows EP rank ``s`` sends to this rank's local expert
    ``j`` (Megatron's ``num_global_tokens_per_local_expert``)."""
    offsets = [0]
    for count in local_counts:
        offsets.append(offsets[-1] + count)
    result = []
    for j in range(local_experts):
        sent = [chunk_bounds(local_counts[r * local_experts + j], chunks) for r in range(ep)]
        received = [chunk_bounds(global_counts[s][j], chunks) for s in range(ep)]
        for c in range(chunks):
            ranges = tuple((offsets[r * local_experts + j] + sent[r][c][0], sent[r][c][1]) for r in range(ep))
            result.append(Piece(j, c, ranges, tuple(received[s][c][1] for s in range(ep))))
    return result
