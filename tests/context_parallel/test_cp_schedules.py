"""Each context-parallel schedule on 4 real gloo ranks against plain attention on the whole sequence
(float64 autograd): outputs and q/k/v gradients of every rank's rows. Every schedule runs on the
CPU flash kernel (what users run), fp32 within 1e-5 and bf16 within 2e-2; the reference kernel once
per algorithm."""

import pytest
import torch

from tests.context_parallel.cp_cases import full_inputs
from tests.dist_harness import RankPool


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4)
    yield pool
    pool.close()


def reference(seq, batch, heads, groups, dim, seed, causal, dtype=torch.float32):
    q, k, v, dout = (t.double() for t in full_inputs(seq, batch, heads, groups, dim, seed, dtype))
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


def check(pool, algorithm, cp, window, ulysses, heads, groups, causal, kernel="cpu-flash", dtype="float32",
          tolerance=1e-5):
    seq, batch, dim, seed = 16 * cp, 2, 8, 3
    results = pool.run("tests.context_parallel.cp_cases:run_schedule", algorithm=algorithm, cp=cp, causal=causal, seq=seq,
                       batch=batch, heads=heads, groups=groups, dim=dim, seed=seed, window=window,
                       ulysses=ulysses, kernel=kernel, dtype=dtype)
    want = reference(seq, batch, heads, groups, dim, seed, causal, getattr(torch, dtype))
    for rank, got in enumerate(results):
        copy = rank // cp  # each CP group of the pool computed the same sequence
        assert got["out"].dtype == getattr(torch, dtype) and got["dk"].dtype == getattr(torch, dtype)
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name].double(), want[name][got["rows"]], rtol=tolerance, atol=tolerance,
                                       msg=lambda m: f"rank {rank} (CP group {copy}) {name} ({kernel}): {m}")


@pytest.mark.parametrize("algorithm,cp,window,ulysses,heads,groups,causal",
                         [(*case, True) for case in CASES] + [(*case, False) for case in NO_MASK])
def test_schedule_equals_attention_on_the_whole_sequence(pool, algorithm, cp, window, ulysses, heads, groups, causal):
    check(pool, algorithm, cp, window, ulysses, heads, groups, causal)


# One case per algorithm (the CP=4 one where there are two): bf16 inputs into the fused kernel as
# they are, lse and accumulators fp32 -- Transformer Engine's CP bound 2e-2.
ONE_PER_ALGORITHM = [CASES[1], CASES[2], CASES[4], CASES[5], CASES[7]]


@pytest.mark.parametrize("algorithm,cp,window,ulysses,heads,groups", ONE_PER_ALGORITHM)
def test_schedule_in_bf16(pool, algorithm, cp, window, ulysses, heads, groups):
    check(pool, algorithm, cp, window, ulysses, heads, groups, True, dtype="bfloat16", tolerance=2e-2)


@pytest.mark.parametrize("algorithm,cp,window,ulysses,heads,groups", ONE_PER_ALGORITHM)
def test_schedule_on_the_reference_kernel(pool, algorithm, cp, window, ulysses, heads, groups):
    check(pool, algorithm, cp, window, ulysses, heads, groups, True, kernel="reference")
