"""The row counts a call's pieces are cut by, taken to the host by Megatron's own device-to-host copy.

Megatron's alltoall dispatcher computes its split counts on the device in ``preprocess`` and copies
them to the host at one point of its call (``cuda_dtoh_point``), synchronising once
(``cuda_sync_point``). The pieces need two counts Megatron does not keep on the host: the rows this
rank sends each global expert, and (one local expert with expert TP) the rows every TP x EP rank
sends this rank's expert. :func:`riding` appends them, still on the device, to the
``tokens_per_expert`` that ``preprocess`` returns: Megatron's copy moves them with its own counts,
and :func:`split` reads them on the host after Megatron's synchronisation, adding no sync point.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coc_inject.moe import layout


def riding(dispatcher, routing_map: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """``tokens_per_expert`` (Megatron's, [local experts]) followed by the rows this rank sends each
    global expert and the rows each (TP, EP) rank sends each local expert, on the routing map's device."""
    sent = routing_map.sum(dim=0).long()  # what Megatron's preprocess sums too; a kernel, no sync
    parts = [tokens_per_expert.to(sent.device, sent.dtype).flatten(), sent, _received(dispatcher, sent).flatten()]
    return torch.cat(parts)


def _received(dispatcher, sent: torch.Tensor) -> torch.Tensor:
    """[tp * ep, local]: rows each (TP, EP) rank sends each local expert, from what Megatron's
    ``preprocess`` left on the dispatcher (still on the device)."""
    if dispatcher.num_local_experts > 1:  # Megatron keeps [tp * ep, local]
        return dispatcher.num_global_tokens_per_local_expert
    if dispatcher.tp_size == 1:  # one local expert: what each EP rank sends it
        return dispatcher.output_splits
    # One local expert with expert TP: Megatron keeps only its own TP rank's row; the same small
    # all-gather over the TP x EP group as its preprocess, on the counts' device.
    group = dispatcher.tp_ep_group
    everyone = sent.new_empty(group.size() * sent.numel())
    dist.all_gather_into_tensor(everyone, sent, group=group)
    # Megatron's order of the TP x EP group is EP-major: [ep, tp, experts]
    by_rank = everyone.reshape(dispatcher.ep_size, dispatcher.tp_size, -1).transpose(0, 1)
    return by_rank[:, :, dispatcher.local_expert_indices[0]]


def split(dispatcher, host: torch.Tensor) -> tuple:
    """(Megatron's tokens_per_expert, rows sent per global expert, rows received per (TP, EP) rank and
    local expert) from :func:`riding`'s tensor after Megatron's device-to-host copy and sync."""
    local, experts = dispatcher.num_local_experts, dispatcher.config.num_moe_experts
    values = host.tolist()  # on the host already: Megatron copied and synchronised it
    return host[:local], values[local:local + experts], values[local + experts:]


def piece_layout(dispatcher, chunks: int, sent: list, received: list, grouped: bool = False) -> list:
    """The pieces of the dispatcher's current call at ``chunks`` per local expert (``grouped``: a piece
    per chunk of every local expert's rows, layout.grouped_pieces)."""
    ep, tp, local = dispatcher.ep_size, dispatcher.tp_size, dispatcher.num_local_experts
    if len(sent) != dispatcher.config.num_moe_experts or len(received) != tp * ep * local:
        raise RuntimeError(f"MoE overlap: the dispatcher's counts have {len(sent)} experts and {len(received)} "
                           f"(TP x EP rank, local expert) entries; expected {dispatcher.config.num_moe_experts} "
                           f"and {tp * ep * local}")
    per_rank = [received[r * local:(r + 1) * local] for r in range(tp * ep)]
    global_counts = [per_rank[t * ep:(t + 1) * ep] for t in range(tp)]
    cut = layout.grouped_pieces if grouped else layout.pieces
    return cut(sent, global_counts, local, chunks, dispatcher.tp_rank)
