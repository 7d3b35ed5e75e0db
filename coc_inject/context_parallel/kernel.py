"""Block attention with a log-sum-exp: the one kernel every context-parallel schedule uses.

Pure tensor math, no communication. A query block attends to a key/value block and returns
its partial output with the log-sum-exp of its score rows; partial results of the same
queries against other key blocks merge exactly (online softmax). Backward recomputes a block's
probabilities from q, k, the final output's log-sum-exp and ``delta = rowsum(dout * out)``,
as flash attention does, so nothing of size [queries x keys] is ever kept.

Shapes (grouped-query attention without repeating K/V): queries ``[B, G, R, Sq, D]`` (G key/value
groups, R query heads per group), keys and values ``[B, G, Sk, D]``. Everything is computed in
fp32 (Megatron's ``attention_softmax_in_fp32``); partial outputs and log-sum-exps are fp32.
A ``diagonal`` block is a query chunk against the key chunk at the same sequence positions:
query i sees keys 0..i (causal).
"""

from __future__ import annotations

import torch


def _scores(q, k, scale: float, diagonal: bool) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().unsqueeze(2).transpose(-1, -2))
    scores.mul_(scale)
    if diagonal:
        rows, cols = scores.shape[-2:]
        if rows != cols:
            raise ValueError(f"a diagonal block must be square, got {rows} queries x {cols} keys")
        above = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(above, float("-inf"))
    return scores


def block_forward(q, k, v, scale: float, diagonal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` against one key/value block: (out fp32 [B,G,R,Sq,D], lse fp32 [B,G,R,Sq])."""
    probs = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(probs, dim=-1)
    probs.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs, v.float().unsqueeze(2)), lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a partial result (out, lse) into the accumulators, in place (exact online softmax).

    Accumulators start as zeros and -inf; rows no block has touched yet stay that way.
    """
    new_lse = torch.logaddexp(acc_lse, lse)
    acc_out.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
    acc_out.add_(out * torch.exp(lse - new_lse).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def output_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out), fp32 [B,G,R,Sq]: the softmax-backward term shared by every block."""
    return (dout.float() * out.float()).sum(dim=-1)


def block_backward(q, k, v, dout, lse, delta, scale: float, diagonal: bool):
    """Gradients of one block given the FINAL lse and delta of its queries: (dq, dk, dv), fp32.

    dq is ``[B,G,R,Sq,D]``; dk and dv are ``[B,G,Sk,D]`` (summed over the R heads of each group).
    """
    probs = _scores(q, k, scale, diagonal)
    probs.sub_(lse.unsqueeze(-1)).exp_()
    dout = dout.float()
    dv = torch.matmul(probs.transpose(-1, -2), dout).sum(dim=2)
    dprobs = torch.matmul(dout, v.float().unsqueeze(2).transpose(-1, -2))
    dprobs.sub_(delta.unsqueeze(-1)).mul_(probs)  # dscores, before the scale
    dq = torch.matmul(dprobs, k.float().unsqueeze(2)).mul_(scale)
    dk = torch.matmul(dprobs.transpose(-1, -2), q.float()).sum(dim=2).mul_(scale)
    return dq, dk, dv
