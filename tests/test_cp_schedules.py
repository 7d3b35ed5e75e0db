"""Each context-parallel schedule on 4 real gloo ranks against plain attention on the whole sequence
(float64 autograd): outputs and q/k/v gradients of every rank's rows."""

import pytest
import torch

from tests.cp_cases import full_inputs
from tests.dist_harness import RankPool


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4)
    yield pool
    pool.close()


def reference(seq, batch, heads, groups, dim, seed, causal):
    q, k, v, dout = (t.double() for t in full_inputs(seq, batch, heads, groups, dim, seed))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    kk = k.repeat_interleave(heads // groups, dim=2)
    vv = v.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / dim ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


CASES = [  # algorithm, cp, window, ulysses degree, heads, groups
    ("ring", 2, 1, 1, 4, 2),
    ("ring", 4, 1, 1, 4, 4),
    ("ring", 4, 2, 1, 2, 1),  # Double-Ring
    ("ulysses", 2, 1, 1, 4, 2),
    ("ulysses", 4, 1, 1, 8, 4),
    ("hybrid", 4, 1, 2, 4, 2),
    ("allgather", 2, 1, 1, 4, 1),
    ("allgather", 4, 1, 1, 2, 2),
]


# No mask: every algorithm once (ring and allgather at CP=4 add nothing to their CP=2 and Double-Ring cases).
NO_MASK = [case for case in CASES if not (case[1] == 4 and case[0] in ("ring", "allgather") and case[2] == 1)]


@pytest.mark.parametrize("algorithm,cp,window,ulysses,heads,groups,causal",
                         [(*case, True) for case in CASES] + [(*case, False) for case in NO_MASK])
def test_schedule_equals_attention_on_the_whole_sequence(pool, algorithm, cp, window, ulysses, heads, groups, causal):
    seq, batch, dim, seed = 16 * cp, 2, 8, 3
    results = pool.run("tests.cp_cases:run_schedule", algorithm=algorithm, cp=cp, causal=causal, seq=seq,
                       batch=batch, heads=heads, groups=groups, dim=dim, seed=seed, window=window,
                       ulysses=ulysses)
    want = reference(seq, batch, heads, groups, dim, seed, causal)
    for rank, got in enumerate(results):
        copy = rank // cp  # each CP group of the pool computed the same sequence
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name].double(), want[name][got["rows"]], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank} (CP group {copy}) {name}: {m}")
