"""The pieces' schedule: one autograd Function around the dispatch all-to-all, the local experts and
the combine all-to-all of one MoE layer.

Forward, for pieces 0..P-1 (program order, the same on every rank):
    dispatch(0); for p: wait dispatch(p); dispatch(p+1); expert(p); combine(p)
so piece p+1's dispatch and piece p's combine are in flight while piece p's expert computes.
Backward mirrors it in one node: the combine's backward all-to-all of piece p+1 is in flight while
piece p's expert runs its backward, and piece p's dispatch backward is in flight after it. All
collectives of a layer live in this one node, so autograd cannot order them differently on two
ranks. A piece with no rows on some rank still takes part in every collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from coc_inject.moe.layout import Piece


def _all_to_all(tensor: torch.Tensor, send: list, receive: list, group):
    """Start one all-to-all-v: (the output buffer, its work)."""
    out = tensor.new_empty((sum(receive),) + tuple(tensor.shape[1:]))
    work = dist.all_to_all_single(out, tensor.contiguous(), receive, send, group=group, async_op=True)
    return out, work


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
    expert: Callable  # (local expert, tokens, probs) -> output rows
    group: object  # the expert-parallel group
    needs_grad: bool
    accumulate: bool = True  # False in auto's trials: the backward leaves parameter gradients alone
    saved: list = None  # per piece: (tokens leaf, probs leaf, output) for the backward

    def send(self, buffers, piece: Piece, receive_splits: list):
        """Start the all-to-alls of ``buffers`` (rows of the local permuted order) for ``piece``."""
        return [_all_to_all(_gather_rows(b, piece), piece.send_splits, receive_splits, self.group) for b in buffers]

    def backward(self, output, grad_output, leaves) -> list:
        """The gradients of ``leaves`` (zeros where none flows)."""
        if self.accumulate:  # backward, not grad: the experts' parameter gradients accumulate as Megatron's
            torch.autograd.backward(output, grad_output)
            grads = [leaf.grad for leaf in leaves]
        else:
            grads = torch.autograd.grad(output, leaves, grad_output, allow_unused=True)
        return [torch.zeros_like(leaf) if grad is None else grad for leaf, grad in zip(leaves, grads)]

    @staticmethod
    def received(started) -> list:
        for _, work in started:
            work.wait()
        return [out for out, _ in started]


class PipelinedExperts(torch.autograd.Function):
    """tokens, probs (the dispatcher's permuted local rows) -> the combined expert outputs in the same order."""

    @staticmethod
    def forward(ctx, tokens, probs, run: PieceRun):
        pieces = run.pieces
        run.saved = []
        combines = []
        inflight = run.send((tokens, probs), pieces[0], list(pieces[0].recv_splits))
        for p, piece in enumerate(pieces):
            piece_tokens, piece_probs = run.received(inflight)
            if p + 1 < len(pieces):
                inflight = run.send((tokens, probs), pieces[p + 1], list(pieces[p + 1].recv_splits))
            with torch.enable_grad() if run.needs_grad else torch.no_grad():
                if run.needs_grad:  # leaves of the piece's own graph; the backward reads their .grad
                    piece_tokens = piece_tokens.requires_grad_()
                    piece_probs = piece_probs.requires_grad_()
                output = run.expert(piece.expert, piece_tokens, piece_probs)
            if run.needs_grad:
                run.saved.append((piece_tokens, piece_probs, output))
            combines.append(_all_to_all(output.detach(), list(piece.recv_splits), piece.send_splits, run.group))
        combined = tokens.new_empty((tokens.shape[0], combines[0][0].shape[-1]), dtype=combines[0][0].dtype)
        for piece, rows in zip(pieces, run.received(combines)):
            _scatter_rows(combined, piece, rows)
        ctx.run = run
        ctx.tokens_shape, ctx.tokens_dtype = tokens.shape, tokens.dtype
        ctx.probs_shape, ctx.probs_dtype = probs.shape, probs.dtype
        return combined

    @staticmethod
    def backward(ctx, grad_combined):
        run: PieceRun = ctx.run
        pieces, saved = run.pieces, run.saved
        run.saved = None
        grad_combined = grad_combined.contiguous()
        returns = []
        inflight = run.send((grad_combined,), pieces[0], list(pieces[0].recv_splits))
        for p, piece in enumerate(pieces):
            (grad_output,) = run.received(inflight)
            if p + 1 < len(pieces):
                inflight = run.send((grad_combined,), pieces[p + 1], list(pieces[p + 1].recv_splits))
            piece_tokens, piece_probs, output = saved[p]
            grads = run.backward(output, grad_output, (piece_tokens, piece_probs))
            returns.append([_all_to_all(g, list(piece.recv_splits), piece.send_splits, run.group) for g in grads])
        grad_tokens = grad_combined.new_empty(ctx.tokens_shape, dtype=ctx.tokens_dtype)
        grad_probs = grad_combined.new_empty(ctx.probs_shape, dtype=ctx.probs_dtype)
        for piece, started in zip(pieces, returns):
            rows_tokens, rows_probs = run.received(started)
            _scatter_rows(grad_tokens, piece, rows_tokens)
            _scatter_rows(grad_probs, piece, rows_probs)
        return grad_tokens, grad_probs, None
