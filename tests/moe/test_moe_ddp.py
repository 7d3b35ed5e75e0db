"""The MoE pieces under Megatron's DDP with ``overlap_grad_reduce`` and the distributed optimizer (Megatron-LM's
GPU defaults, tests/gpu_defaults/gpu_defaults_cases.py: fused gradient accumulation, 4 gloo ranks, TP 2 SP x EP 2),
on every release make test runs: each expert parameter's gradient reaches autograd once per layer call, as from
Megatron's experts. Before, every piece ran its own backward, so an expert weight's DDP hook fired once per piece
touching it and megatron-core 0.12 to 0.15 stopped at the first step ("Cannot set grad twice"); 0.16+ count the
hook calls and took it. SequentialMLP and, where the release has it, the legacy GroupedMLP (bf16 where its forward
asserts it); against the same training with coc-inject off."""

import pytest

from tests.gpu_defaults.test_gpu_defaults import assert_same

# bf16 GroupedMLP (0.16 asserts bf16): each piece's grouped GEMM rounds its weight gradient to bf16 before the
# pieces' fp32 sum, where Megatron's one GEMM over all rows rounds once; measured here over 2 steps: the
# second step's loss within 3.5e-4 relative, the gradient norm within 1.1e-3 (the copies' bf16 bounds,
# test_gpu_defaults.BF16_*: 2e-4 and 1e-3). Bounds 3x those seen.
GROUPED_BF16_LOSS_RTOL, GROUPED_BF16_NORM_RTOL = 1e-3, 5e-3
from tests.moe.test_moe_grouped import BF16_ONLY, HAS_GROUPED_MLP, MEGATRON

ASSERTS_ONE_HOOK_CALL = MEGATRON < (0, 16)  # register_grad_ready: "Cannot set grad twice"

CASE = "tests.gpu_defaults.gpu_defaults_cases:train"


@pytest.fixture(scope="module")
def pool(pool4):
    return pool4


@pytest.mark.parametrize("grouped", [False, True], ids=["SequentialMLP", "GroupedMLP"])
def test_moe_pieces_train_as_off_under_ddp_overlap_grad_reduce(pool, grouped):
    if grouped and not HAS_GROUPED_MLP:
        pytest.skip("this megatron-core has no legacy GroupedMLP (TEGroupedMLP only)")
    if not grouped and not ASSERTS_ONE_HOOK_CALL:
        pytest.skip("megatron-core >= 0.16 counts the hook calls (tests/gpu_defaults runs the pieces under its DDP)")
    dtype = "bf16" if grouped and BF16_ONLY else "fp32"
    want = pool.run(CASE, kind="moe", ep=2, steps=2, dtype=dtype, grouped=grouped)
    got = pool.run(CASE, coc={"moe_overlap": "1"}, kind="moe", ep=2, steps=2, dtype=dtype, grouped=grouped)
    # every MoE layer's last call ran as pieces (a route with a reason is Megatron's dispatcher's)
    assert all(r["routes"]["_coc_moe"] and all(route.startswith("MoERoute(") for route in r["routes"]["_coc_moe"])
               for r in got), [r["routes"] for r in got]
    if dtype == "bf16":
        for g, w in zip(got, want):
            assert g["trials"] == 0 and g["trial_changes"] == [] and w["fused_calls"] > 0
            assert g["losses"] == pytest.approx(w["losses"], rel=GROUPED_BF16_LOSS_RTOL)
            assert g["norms"] == pytest.approx(w["norms"], rel=GROUPED_BF16_NORM_RTOL), (g["norms"], w["norms"])
    else:
        assert_same(got, want, dtype, trials=False)
