"""The pieces' schedule: one autograd Function around the dispatch all-to-all, the local experts and
the combine all-to-all of one MoE layer (with expert tensor parallelism, the all-gather after the
dispatch and the reduce-scatter before the combine: each piece's movements are a transfers.Chain).

Forward, for pieces 0..P-1 (program order, the same on every rank):
    start dispatch(0)
    for p: finish dispatch(p); start dispatch(p+1); expert(p); advance dispatch(p+1);
           start combine(p); advance combine(p-1)
    finish every combine
so piece p+1's dispatch and piece p's combine are in flight while piece p's expert computes.
Backward mirrors it in the same node: the combine's backward movements of piece p+1 are in flight
while piece p's expert runs its backward, then piece p's dispatch backward. Every collective of a
layer is issued by this one node, so autograd cannot order them differently on two ranks. A piece
with no rows on some rank still takes part in every collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from coc_inject.moe.gradient_sums import GradientSums
from coc_inject.moe.layout import Piece
from coc_inject.moe.transfers import AllGatherRows, AllToAll, Chain, ReduceScatterRows


def _gather_rows(buffer: torch.Tensor, piece: Piece) -> torch.Tensor:
    return torch.cat([buffer.narrow(0, start, length) for start, length in piece.send_ranges])


def _scatter_rows(buffer: torch.Tensor, piece: Piece, rows: torch.Tensor) -> None:
    offset = 0
    for start, length in piece.send_ranges:
        buffer.narrow(0, start, length).copy_(rows.narrow(0, offset, length))
        offset += length


@dataclass
class PieceRun:
    """One layer call's pieces: what the Function needs besides the tensors."""

    pieces: list  # layout.Piece, in schedule order
    expert: Callable  # (piece, tokens, probs) -> output rows: its local expert's, or the grouped experts'
    ep_group: object
    tp_group: object  # the expert tensor-parallel group; None without expert TP
    combine_dtype: torch.dtype  # Megatron reduce-scatters the experts' output in the probs' dtype
    needs_grad: bool
    reaches: list = None  # per piece: the indices of the parameters it can reach, None: all (gradient_sums.py)
    saved: list = None  # per piece: (tokens leaf, probs leaf, output) for the backward

    def to_experts(self, piece: Piece, via=None) -> list:
        """Local rows to the expert's ranks: the dispatch (and the combine's backward)."""
        moves = [AllToAll(piece.send_splits, list(piece.recv_splits), self.ep_group)]
        return moves + ([AllGatherRows(list(piece.tp_sizes), self.tp_group, via)] if self.tp_group else [])

    def from_experts(self, piece: Piece, via=None) -> list:
        """Expert rows back to where they came from: the combine (and the dispatch's backward)."""
        moves = [ReduceScatterRows(list(piece.tp_sizes), self.tp_group, via)] if self.tp_group else []
        return moves + [AllToAll(list(piece.recv_splits), piece.send_splits, self.ep_group)]

    def backward(self, output, grad_output, leaves, params, sums: GradientSums, piece: int) -> list:
        """The gradients of ``leaves`` (zeros where none flows); the parameters' added into ``sums``.

        ``grad``, never ``backward``: no AccumulateGrad runs per piece. Megatron's experts give each
        parameter one gradient per layer call, and its DDP hook fires once: megatron-core 0.12 to 0.15
        assert it ("Cannot set grad twice" under overlap_grad_reduce), 0.16+ count the calls."""
        reached = [params[index] for index in sums.reaches[piece]]
        grads = list(torch.autograd.grad(output, list(leaves) + reached, grad_output, allow_unused=True))
        leaf_grads, param_grads = grads[:len(leaves)], grads[len(leaves):]
        del grads  # each parameter's share freed as soon as it is summed
        sums.add(piece, param_grads)
        return [torch.zeros_like(leaf) if grad is None else grad for leaf, grad in zip(leaves, leaf_grads)]


class PipelinedExperts(torch.autograd.Function):
    """tokens, probs (the dispatcher's permuted local rows) -> the combined expert outputs in the same order."""

    @staticmethod
    def forward(ctx, tokens, probs, run: PieceRun, *params):
        """``params``: the experts' trainable parameters (the backward returns their summed gradients)."""
        pieces = run.pieces
        run.saved = []

        def dispatch(p):
            return Chain(run.to_experts(pieces[p]), [_gather_rows(tokens, pieces[p]), _gather_rows(probs, pieces[p])])

        inflight, combines = dispatch(0), []
        for p, piece in enumerate(pieces):
            piece_tokens, piece_probs = inflight.finish()
            if p + 1 < len(pieces):
                inflight = dispatch(p + 1)
            with torch.enable_grad() if run.needs_grad else torch.no_grad():
                if run.needs_grad:  # leaves of the piece's own graph; the backward reads their .grad
                    piece_tokens.requires_grad_()
                    piece_probs.requires_grad_()
                output = run.expert(piece, piece_tokens, piece_probs)
            if run.needs_grad:
                run.saved.append((piece_tokens, piece_probs, output))
            if p + 1 < len(pieces):
                inflight.advance()
            combines.append(Chain(run.from_experts(piece, run.combine_dtype), [output.detach()]))
            if p:
                combines[p - 1].advance()
        rows = [chain.finish()[0] for chain in combines]
        combined = tokens.new_empty((tokens.shape[0], rows[0].shape[-1]), dtype=rows[0].dtype)
        for piece, piece_rows in zip(pieces, rows):
            _scatter_rows(combined, piece, piece_rows)
        ctx.run, ctx.params = run, params
        ctx.tokens_shape, ctx.tokens_dtype = tokens.shape, tokens.dtype
        ctx.probs_shape, ctx.probs_dtype = probs.shape, probs.dtype
        return combined

    @staticmethod
    def backward(ctx, grad_combined):
        run: PieceRun = ctx.run
        pieces, saved = run.pieces, run.saved
        run.saved = None
        grad_combined = grad_combined.contiguous()

        def combine_backward(p):
            return Chain(run.to_experts(pieces[p], run.combine_dtype), [_gather_rows(grad_combined, pieces[p])])

        sums = GradientSums(ctx.params, run.reaches or [None] * len(pieces))
        inflight, returns = combine_backward(0), []
        for p, piece in enumerate(pieces):
            (grad_output,) = inflight.finish()
            if p + 1 < len(pieces):
                inflight = combine_backward(p + 1)
            piece_tokens, piece_probs, output = saved[p]
            grads = run.backward(output, grad_output.to(output.dtype), (piece_tokens, piece_probs), ctx.params, sums, p)
            saved[p] = None  # this piece's leaves and output: freed before the next piece's backward
            if p + 1 < len(pieces):
                inflight.advance()
            returns.append(Chain(run.from_experts(piece), grads))
            if p:
                returns[p - 1].advance()
        grad_tokens = grad_combined.new_empty(ctx.tokens_shape, dtype=ctx.tokens_dtype)
        grad_probs = grad_combined.new_empty(ctx.probs_shape, dtype=ctx.probs_dtype)
        for piece, chain in zip(pieces, returns):
            rows_tokens, rows_probs = chain.finish()
            _scatter_rows(grad_tokens, piece, rows_tokens)
            _scatter_rows(grad_probs, piece, rows_probs)
        ctx.params = None
        return (grad_tokens, grad_probs, None, *sums.results())
