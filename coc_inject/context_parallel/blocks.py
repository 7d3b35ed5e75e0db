"""Run a block plan (layout.plan_blocks) through the kernel: forward into accumulators, backward
into gradient buffers. Tensors are in the kernel's shapes; the plan's chunk units become rows
here. No communication."""

from __future__ import annotations

from coc_inject.context_parallel import kernel


def _rows(start: int, stop: int, chunk_len: int) -> slice:
    return slice(start * chunk_len, stop * chunk_len)


def forward(plan, q, k, v, chunk_len: int, scale: float, acc_out, acc_lse) -> None:
    """Attend ``q`` [B,G,R,Sq,D] to ``k``/``v`` [B,G,Sk,D] block by block, merging into acc_out/acc_lse."""
    for block in plan:
        rows = _rows(block.q_start, block.q_stop, chunk_len)
        cols = _rows(block.k_start, block.k_stop, chunk_len)
        out, lse = kernel.block_forward(q[..., rows, :], k[..., cols, :], v[..., cols, :], scale, block.diagonal)
        kernel.merge_into(acc_out[..., rows, :], acc_lse[..., rows], out, lse)


def backward(plan, q, k, v, dout, lse, delta, chunk_len: int, scale: float, dq, dk, dv) -> None:
    """Add the plan's gradients into dq [B,G,R,Sq,D] and dk/dv [B,G,Sk,D] (fp32 buffers)."""
    for block in plan:
        rows = _rows(block.q_start, block.q_stop, chunk_len)
        cols = _rows(block.k_start, block.k_stop, chunk_len)
        dq_block, dk_block, dv_block = kernel.block_backward(
            q[..., rows, :], k[..., cols, :], v[..., cols, :], dout[..., rows, :], lse[..., rows],
            delta[..., rows], scale, block.diagonal)
        dq[..., rows, :] += dq_block
        dk[..., cols, :] += dk_block
        dv[..., cols, :] += dv_block
