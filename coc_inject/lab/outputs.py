"""What a lab collective writes: outputs as if every rank held this rank's data, so that a wing that
splits or reorders collectives computes the same function as Megatron's path.

* all-gather: this rank's input tiled N times; all-reduce: SUM is N times, AVG / MAX / MIN leave it;
  reduce-scatter: N times this rank's slice; broadcast: as it is.
* all-to-all: a peer k sends this rank what this rank sends k, so the output is the input, and the
  splits must agree (``output_splits[k] == input_splits[k]``). For the MoE dispatcher's splits to
  agree, the token counts it all-gathers (an integer all-gather) follow the same rule: peer k's
  counts are this rank's with the blocks of k and of this rank swapped.
* point-to-point: a receive from the rank d places back gets what this rank sends d places ahead.
"""

from __future__ import annotations

import torch.distributed as dist


# Outputs are written detached (a collective's writes are not autograd's to track, as with NCCL's kernels).


def all_reduce(tensor, op, ranks: int) -> None:
    tensor, op = tensor.detach(), getattr(op, "op", op)  # a ReduceOp object, or its RedOpType
    if op == dist.ReduceOp.SUM:
        tensor.mul_(ranks)
    elif op == dist.ReduceOp.PRODUCT:
        tensor.pow_(ranks)
    elif op not in (dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.BAND, dist.ReduceOp.BOR):
        raise ValueError(f"the lab's all-reduce: op {op} is not one of SUM, PRODUCT, AVG, MAX, MIN, BAND, BOR")


def _peer_view(flat, peer: int, rank: int, ranks: int):
    """Peer ``peer``'s data: this rank's, with an integer vector's blocks of peer and rank swapped."""
    if flat.is_floating_point() or peer == rank or flat.numel() % ranks:
        return flat
    blocks = flat.view(ranks, -1).clone()
    blocks[[peer, rank]] = blocks[[rank, peer]]
    return blocks.view(-1)


def all_gather(output, input, rank: int, ranks: int) -> None:
    flat, rows = input.detach().reshape(-1), output.detach().view(ranks, -1)
    for peer in range(ranks):
        rows[peer].copy_(_peer_view(flat, peer, rank, ranks))


def all_gather_list(outputs, input, rank: int, ranks: int) -> None:
    flat = input.detach().reshape(-1)
    for peer, out in enumerate(outputs):
        out.detach().view(-1).copy_(_peer_view(flat, peer, rank, ranks))


def reduce_scatter(output, input, op, rank: int, ranks: int) -> None:
    output = output.detach()
    output.view(-1).copy_(input.detach().reshape(ranks, -1)[rank])
    if getattr(op, "op", op) != dist.ReduceOp.AVG:
        all_reduce(output, op, ranks)


def check_splits(output, input, output_splits, input_splits, ranks: int) -> None:
    out = list(output_splits) if output_splits else [output.shape[0] // ranks] * ranks
    inp = list(input_splits) if input_splits else [input.shape[0] // ranks] * ranks
    if out != inp or output.shape != input.shape:
        raise ValueError(f"the lab's all-to-all: output splits {out} differ from input splits {inp} (shapes "
                         f"{tuple(output.shape)}, {tuple(input.shape)}): a peer k sends this rank what this rank "
                         "sends k, so they must agree (splits from counts gathered over another group than the "
                         "lab's rule covers: expert tensor parallelism above 1?)")


def all_to_all(output, input) -> None:
    output.detach().copy_(input.detach())


def received(recv, sent) -> None:
    recv.detach().copy_(sent.detach())


def tensor_bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()

