"""All-gather: every rank gathers the whole sequence's keys and values, attends its local queries
to them, and reduce-scatters the key/value gradients back to their owners.

Megatron's non-overlapped variant (``cp_comm_type="all_gather"``) and the baseline the overlapped
schedules are measured against. The gathered block is not kept for backward (it is gathered
again there), so what a rank keeps stays its own share of the sequence.
"""

from __future__ import annotations

import torch

from coc_inject.attention_kernels.merge import new_accumulators
from coc_inject.context_parallel import blocks, layout
from coc_inject.context_parallel.comm import all_gather, reduce_scatter


def _gather(kv, group, size):
    stacked = torch.empty((size, *kv.shape), dtype=kv.dtype, device=kv.device)
    all_gather(stacked, kv.contiguous(), group).wait()
    # [size, 2, B, G, S, D] -> [2, B, G, size*S, D]: the ranks' local sequences one after another
    two, b, g, s, d = kv.shape
    return stacked.permute(1, 2, 3, 0, 4, 5).reshape(two, b, g, size * s, d)


def _plan(q_ids, size, causal, k_ids=None):
    return layout.plan_blocks(q_ids, layout.gathered_chunks(range(size), size) if k_ids is None else k_ids, causal)


def forward(group, size, kernel, q, kv, q_ids, causal, chunk_len, scale, k_ids=None):
    """``k_ids``: the gathered parts' chunk ids, rank after rank (None: Megatron's layout)."""
    acc_out, acc_lse = new_accumulators(q)
    whole = _gather(kv, group, size)
    blocks.forward(kernel, _plan(q_ids, size, causal, k_ids), q, whole[0], whole[1], chunk_len, scale, acc_out,
                   acc_lse, set())
    return acc_out, acc_lse


def backward(group, size, kernel, q, kv, dout, out, lse, q_ids, causal, chunk_len, scale, k_ids=None):
    whole = _gather(kv, group, size)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dwhole = torch.zeros(whole.shape, dtype=torch.float32, device=q.device)
    blocks.backward(kernel, _plan(q_ids, size, causal, k_ids), q, whole[0], whole[1], dout, out, lse, chunk_len,
                    scale, dq, dwhole[0], dwhole[1])
    two, b, g, _, d = dwhole.shape
    stacked = dwhole.view(two, b, g, size, -1, d).permute(3, 0, 1, 2, 4, 5).contiguous()
    dkv = torch.empty(kv.shape, dtype=torch.float32, device=q.device)
    reduce_scatter(dkv, stacked, group).wait()
    return dq, dkv
