"""Run a block plan (layout.plan_blocks) through a block kernel (coc_inject.attention_kernels):
forward into accumulators, backward into gradient buffers. The plan's chunk units become rows
here. No communication.

Tensors: queries ``[B, H, Sq, D]``, keys/values ``[B, G, Sk, D]`` (the kernels' shapes).
"""

from __future__ import annotations

from coc_inject.attention_kernels.merge import first_into, merge_into


def _rows(start: int, stop: int, chunk_len: int) -> slice:
    return slice(start * chunk_len, stop * chunk_len)


def forward(kernel, plan, q, k, v, chunk_len: int, scale: float, acc_out, acc_lse, touched=None) -> None:
    """Attend ``q`` to ``k``/``v`` block by block, merging into acc_out/acc_lse (fp32). ``touched``
    (a set of query chunk indices, kept by the caller across calls) lets a block whose rows no
    block has reached yet be copied in rather than merged."""
    for block in plan:
        rows = _rows(block.q_start, block.q_stop, chunk_len)
        cols = _rows(block.k_start, block.k_stop, chunk_len)
        out, lse = kernel.forward(q[..., rows, :], k[..., cols, :], v[..., cols, :], scale, block.diagonal)
        chunks = range(block.q_start, block.q_stop)
        fold = first_into if touched is not None and touched.isdisjoint(chunks) else merge_into
        fold(acc_out[..., rows, :], acc_lse[..., rows], out, lse)
        if touched is not None:
            touched.update(chunks)


def backward(kernel, plan, q, k, v, dout, out, lse, chunk_len: int, scale: float, dq, dk, dv) -> None:
    """Add the plan's gradients into dq and dk/dv (fp32 buffers); ``out``/``lse`` are the final ones."""
    for block in plan:
        rows = _rows(block.q_start, block.q_stop, chunk_len)
        cols = _rows(block.k_start, block.k_stop, chunk_len)
        dq_block, dk_block, dv_block = kernel.backward(
            dout[..., rows, :], q[..., rows, :], k[..., cols, :], v[..., cols, :], out[..., rows, :], lse[..., rows],
            scale, block.diagonal)
        dq[..., rows, :] += dq_block
        dk[..., cols, :] += dk_block
        dv[..., cols, :] += dv_block
