"""The context-parallel block kernel and block plans, without processes: against plain softmax
attention (float64, autograd) on the same inputs."""

import math

import pytest
import torch

from coc_inject.context_parallel import blocks, kernel, layout
from coc_inject.context_parallel.layout import Block


def reference(q, k, v, scale, q_pos, k_pos, causal):
    """Plain attention in float64 with K/V repeated per group: q [B,G,R,Sq,D], k/v [B,G,Sk,D]."""
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q.double(), k.double()) * scale
    if causal:
        hidden = torch.tensor(k_pos)[None, :] > torch.tensor(q_pos)[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("bgrqk,bgkd->bgrqd", scores.softmax(-1), v.double())


def inputs(b=2, g=2, r=3, sq=8, sk=8, d=4, seed=0, grad=False):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(b, g, r, sq, d, generator=generator)
    k = torch.randn(b, g, sk, d, generator=generator)
    v = torch.randn(b, g, sk, d, generator=generator)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def test_block_forward_is_softmax_attention_with_grouped_keys():
    q, k, v = inputs()
    out, lse = kernel.block_forward(q, k, v, 0.5, diagonal=False)
    want = reference(q, k, v, 0.5, range(8), range(8), causal=False)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    scores = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-6, atol=1e-6)


def test_diagonal_block_is_causal():
    q, k, v = inputs()
    out, _ = kernel.block_forward(q, k, v, 0.3, diagonal=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.3, range(8), range(8), True), rtol=1e-6, atol=1e-6)


def test_merging_key_blocks_equals_one_softmax():
    q, k, v = inputs(sk=12)
    acc_out, acc_lse = kernel.new_accumulators(q)
    for cols in (slice(0, 5), slice(5, 6), slice(6, 12)):  # uneven blocks, any order is exact
        kernel.merge_into(acc_out, acc_lse, *kernel.block_forward(q, k[..., cols, :], v[..., cols, :], 0.4, False))
    torch.testing.assert_close(acc_out.double(), reference(q, k, v, 0.4, range(8), range(12), False),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_megatron_layout_queries_against_the_whole_sequence(cp_size):
    """Rank r's two chunks (r, 2CP-1-r) against all keys in natural order, causal, forward and backward."""
    chunk = 3
    seq = 2 * cp_size * chunk
    for cp_rank in range(cp_size):
        q_ids = layout.rank_chunks(cp_rank, cp_size)
        q, k, v = inputs(sq=2 * chunk, sk=seq, seed=cp_rank, grad=True)
        scale = 1 / math.sqrt(4)
        plan = layout.plan_blocks(q_ids, range(2 * cp_size), causal=True)
        acc_out, acc_lse = kernel.new_accumulators(q)
        blocks.forward(plan, q.detach(), k.detach(), v.detach(), chunk, scale, acc_out, acc_lse)
        q_pos = layout.global_positions(q_ids, chunk)
        want = reference(q, k, v, scale, q_pos, range(seq), causal=True)
        torch.testing.assert_close(acc_out.double(), want, rtol=1e-6, atol=1e-6)

        dout = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        want.backward(dout)
        dq, dk, dv = (torch.zeros(t.shape) for t in (q, k, v))
        delta = kernel.output_delta(acc_out, dout)
        blocks.backward(plan, q.detach(), k.detach(), v.detach(), dout.float(), acc_lse, delta, chunk, scale,
                        dq, dk, dv)
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
