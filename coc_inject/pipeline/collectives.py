"""Asynchronous collectives on one process group: one function per collective.

Every function starts the collective and returns a handle with ``wait()``. They look the
torch.distributed functions up at call time (not at import) so a caller's instrumentation of
``torch.distributed`` -- a profiler, a call counter in a test -- sees our calls too; the engines
look ``all_reduce_async`` up here at call time, so :func:`all_reduce_replaced` reaches them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def all_reduce_async(tensor: torch.Tensor, group):
    """Sum ``tensor`` in place across ``group``."""
    return dist.all_reduce(tensor, group=group, async_op=True)


@contextlib.contextmanager
def all_reduce_replaced(replacement):
    """Inside, :func:`all_reduce_async` is ``replacement`` for every caller (the bench's stub that
    launches nothing, to time the engine's own host work); the previous one comes back on the way
    out, also after an error."""
    global all_reduce_async
    before, all_reduce_async = all_reduce_async, replacement
    try:
        yield
    finally:
        all_reduce_async = before


def all_gather_async(rank_slots: list[torch.Tensor], local: torch.Tensor, group):
    """Gather ``local`` from every rank r into ``rank_slots[r]``.

    The slots may be separate views of one larger tensor (the strided ``[TP, B, ...][:, i]``
    chunk layout): each slot is contiguous, so nothing is copied into place afterwards.
    """
    return dist.all_gather(rank_slots, local, group=group, async_op=True)


def all_gather_into_tensor_async(output: torch.Tensor, local: torch.Tensor, group):
    """Gather ``local`` from every rank into the contiguous ``output`` (rank-major on dim 0)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, local, group=group, async_op=True)


def reduce_scatter_async(output: torch.Tensor, stacked: torch.Tensor, group):
    """Sum ``stacked`` (rank-major on dim 0) across ``group``; rank r keeps slice r in ``output``."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, stacked, group=group, async_op=True)


def wait_all(handles) -> None:
    for handle in handles:
        if handle is not None:
            handle.wait()
