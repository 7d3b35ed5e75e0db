"""Block plans of Megatron's CP layout, without processes: run through the block kernels against
plain softmax attention (float64, autograd) on the same inputs. (The kernels themselves:
test_attention_kernels.py.)"""

import math

import pytest
import torch

from coc_inject.attention_kernels import cpu, reference
from coc_inject.attention_kernels.merge import new_accumulators
from coc_inject.context_parallel import blocks, layout
from coc_inject.context_parallel.layout import Block


def plain_attention(q, k, v, scale, q_pos, k_pos):
    """Causal attention in float64 with K/V repeated per group: q [B,H,Sq,D], k/v [B,G,Sk,D]."""
    repeat = q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(repeat, 1).transpose(-1, -2) * scale
    hidden = torch.tensor(k_pos)[None, :] > torch.tensor(q_pos)[:, None]
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v.double().repeat_interleave(repeat, 1)


@pytest.mark.parametrize("kernel", [cpu.KERNEL, reference.KERNEL], ids=lambda k: k.name)
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_megatron_layout_queries_against_the_whole_sequence(cp_size, kernel):
    """Rank r's two chunks (r, 2CP-1-r) against all keys in natural order, causal, forward and backward."""
    chunk = 3
    seq = 2 * cp_size * chunk
    generator = torch.Generator().manual_seed(0)
    for cp_rank in range(cp_size):
        q_ids = layout.rank_chunks(cp_rank, cp_size)
        q = torch.randn(2, 6, 2 * chunk, 4, generator=generator, requires_grad=True)
        k, v = (torch.randn(2, 2, seq, 4, generator=generator, requires_grad=True) for _ in range(2))
        scale = 1 / math.sqrt(4)
        plan = layout.plan_blocks(q_ids, range(2 * cp_size), causal=True)
        acc_out, acc_lse = new_accumulators(q)
        blocks.forward(kernel, plan, q.detach(), k.detach(), v.detach(), chunk, scale, acc_out, acc_lse)
        want = plain_attention(q, k, v, scale, layout.global_positions(q_ids, chunk), range(seq))
        torch.testing.assert_close(acc_out.double(), want, rtol=1e-5, atol=1e-5)

        dout = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        want.backward(dout)
        dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
        blocks.backward(kernel, plan, q.detach(), k.detach(), v.detach(), dout.float(), acc_out, acc_lse, chunk,
                        scale, dq, dk, dv)
        for got, tensor in ((dq, q), (dk, k), (dv, v)):
            torch.testing.assert_close(got.double(), tensor.grad.double(), rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_never_appear_in_a_causal_plan():
    """Every query chunk of every rank meets its diagonal block, so no softmax row is empty."""
    for cp_size in (1, 2, 4, 8):
        for cp_rank in range(cp_size):
            q_ids = layout.rank_chunks(cp_rank, cp_size)
            plan = layout.plan_blocks(q_ids, range(2 * cp_size), causal=True)
            assert sorted(b.q_start for b in plan if b.diagonal) == [0, 1]


def test_ring_step_plans_skip_masked_pairs_and_compute_halves():
    n = 4
    # Own block: both diagonals and the second query chunk against the first key chunk.
    assert set(layout.plan_blocks((1, 6), (1, 6), True)) == {
        Block(0, 1, 0, 1, True), Block(1, 2, 1, 2, True), Block(1, 2, 0, 1, False)}
    # A block from a lower rank: all queries against its first half only.
    assert layout.plan_blocks(layout.rank_chunks(2, n), layout.rank_chunks(0, n), True) == (Block(0, 2, 0, 1, False),)
    # From a higher rank: the second query half against the whole block.
    assert layout.plan_blocks(layout.rank_chunks(0, n), layout.rank_chunks(3, n), True) == (Block(1, 2, 0, 2, False),)
    # No mask: one block.
    assert layout.plan_blocks((0, 3), (1, 2), False) == (Block(0, 2, 0, 2, False),)


def test_plan_covers_exactly_the_visible_pairs():
    for cp_size in (2, 4):
        ids = layout.gathered_chunks(range(cp_size), cp_size)
        for causal in (True, False):
            plan = layout.plan_blocks(ids[:4], ids, causal)
            covered = [(qa, kb, blk.diagonal) for blk in plan for qa in range(blk.q_start, blk.q_stop)
                       for kb in range(blk.k_start, blk.k_stop)]
            assert len(covered) == len(set((a, b) for a, b, _ in covered))  # no pair twice
            want = {(a, b) for a in range(4) for b in range(len(ids)) if not causal or ids[b] <= ids[a]}
            assert {(a, b) for a, b, _ in covered} == want
            assert all(diag == (ids[a] == ids[b] and causal) for a, b, diag in covered)
