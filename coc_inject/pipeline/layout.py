"""Chunk-layout arithmetic. Pure functions of ints: no torch, no processes.

Megatron activations are ``[s, b, h]``; CoC flattens them to ``[m, k]`` with ``m = s*b`` and
splits the m rows into chunks.

* Without sequence parallelism a chunk is a contiguous row range of ``[m, ...]``.
* With sequence parallelism a reduce-scatter / all-gather on dim 0 gives rank r the
  contiguous block ``[r*B, (r+1)*B)`` with ``B = m / TP``. A chunk must therefore take the
  same sub-range of *every* rank's block: view the full tensor as ``[TP, B, ...]`` and
  chunk i is the strided view ``[:, start_i:stop_i]``. Its reduce-scatter lands exactly in
  rows ``[start_i, stop_i)`` of this rank's shard, and gathering those rows from every rank
  fills exactly that view -- no whole-tensor permutes, no extra full copies.

Chunks may be uneven (sizes as ``torch.tensor_split``: the first ``length % n`` chunks get one
extra row), so any m works and no row is ever left unwritten.
"""

from __future__ import annotations


def effective_chunks(length: int, requested: int) -> int:
    """How many non-empty chunks ``length`` rows can be split into (never more than rows)."""
    if requested < 1:
        raise ValueError(f"chunk count must be >= 1, got {requested}")
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    return max(1, min(requested, length))


def chunk_bounds(length: int, requested: int, *, every_chunk: bool = False) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` ranges covering ``[0, length)`` exactly once, in order.

    Sizes follow ``torch.tensor_split``: they differ by at most one, larger ones first. With
    ``every_chunk`` there are exactly ``requested`` ranges, empty ones included (a piece that every
    rank must issue whatever its row count, as the MoE pieces' collectives); else never more ranges
    than rows.
    """
    count = requested if every_chunk and requested >= 1 else effective_chunks(length, requested)
    base, extra = divmod(length, count)
    bounds = []
    start = 0
    for index in range(count):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def rank_block_rows(m: int, tp_size: int) -> int:
    """Rows each rank owns under sequence parallelism (``B = m / TP``); m must divide."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if m % tp_size:
        raise ValueError(
            f"sequence-parallel rows m={m} are not divisible by the tensor-parallel size {tp_size}"
        )
    return m // tp_size


def sequence_parallel_chunk_rows(m: int, tp_size: int, requested: int) -> list[list[int]]:
    """Global row indices (of the full ``[m, ...]`` tensor) that chunk i covers under SP.

    Reference arithmetic for the strided ``[TP, B, ...][:, start:stop]`` views the pipeline
    uses; tests check that the chunks partition ``range(m)`` and that chunk i's rows on rank
    r are rows ``[start, stop)`` of rank r's shard.
    """
    block = rank_block_rows(m, tp_size)
    return [
        [rank * block + row for rank in range(tp_size) for row in range(start, stop)]
        for start, stop in chunk_bounds(block, requested)
    ]
