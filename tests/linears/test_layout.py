"""Pure chunk-layout arithmetic: no torch, no processes."""

import pytest

from coc_inject.pipeline.layout import (
    chunk_bounds,
    effective_chunks,
    rank_block_rows,
    sequence_parallel_chunk_rows,
)


@pytest.mark.parametrize("length", [0, 1, 2, 3, 7, 8, 9, 64, 100, 1023])
@pytest.mark.parametrize("requested", [1, 2, 3, 4, 8, 16])
def test_chunk_bounds_cover_every_row_once_in_order(length, requested):
    bounds = chunk_bounds(length, requested)
    rows = [row for start, stop in bounds for row in range(start, stop)]
    assert rows == list(range(length))
    assert len(bounds) == effective_chunks(length, requested)
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # tensor_split order: larger chunks first
    if length:
        assert min(sizes) >= 1


def test_chunk_bounds_match_torch_tensor_split():
    torch = pytest.importorskip("torch")
    for length in (5, 10, 13, 64):
        for requested in (2, 3, 4, 8):
            pieces = torch.arange(length).tensor_split(effective_chunks(length, requested))
            assert [(int(p[0]), int(p[-1]) + 1) for p in pieces] == chunk_bounds(length, requested)


def test_uneven_tail_is_not_dropped():
    # The bug this guards against: m // n sized chunks silently drop the last m % n rows.
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_more_chunks_than_rows_collapses_to_one_row_each():
    assert effective_chunks(3, 8) == 3
    assert chunk_bounds(3, 8) == [(0, 1), (1, 2), (2, 3)]


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="chunk count"):
        chunk_bounds(4, 0)
    with pytest.raises(ValueError, match="not divisible"):
        rank_block_rows(10, 4)


@pytest.mark.parametrize("m,tp,requested", [(8, 2, 2), (12, 2, 4), (24, 4, 3), (20, 4, 8), (6, 2, 8)])
def test_sequence_parallel_chunks_partition_rows_and_map_into_own_shard(m, tp, requested):
    block = rank_block_rows(m, tp)
    chunks = sequence_parallel_chunk_rows(m, tp, requested)
    assert sorted(row for chunk in chunks for row in chunk) == list(range(m))
    for (start, stop), rows in zip(chunk_bounds(block, requested), chunks):
        for rank in range(tp):
            # A reduce-scatter of this chunk hands rank r the rows it owns, in shard order.
            owned = [row for row in rows if rank * block <= row < (rank + 1) * block]
            assert [row - rank * block for row in owned] == list(range(start, stop))
