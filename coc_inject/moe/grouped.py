"""A piece on grouped experts: one call of Megatron's own grouped-experts forward (``GroupedMLP``: one
grouped GEMM per linear for all local experts; ``TEGroupedMLP``: one TE grouped linear per linear) on the
piece's rows, put in the order Megatron hands it.

A grouped piece (layout.grouped_pieces) receives chunk ``c`` of every local expert's rows rank-major
(TP rank, EP rank, local expert); Megatron's dispatcher gives the experts their rows expert-major
(``sort_chunks_by_idxs``: local expert, then TP rank, then EP rank) with the rows per expert. The
piece's rows are put in that order, run through the experts' forward as Megatron wrote it (probabilities
as each release passes them: ``permuted_probs``, ``moe_apply_probs_on_input`` inside that forward), and
the output put back in the received order, all inside autograd: the piece's backward is that forward's.
Splits and concatenations of the host's row counts only, no index tensor and no device read; the rows
per expert go to the experts as an int64 tensor on the host, as the ``grouped_gemm`` kernel takes them
(and Megatron's dispatcher hands them after its own device-to-host copy).
"""

from __future__ import annotations

import torch

# The experts classes whose forward takes (rows expert-major, rows per local expert, probs) and runs all
# local experts in one call: the pieces call it once per piece (guards.EXPERTS lists them beside SequentialMLP).
# TEGroupedMLP by that interface: its grouped linears are Transformer Engine's, run here only as stand-ins.
CLASSES = ("GroupedMLP", "TEGroupedMLP")


def is_grouped(experts) -> bool:
    return type(experts).__name__ in CLASSES


def megatron_forward(patches, experts):
    """The experts' forward as Megatron wrote it (the class's own, before any patch of this job's)."""
    for cls in type(experts).__mro__:
        if "forward" in vars(cls):
            return patches.original(cls, "forward")
    raise AttributeError(f"{type(experts).__name__} has no forward")


def _reorder(rows: torch.Tensor, sizes: list, order: list) -> torch.Tensor:
    parts = torch.split(rows, sizes)
    return torch.cat([parts[index] for index in order])


def expert(experts, forward):
    """``(piece, rows, probs) -> output rows`` (in the piece's received order) for PieceRun."""
    local = experts.num_local_experts

    def run(piece, rows, probs):
        sizes = list(piece.blocks)
        order = piece.expert_major(local)
        identity = order == sorted(order)
        if not identity:
            rows, probs = _reorder(rows, sizes, order), _reorder(probs, sizes, order)
        tokens_per_expert = torch.tensor(piece.tokens_per_expert(local), dtype=torch.int64, device="cpu")  # as gmm takes it
        output, bias = forward(experts, rows.contiguous(), tokens_per_expert, probs.contiguous())
        if bias is not None:
            raise RuntimeError(f"MoE overlap: {type(experts).__name__} returned a bias (Megatron's alltoall "
                               "dispatcher asserts none)")
        if identity:
            return output
        position = {block: index for index, block in enumerate(order)}
        return _reorder(output, [sizes[block] for block in order], [position[b] for b in range(len(sizes))])

    return run
