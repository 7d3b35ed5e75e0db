"""Run a block plan (layout.plan_blocks) through a block kernel (coc_inject.attention_kernels):
forward into accumulators, backward into gradient buffers. The plan's chunk units become rows
here. No communication.

Tensors: queries ``[B, H, Sq, D]``, keys/values ``[B, G, Sk, D]`` (the kernels' shapes).
"""

from __future__ import annotations

import torch

from coc_inject.attention_kernels.merge import first_into, merge_into, new_accumulators
from coc_inject.context_parallel import layout


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


def forward_parts(kernel, q, q_ids, parts, causal: bool, chunk_len: int, scale: float):
    """Attention of ``q`` (chunks ``q_ids``) over key/value parts held apart, ``parts``: (k, v, chunk
    ids) each, in any order -> (out fp32, lse fp32). The one attention over parts: a ring's steps
    (ring.py) and the sequence copies' earlier copies and own (multi_copy/meeting.py) run these plans."""
    acc_out, acc_lse = new_accumulators(q)
    touched: set = set()
    for k, v, k_ids in parts:
        forward(kernel, layout.plan_blocks(tuple(q_ids), tuple(k_ids), causal), q, k, v, chunk_len, scale, acc_out,
                acc_lse, touched)
    return acc_out, acc_lse


def backward_parts(kernel, q, q_ids, parts, dout, out, lse, causal: bool, chunk_len: int, scale: float):
    """(dq, [(dk, dv) per part]) of :func:`forward_parts`, every gradient accumulated in fp32 (a bf16 sum
    over key blocks would round at each one)."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads = []
    for k, v, k_ids in parts:
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        backward(kernel, layout.plan_blocks(tuple(q_ids), tuple(k_ids), causal), q, k, v, dout, out, lse, chunk_len,
                 scale, dq, dk, dv)
        grads.append((dk, dv))
    return dq, grads
