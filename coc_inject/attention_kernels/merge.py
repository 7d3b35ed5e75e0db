"""Online softmax: fold a block's (out, lse) into accumulators, exactly (flash attention's merge).

Accumulators are fp32 whatever the inputs: ``out [B, H, S, D]`` starts at zeros and ``lse
[B, H, S]`` at -inf; rows no block has touched yet stay that way.
"""

from __future__ import annotations

import torch


def new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    return out, lse


def merge_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """acc_out, acc_lse <- the softmax over both key sets, in place (any views of the accumulators)."""
    new_lse = torch.logaddexp(acc_lse, lse)
    acc_out.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
    acc_out.addcmul_(out, torch.exp(lse - new_lse).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def first_into(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The first block of rows no block has touched yet: merging into (0, -inf) is a copy."""
    acc_out.copy_(out)
    acc_lse.copy_(lse)
