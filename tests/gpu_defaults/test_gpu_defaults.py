"""Every wing on ``auto`` under Megatron's GPU defaults (gpu_defaults_cases.py: fused gradient
accumulation, Megatron's DDP with overlapped grad reduce and the distributed optimizer, fp32 and bf16),
4 gloo ranks, against the same training without coc-inject: the trials of each ``auto`` run on the
job's layers at the first step and must leave its gradients as they found them.

Bounds. fp32: losses within 1e-5 relative, each step's gradient norm within 1e-3 relative and every
reduced gradient within 1e-4 of the largest (summation order only). bf16: the copies round their
half-batches differently from Megatron's whole one, as a different micro-batch size does: losses
within BF16_LOSS_RTOL, gradient norms within BF16_NORM_RTOL (measured here with 2 copies over 4
steps: 2.9e-5 and 1.1e-4; CoC's chunks alone: equal). A trial that adds its gradients into
``main_grad`` changes them by far more, and the trial watch names each change."""

import pytest

from coc_inject.config import AUTO
from tests.scope import newest_only

pytestmark = newest_only  # Megatron's DDP buckets as 0.19 lays them out (the older releases: tests/multi_copy)

BF16_LOSS_RTOL = 2e-4
BF16_NORM_RTOL = 1e-3
_references: dict = {}


@pytest.fixture(scope="module")
def pool(pool4):
    return pool4


def train(pool, **kwargs):
    return pool.run("tests.gpu_defaults.gpu_defaults_cases:train", **kwargs)


def reference(pool, coc=None, **kwargs):
    key = repr((coc, sorted(kwargs.items())))
    if key not in _references:
        _references[key] = train(pool, coc=coc, **kwargs)
    return _references[key]


def assert_same(got, want, dtype, trials=True):
    for rank, (g, w) in enumerate(zip(got, want)):
        # Megatron's linears took the fused path (CoC's chunked ones write main_grad themselves).
        assert w["fused_calls"] > 0, "Megatron's linears did not take the fused path"
        # The trials ran at the first step and left main_grad, DDP's buckets and the RNG as found.
        assert (g["trials"] > 0) == trials, (rank, g["decisions"])
        assert g["trial_changes"] == [] and g["fused_in_trials"] == 0, (rank, g["trial_changes"], g["fused_in_trials"])
        if dtype == "fp32":
            assert g["losses"] == pytest.approx(w["losses"], rel=1e-5), rank
            assert g["norms"] == pytest.approx(w["norms"], rel=1e-3), (rank, g["norms"], w["norms"])
            for step, (gs, ws) in enumerate(zip(g["grads"], w["grads"])):
                for name, grad in ws.items():
                    scale = max(float(grad.abs().max()), 1e-6)
                    diff = float((gs[name] - grad).abs().max())
                    assert diff <= 1e-4 * scale, (rank, step, name, diff, scale)
        else:
            assert g["losses"] == pytest.approx(w["losses"], rel=BF16_LOSS_RTOL), rank
            assert g["norms"] == pytest.approx(w["norms"], rel=BF16_NORM_RTOL), (rank, g["norms"], w["norms"])


EVERY_DENSE_WING = {"parallel_num": AUTO, "multi_copy": AUTO}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_dense_wings_on_auto_train_as_off(pool, dtype):
    """TP 2 SP x DP 2: COC_PARALLEL_NUM=auto and COC_MULTI_COPY=auto (the copies' trials ran the
    block's backward with fused accumulation on: issue 33's first-step corruption)."""
    got = train(pool, coc=EVERY_DENSE_WING, dtype=dtype)
    assert_same(got, reference(pool, dtype=dtype), dtype)


def test_bf16_copies_and_chunks_within_the_bf16_bound(pool):
    """The bf16 bound with copies and chunks certainly running (auto may choose Megatron's path), Megatron-LM's
    default fusions on (bias-GeLU, bias-dropout-add, the fused softmax): both wings ran, none stepped aside."""
    got = train(pool, coc={"multi_copy": 2, "parallel_num": 4}, dtype="bf16", steps=4)
    assert_same(got, reference(pool, dtype="bf16", steps=4), "bf16", trials=False)
    for rank, g in enumerate(got):
        assert g["linear_calls"] > 0, rank
        copies = g["routes"].get("_coc_multi_copy", [])
        assert copies and all(r.startswith("CopiesRoute(copies=2,") for r in copies), (rank, copies)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_context_parallel_auto_trains_as_ring(pool, dtype):
    """TP 2 x CP 2 with every dense wing on auto against CoC's ring alone (Megatron's local attention
    has no context parallelism to compare with)."""
    got = train(pool, coc={"cp_algo": "auto", **EVERY_DENSE_WING}, cp=2, dtype=dtype)
    assert_same(got, reference(pool, coc={"cp_algo": "ring"}, cp=2, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe_auto_trains_as_off(pool, dtype):
    """TP 2 SP x EP 2 MoE GPT: COC_MOE_OVERLAP=auto and the dense wings on auto."""
    got = train(pool, coc={"moe_overlap": "auto", "parallel_num": AUTO}, kind="moe", ep=2, dtype=dtype)
    assert_same(got, reference(pool, kind="moe", ep=2, dtype=dtype), dtype)


def test_bf16_moe_pieces_and_chunks_run_within_the_bf16_bound(pool):
    """The MoE pieces and the chunked linears certainly running in bf16 with the fusions on."""
    got = train(pool, coc={"moe_overlap": "1", "parallel_num": 2}, kind="moe", ep=2, dtype="bf16")
    assert_same(got, reference(pool, kind="moe", ep=2, dtype="bf16"), "bf16", trials=False)
    for rank, g in enumerate(got):
        assert g["linear_calls"] > 0, rank
        moe = g["routes"].get("_coc_moe", [])
        assert moe and all("pieces" in r or "chunks" in r for r in moe), (rank, moe)


# Megatron's fused softmax on (tests/fakes/fused_softmax.py) at micro-batch 1: sequence copies. 16 heads at
# TP 2 and 32 tokens fit its fused causal kernel (8 score rows per CUDA block), which ignores the mask
# tensor: Megatron runs causal, the copies run causal without reading the mask. 4 heads do not fit:
# Megatron's torch softmax applies the document mask, and the copies step aside with the reason.
FUSED_SOFTMAX_CASES = [("causal", 16, None), ("document", 16, None),
                       ("document", 4, "padding or document mask Megatron's softmax applies")]


@pytest.mark.parametrize("mask, heads, refused", FUSED_SOFTMAX_CASES, ids=["causal", "document", "document-applied"])
def test_bf16_sequence_copies_with_megatrons_fused_softmax(pool, mask, heads, refused):
    """Issue 41, items 4, 6, 8: within the bf16 bound or Megatron's block with the reason; Megatron's
    softmax never sees a non-square score matrix; no mask read where Megatron ignores the mask."""
    options = dict(dtype="bf16", b=1, mask=mask, heads=heads, softmax_fusion=True, steps=2)
    got = train(pool, coc={"multi_copy": 2}, **options)
    want = reference(pool, **options)
    fused = heads == 16
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g["nonsquare"] == [] and w["nonsquare"] == [], (rank, g["nonsquare"])
        assert ("scaled_upper_triang_masked_softmax_cuda" in w["softmax_calls"]) == fused, w["softmax_calls"]
        reasons = g["routes"].get("_coc_multi_copy", [])
        if refused is None:
            assert reasons and all(r.startswith("CopiesRoute(copies=2,") for r in reasons), (rank, reasons)
            assert g["mask_reads"] == 0, rank  # the fused causal kernel ignores the mask: nothing to read
        else:
            assert reasons and all(refused in r for r in reasons), (rank, reasons)
            assert g["mask_reads"] == 1, rank  # one mask tensor for every step: read once
    assert_same(got, want, "bf16", trials=False)
