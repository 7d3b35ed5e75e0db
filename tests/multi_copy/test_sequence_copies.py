"""Sequence copies (a micro-batch the copies do not divide: the copies split the sequence, copy 0 the
first positions; the copies meet in the attention) on a real megatron-core GPT, 4 gloo ranks: the
same training as without copies (losses and parameters after 3 SGD steps within 1e-5 relative, fp32),
every collective in the same order on every rank, and the calls sequence copies cannot run exactly
run Megatron's block with the reason; at CP > 1 each copy's attention runs the layer's CP algorithm. On
0.16.1 and 0.13.1 (TEST_SCOPE=older-release): micro-batch 1 with SP, a causal mask tensor with RoPE and
GQA (Megatron's attention, rotary and mask APIs of each release), and CP 2 x TP 2 SP under Ulysses."""

import pytest

from tests.context_parallel.test_cp_gpt import assert_same_training, pool  # noqa: F401 - pool: a fixture
from tests.multi_copy.test_multi_copy import interleaved, reference, run, same_block_calls_on_every_rank
from tests.scope import newest_only


@pytest.mark.parametrize("sp", [True, pytest.param(False, marks=newest_only)], ids=["sp", "no-sp"])
def test_micro_batch_1_splits_the_sequence_causal_without_a_mask(pool, sp):
    run(pool, tp=2, sp=sp, b=1, mask="none")


def test_causal_mask_tensor_rope_and_gqa(pool):
    run(pool, tp=2, sp=True, b=1, rope=True, groups=2)


@newest_only
def test_a_padding_mask_megatron_applies_runs_megatrons_block_with_the_reason(pool):
    """fp32: Megatron's softmax applies the mask; the copies' attention over parts runs causal blocks only,
    and Megatron's attention never sees a copy's non-square score matrix (issue 41, item 4)."""
    got = pool.run("tests.multi_copy.multi_copy_cases:train", copies=2, tp=2, sp=True, b=1, steps=1, mask="padding")
    assert all(len(r["routes"]) == 1 and r["routes"][0][0] == 1 and "padding or document mask" in r["routes"][0][1]
               for r in got), [r["routes"] for r in got]
    assert_same_training(got, reference(pool, tp=2, sp=True, b=1, steps=1, mask="padding"))


@newest_only
def test_micro_batch_3_with_2_copies_splits_the_sequence(pool):
    run(pool, tp=2, sp=True, b=3, mask="none")


@newest_only
def test_every_rank_issues_the_same_collectives_in_the_copies_interleave(pool):
    got = run(pool, tp=4, sp=True, b=1, mask="none", record=True, poison=True)
    first = got[0]["collectives"]
    calls, backward = same_block_calls_on_every_rank(got)
    for call in calls:
        assert [r[3] for r in call].count(0) == [r[3] for r in call].count(1) >= 2 * 2, call
        if call not in backward:
            assert call == interleaved(call), call
    # In the backward copy 0's key/value projection waits for copy 1's attention (the gradient it sends
    # to copy 0's keys and values), so copy 1's weight-gradient gather there comes before copy 0's
    # reduce-scatter; the collectives left in flight still alternate copy 0, copy 1 at every cut.
    for call in backward:
        assert [r[3] for r in call if r[4]] == [0, 1] * (2 * 2 * 2), call
    # the rows cross the TP group at the block's edges, outside the copies: in, out; the gradients back
    outside = [record[0] for record in first if record[3] is None and record[0] == "all_to_all_single"]
    assert len(outside) == 4 * 3, outside


@newest_only
def test_a_mask_that_lets_a_position_see_a_later_one_runs_megatrons_block(pool):
    got = pool.run("tests.multi_copy.multi_copy_cases:train", copies=2, tp=2, sp=True, b=1, steps=1,
                   mask="none", mask_type="no_mask")
    assert all(len(r["routes"]) == 1 and r["routes"][0][0] == 1 and "later copy's keys" in r["routes"][0][1]
               for r in got), [r["routes"] for r in got]
    assert_same_training(got, reference(pool, tp=2, sp=True, b=1, steps=1, mask="none", mask_type="no_mask"))


@newest_only
def test_micro_batch_1_inside_each_pipeline_stage(pool):
    """TP 2 x PP 2 (SP), micro-batches of 1: stage 1's block splits the sequence of the input tensor
    Megatron hands it."""
    want = pool.run("tests.multi_copy.multi_copy_cases:train_pipeline", copies=1, b=2)
    got = pool.run("tests.multi_copy.multi_copy_cases:train_pipeline", copies=2, b=2)
    assert all(r["routes"] == [(2, None)] for r in got), [r["routes"] for r in got]
    assert_same_training(got, want)


@newest_only  # auto's trials and agreement: coc-inject's own, tested once
def test_auto_at_micro_batch_1_tries_sequence_copies_and_agrees_over_the_group(pool):
    """COC_MULTI_COPY=auto at micro-batch 1: the trials compare no copies with 2 and 4 sequence copies (32
    rows a rank divide by both), keyed by the sequence split. One rank of each TP group has its trials
    without copies slowed: the MAX over the group makes copies win on both of its ranks, whatever the
    other rank's own trials say, and the training runs as those sequence copies, equal to no copies."""
    from coc_inject.multi_copy.auto import CopiesKey
    from coc_inject.tuning.online import TIMED_ROUNDS

    got = pool.run("tests.multi_copy.multi_copy_cases:train_auto", tp=2, sp=True, b=1, mask="none",
                   skew={0: 0.5, 2: 0.5}, slow_baseline=True)
    decisions = [r["decisions"] for r in got]
    assert all(len(d) == 1 and d[0]["source"] == "trials" and "sequence split" in d[0]["key"] for d in decisions), \
        decisions
    # One decision on both ranks of each TP group (ranks 0-1 and 2-3: the trials agree over TP x CP), copies;
    # the two data-parallel replicas decide apart and may each pick 2 or 4 (both exact).
    assert decisions[0] == decisions[1] and decisions[2] == decisions[3], decisions
    assert {d[0]["choice"] for d in decisions} <= {2, 4}, decisions
    for result in got:
        assert result["trial_runs"] == {c: CopiesKey.WARM_UPS + TIMED_ROUNDS for c in (1, 2, 4)}, result["trial_runs"]
    for result, decision in zip(got, decisions):
        assert result["routes"] == [(decision[0]["choice"], None)], result["routes"]
    assert_same_training(got, reference(pool, tp=2, sp=True, b=1, mask="none"))


@newest_only  # coc-inject's own key and cache: the same on every release
def test_auto_keys_a_decision_by_its_split_so_a_cached_one_serves_only_that_split(tmp_path):
    """The same block, input shape and candidates split by batch or by sequence: two keys, and a decision
    cached for the batch split is not found for the sequence split (nor the other way)."""
    import types

    import torch

    from coc_inject.multi_copy import auto
    from coc_inject.multi_copy.sequence import BATCH, SEQUENCE
    from coc_inject.multi_copy.splits import Split
    from coc_inject.tuning.cache import TuneCache

    config = types.SimpleNamespace(tensor_model_parallel_size=2, context_parallel_size=1, sequence_parallel=True)
    block = types.SimpleNamespace(config=config, layers=[None, None])
    hidden = torch.zeros(32, 2, 16, requires_grad=True)
    keys = {kind: auto.key_for(block, hidden, Split(2, 32 if kind == SEQUENCE else 2, (), kind=kind), [1, 2])
            for kind in (BATCH, SEQUENCE)}
    assert keys[BATCH] != keys[SEQUENCE], keys
    assert keys[BATCH].text().endswith("cpu batch split") and keys[SEQUENCE].text().endswith("cpu sequence split")
    path = str(tmp_path / "tune.json")
    TuneCache(path).put(TuneCache.key(keys[BATCH], "host"), 2, {1: 1.0, 2: 0.5})
    TuneCache(path).put(TuneCache.key(keys[SEQUENCE], "elsewhere"), 4, {1: 1.0, 4: 0.5})
    assert TuneCache(path).get(TuneCache.key(keys[BATCH], "host")) == 2  # read back from the file
    assert TuneCache(path).get(TuneCache.key(keys[SEQUENCE], "host")) is None


# Context parallelism (CP > 1): each copy's attention runs the layer's CP algorithm (meeting_cp.py); copy 0
# holds each CP rank's first chunk (the sequence's first half), copy 1 its second.

def run_cp(pool, coc, want_routes=((2, None),), record=False, poison=False, **kwargs):
    """Sequence copies at CP > 1 against the same model without copies; ``cp_copy_calls``: 3 steps x 2
    layers x 2 copies through the CP algorithm where the copies ran."""
    got = pool.run("tests.multi_copy.multi_copy_cases:train_cp_copies", copies=2, coc=coc, record=record,
                   poison=poison, **kwargs)
    assert all(r["routes"] == [tuple(route) for route in want_routes] for r in got), [r["routes"] for r in got]
    copies_ran = want_routes[0][0] == 2
    assert all(sum(r["cp_copy_calls"].values()) == (3 * 2 * 2 if copies_ran else 0) for r in got), \
        [r["cp_copy_calls"] for r in got]
    assert_same_training(got, reference(pool, coc=coc, **kwargs))
    return got


@pytest.mark.parametrize("algorithm", ["ulysses", pytest.param("allgather", marks=newest_only),
                                       pytest.param("ring", marks=newest_only)])
@pytest.mark.parametrize("sp", [True, pytest.param(False, marks=newest_only)], ids=["sp", "no-sp"])
def test_cp2_tp2_micro_batch_1_each_copy_runs_the_cp_algorithm(pool, algorithm, sp):
    """CP 2 x TP 2, micro-batch 1, causal (no mask tensor), RoPE, GQA (Ulysses repeats the K/V groups).
    On 0.16.1 and 0.13.1 too: Ulysses with SP."""
    got = run_cp(pool, {"cp_algo": algorithm}, tp=2, cp=2, sp=sp, b=1, mask="none", rope=True, groups=2)
    assert all(r["cp_copy_calls"] == {algorithm: 12} for r in got), [r["cp_copy_calls"] for r in got]


@newest_only
@pytest.mark.parametrize("coc", [{"cp_algo": "hybrid", "cp_ulysses_degree": 2}, {"cp_algo": "ring", "cp_window": 2}],
                         ids=["hybrid", "double-ring"])
def test_cp4_hybrid_and_double_ring_with_a_causal_mask_tensor(pool, coc):
    """CP 4 (hybrid's Ulysses groups of 2 and a ring of 2; Double-Ring's windows of 2) at micro-batch 1
    with Megatron's causal mask tensor (this rank's rows) and RoPE."""
    run_cp(pool, coc, tp=1, cp=4, b=1, mask="full", seq=128, rope=True)


def _relative(records):
    """TP 2 x CP 2 in a world of 4: each rank's groups named by their ranks' offsets."""
    return [(op, ranks if ranks == "world" else tuple(r - min(ranks) for r in ranks), *rest)
            for op, ranks, *rest in records]


@newest_only
@pytest.mark.parametrize("algorithm", ["ulysses", "ring"])
def test_cp2_tp2_every_rank_issues_the_same_collectives(pool, algorithm):
    """Every collective of a CP 2 x TP 2 SP step recorded on every rank (poison on): one order on every
    rank, the forward in the copies' interleave (each copy's CP collectives included), the backward's
    deferred collectives alternating copy 0, copy 1 at every cut."""
    got = run_cp(pool, {"cp_algo": algorithm}, tp=2, cp=2, sp=True, b=1, mask="none", record=True, poison=True)
    calls, backward = same_block_calls_on_every_rank([dict(r, collectives=_relative(r["collectives"])) for r in got])
    cp_ops = {"ulysses": "all_to_all_single", "ring": "batch_isend_irecv"}[algorithm]
    for call in calls:
        if call not in backward:
            assert call == interleaved(call), call
            mine = [r[3] for r in call if r[0] == cp_ops and r[1] in ((0, 2), "world")]
            assert mine.count(0) == mine.count(1) >= 2, call  # each copy's attention over the CP group
    for call in backward:
        assert [r[3] for r in call if r[4]] == [0, 1] * (2 * 2 * 2), call


@newest_only
@pytest.mark.parametrize("copies,coc,why", [
    (2, {"cp_algo": "auto"}, "COC_CP_ALGO=auto"),
    (4, {"cp_algo": "ring"}, "2 copies only"),
], ids=["cp-auto", "4-copies"])
def test_cp_what_sequence_copies_cannot_run_runs_megatrons_block_with_the_reason(pool, copies, coc, why):
    """COC_CP_ALGO=auto (its trials time the whole attention) and 4 copies (Megatron's CP layout holds two
    chunks a rank): Megatron's block, said with the reason, training as without copies."""
    got = pool.run("tests.multi_copy.multi_copy_cases:train_cp_copies", copies=copies, coc=coc, tp=2, cp=2, sp=True,
                   b=1, mask="none", steps=1)
    assert all(len(r["routes"]) == 1 and r["routes"][0][0] == 1 and why in r["routes"][0][1]
               and "sequence copies cannot run" in r["routes"][0][1] and r["cp_copy_calls"] == {} for r in got), \
        [r["routes"] for r in got]
    assert_same_training(got, reference(pool, coc=coc, tp=2, cp=2, sp=True, b=1, mask="none", steps=1))


@newest_only  # coc-inject's own candidates
def test_auto_tries_at_most_2_sequence_copies_at_cp_above_1():
    from coc_inject.multi_copy import auto

    assert auto.candidates(2, True, False, rows=8, most=2) == [1, 2]
    assert auto.candidates(2, True, False, rows=8) == [1, 2, 4]


def test_copies_attention_accumulates_dq_over_key_blocks_in_fp32():
    """Issue 41, item 7: a bf16 sum over the key blocks rounds at each one (1 + 3 * 2**-9 stays 1.0 in
    bf16); the copies accumulate in fp32, as the CP schedules do, and cast once (1.0078125)."""
    import torch

    from coc_inject.multi_copy.meeting import CopiesAttention, _to_kernel

    class Steps:
        name, calls = "steps", 0

        def forward(self, q, k, v, scale, causal):
            return torch.zeros_like(q), torch.zeros(q.shape[:-1])

        def backward(self, dout, q, k, v, out, lse, scale, causal):
            self.calls += 1
            return torch.full_like(q, 1.0 if self.calls == 1 else 2.0 ** -9), torch.zeros_like(k), torch.zeros_like(v)

    def leaf():
        return torch.zeros(4, 1, 1, 2, dtype=torch.bfloat16, requires_grad=True)

    q, kv = leaf(), [leaf() for _ in range(8)]
    earlier = [(k, v, _to_kernel(k), _to_kernel(v)) for k, v in zip(kv[0:6:2], kv[1:6:2])]
    CopiesAttention.apply(q, kv[6], kv[7], Steps(), 1.0, earlier, *kv[:6]).sum().backward()
    assert q.grad.float().unique().tolist() == [1.0078125]
