"""The reference block kernel: fp32 torch ops, tiled.

The test oracle, and the fallback where no fused kernel can run a call (another device, a dtype
or head dim the fused kernels refuse); the caller says so when it runs. Tiled over queries AND
keys, so that no transient is larger than ``[B, H, TILE, TILE]`` fp32 whatever the block: memory
stays linear in the sequence. Grouped-query attention without repeating K/V: queries are viewed
as ``[B, G, H/G, S, D]`` against keys ``[B, G, S, D]``.
"""

from __future__ import annotations

import torch

from coc_inject.attention_kernels.merge import merge_into, new_accumulators

TILE = 512


def _grouped(q: torch.Tensor, groups: int) -> torch.Tensor:
    b, h, s, d = q.shape
    return q.float().reshape(b, groups, h // groups, s, d)


def _tiles(length: int):
    return [slice(start, min(start + TILE, length)) for start in range(0, length, TILE)]


def _pairs(sq: int, sk: int, causal: bool):
    """(query tile, key tile, diagonal) of a block; causal blocks are square, tiled alike."""
    if causal and sq != sk:
        raise ValueError(f"a causal (diagonal) block must be square, got {sq} queries x {sk} keys")
    for i, rows in enumerate(_tiles(sq)):
        for j, cols in enumerate(_tiles(sk)):
            if not causal or j <= i:
                yield rows, cols, causal and i == j


def _scores(q5, k, scale: float, diagonal: bool) -> torch.Tensor:
    scores = torch.matmul(q5, k.float().unsqueeze(2).transpose(-1, -2)).mul_(scale)
    if diagonal:
        rows, cols = scores.shape[-2:]
        scores.masked_fill_(torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu_(1), float("-inf"))
    return scores


class ReferenceKernel:
    name = "reference"

    def forward(self, q, k, v, scale: float, causal: bool):
        groups = k.shape[1]
        q5 = _grouped(q, groups)
        acc_out, acc_lse = new_accumulators(q5)
        for rows, cols, diagonal in _pairs(q.shape[2], k.shape[2], causal):
            probs = _scores(q5[..., rows, :], k[..., cols, :], scale, diagonal)
            lse = torch.logsumexp(probs, dim=-1)
            probs.sub_(lse.unsqueeze(-1)).exp_()
            merge_into(acc_out[..., rows, :], acc_lse[..., rows], torch.matmul(probs, v[..., cols, :].float().unsqueeze(2)),
                       lse)
        b, h, s, d = q.shape
        return acc_out.reshape(b, h, s, d).to(q.dtype), acc_lse.reshape(b, h, s)

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool):
        groups = k.shape[1]
        q5, dout5 = _grouped(q, groups), _grouped(dout, groups)
        lse5 = lse.reshape(q5.shape[:-1])
        delta = (dout5 * _grouped(out, groups)).sum(dim=-1)  # rowsum(dout * out) of the final output
        dq = torch.zeros_like(q5)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros_like(dk)
        for rows, cols, diagonal in _pairs(q.shape[2], k.shape[2], causal):
            probs = _scores(q5[..., rows, :], k[..., cols, :], scale, diagonal)
            probs.sub_(lse5[..., rows].unsqueeze(-1)).exp_()
            dv[..., cols, :] += torch.matmul(probs.transpose(-1, -2), dout5[..., rows, :]).sum(dim=2)
            dprobs = torch.matmul(dout5[..., rows, :], v[..., cols, :].float().unsqueeze(2).transpose(-1, -2))
            dprobs.sub_(delta[..., rows].unsqueeze(-1)).mul_(probs)  # dscores, before the scale
            dq[..., rows, :] += torch.matmul(dprobs, k[..., cols, :].float().unsqueeze(2)).mul_(scale)
            dk[..., cols, :] += torch.matmul(dprobs.transpose(-1, -2), q5[..., rows, :]).sum(dim=2).mul_(scale)
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


KERNEL = ReferenceKernel()
