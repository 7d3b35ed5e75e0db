"""The transfers of the context-parallel schedules: batched point-to-point exchanges on a ring,
all-to-all over heads, all-gather / reduce-scatter of key/value blocks.

Every function starts its transfer and returns something with ``wait()``. The schedules call
them from inside ONE autograd Function per attention call, in the same order on every rank:
same-shaped transfers of two separate autograd nodes could otherwise pair up in a different
order on different ranks in backward -- wrong gradients, no error.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coc_inject.pipeline import collectives


class _Pending:
    def __init__(self, works):
        self.works = works or []

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def exchange(group, sends, recvs) -> _Pending:
    """Batched P2P: ``sends`` and ``recvs`` are lists of (tensor, peer global rank); all start together.

    Batching (rather than separate isend/irecv) is what keeps NCCL/HCCL rings from deadlocking.
    """
    ops = [dist.P2POp(dist.isend, tensor, peer, group) for tensor, peer in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group) for tensor, peer in recvs]
    return _Pending(dist.batch_isend_irecv(ops) if ops else [])


def all_to_all(output: torch.Tensor, stacked: torch.Tensor, group):
    """Rank-major ``stacked[j]`` goes to rank j; ``output[j]`` comes from rank j (dim 0 = group size)."""
    return dist.all_to_all_single(output, stacked, group=group, async_op=True)


def all_gather(output: torch.Tensor, local: torch.Tensor, group):
    """``output[j]`` = rank j's ``local`` (dim 0 = group size)."""
    return collectives.all_gather_into_tensor_async(output.view(-1, *local.shape[1:]), local, group)


def reduce_scatter(output: torch.Tensor, stacked: torch.Tensor, group):
    """``output`` = sum over ranks of their ``stacked[my rank]``."""
    return collectives.reduce_scatter_async(output, stacked.view(-1, *output.shape[1:]), group)
