"""COC_MOE_OVERLAP on Megatron's MoE layer (alltoall dispatcher, SequentialMLP experts), gloo ranks:
output, input gradient and parameter gradients against the same layer unpatched; every all-to-all
issued in the same order on every rank, each one's splits matching its peers'."""

import pytest

from coc_inject.config import AUTO
from coc_inject.moe.calls import AUTO_CHOSE_MEGATRON
from tests.dist_harness import RankPool
from coc_inject.megatron_version import importable, release
from tests.scope import OLDER_RELEASE, newest_only

# megatron-core 0.12 runs the pieces through its dispatcher's token_permutation / token_unpermutation
# (moe/permutation_stages.py); in make test's budget its venv runs the cases marked here as well as the
# GPT ones: exactness at EP 2 (2 and 1 local experts, capacity), auto once, expert TP, TP 2 SP x EP 2.
OLDEST = release(importable().version) == (0, 12)
not_on_oldest = pytest.mark.skipif(OLDER_RELEASE and OLDEST, reason="megatron-core 0.12: a few cases (make test budget)")


def in_pieces(routes, pieces=None) -> bool:
    """Every route in pieces (``pieces`` of them if given)."""
    return bool(routes) and all(route[0] == "pieces" and (pieces is None or route[1] == pieces) for route in routes)


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4)
    yield pool
    pool.close()


def check_exact(results, chunks):
    for rank, r in enumerate(results):
        assert r["route"] == ("pieces", chunks), (rank, r["route"])
        assert r["same_params"]
        # One chunk per expert: the same rows through the same GEMMs, bitwise. Row chunks: a GEMM over fewer
        # rows may block its sums differently, and the weight gradient is summed chunk by chunk.
        exact = chunks == 1
        for what, scale in (("out", r["out_scale"]), ("x_grad", r["out_scale"]), ("param_grad", r["param_grad_scale"])):
            assert r[what] <= (0.0 if exact else 1e-6 * max(1.0, scale)), (rank, what, r[what], scale)


def check_order(results, pieces):
    """The same all-to-alls in the same order on every rank of a group; rank i sends rank j what j expects;
    every tensor on the device of the job's."""
    assert all(r["off_device"] == [] for r in results), [r["off_device"] for r in results]
    calls = [r["calls"] for r in results]
    assert len({len(c) for c in calls}) == 1
    assert len(calls[0]) == 6 * pieces  # per piece: dispatch (tokens, probs) and combine; backward the same three
    for index in range(len(calls[0])):
        for rank, (group, _, _) in enumerate(c[index] for c in calls):
            members = [calls[member][index] for member in group]
            assert all(member[0] == group for member in members), (index, rank, members)
            for i, (_, _, sent) in enumerate(members):
                for j, (_, received, _) in enumerate(members):
                    assert sent[j] == received[i], (index, i, j, sent, received)


def run(pool, ranks=4, **case):
    """``case`` on every rank of ``pool`` (the ranks beyond the EP group form more groups)."""
    return pool.run("tests.moe.moe_cases:layer_case", **case)


@pytest.mark.parametrize("ep,experts,topk", [(2, 4, 2), (2, 2, 1), pytest.param(4, 4, 2, marks=not_on_oldest),
                                             pytest.param(4, 16, 2, marks=not_on_oldest),
                                             pytest.param(2, 8, 1, marks=not_on_oldest)],
                         ids=["ep2-2local-top2", "ep2-1local-top1", "ep4-1local-top2", "ep4-4local-top2",
                              "ep2-4local-top1"])
def test_pieces_equal_megatron(pool, ep, experts, topk):
    local = experts // ep
    chunks = max(1, -(-8 // local))
    results = run(pool, ep=ep, experts=experts, topk=topk)
    check_exact(results, chunks)
    check_order(results, local * chunks)


@not_on_oldest
def test_an_expert_no_rank_sends_to_and_one_only_one_rank_sends_to(pool):
    nobody = run(pool, ep=2, experts=4, kind="positive", shun=1)
    check_exact(nobody, 4)
    assert all(r["received"][s][1] == 0 for r in nobody[:1] for s in range(2)), nobody[0]["received"]
    one_rank = run(pool, ep=2, experts=4, kind="positive on rank 0", shun=1)
    check_exact(one_rank, 4)
    received = one_rank[0]["received"]  # rank 0 holds experts 0 and 1: rank 0 sends expert 1 nothing
    assert received[0][1] == 0 and received[1][1] > 0, received


def test_capacity_factor_drops_the_same_tokens(pool):
    results = run(pool, ep=2, experts=4, moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs")
    check_exact(results, 4)


def test_auto_decides_once_the_same_on_every_rank_of_a_group_and_stays_exact(pool):
    results = pool.run("tests.moe.moe_cases:auto_case", ep=2, experts=4)
    for group in ((0, 1), (2, 3)):  # each EP group decides for itself
        decisions = [results[rank]["decisions"] for rank in group]
        assert len(decisions[0]) == 1 and decisions[0][0][2] == "trials" and decisions[1] == decisions[0]
        choice = decisions[0][0][1]
        assert choice in ("megatron", 1, 2, 4, 8)
        if choice != "megatron":
            check_exact([results[rank] for rank in group], choice)
        else:
            assert all(results[rank]["route"] == ("megatron", AUTO_CHOSE_MEGATRON) for rank in group)
            assert all(results[rank]["out"] == 0.0 and results[rank]["x_grad"] == 0.0 for rank in group)


@newest_only  # auto's agreement over the group: coc-inject's own logic (the layer's API: the cases above)
def test_auto_gives_the_layer_back_to_megatron_when_one_ranks_pieces_are_slow(pool):
    results = pool.run("tests.moe.moe_cases:auto_case", slow_ranks=(1, 3), ep=2, experts=4)  # one rank of each group
    assert all(r["decisions"][0][1] == "megatron" for r in results), [r["decisions"] for r in results]
    assert all(r["route"] == ("megatron", AUTO_CHOSE_MEGATRON) for r in results)
    assert all(r["out"] == 0.0 and r["x_grad"] == 0.0 and r["param_grad"] == 0.0 for r in results)


@not_on_oldest
def test_auto_with_expert_tensor_parallelism_decides_alike_across_the_expert_tp_group(pool):
    """EP 2 x expert TP 2 on 4 ranks: the pieces also run collectives over the expert-TP group, so the
    decision is agreed over expert TP x EP, not per EP group (one rank's slow trials decide for all 4)."""
    results = pool.run("tests.moe.moe_cases:auto_case", slow_ranks=(1,), ep=2, experts=4, etp=2)
    assert all(r["decisions"] == results[0]["decisions"] for r in results), [r["decisions"] for r in results]
    assert all(r["decisions"][0][1] == "megatron" for r in results), [r["decisions"] for r in results]
    assert all(r["route"] == ("megatron", AUTO_CHOSE_MEGATRON) for r in results)


@newest_only  # auto's keys: coc-inject's own logic
def test_auto_decides_once_when_the_ranks_of_a_group_hold_other_token_counts(pool):
    """Rank 0's first call holds fewer tokens than its EP peer's (another sequence length on another
    data-parallel rank), its second as many: a key per token count would be new on rank 0 only at the
    second call, its trials' collectives alone (a hang). One decision per layer shape, at the first call."""
    tokens = [[16, 24, 8], [24, 24, 24], [24, 16, 24], [24, 24, 24]]
    results = pool.run("tests.moe.moe_cases:ragged_auto_case", tokens_by_rank=tokens)
    for group in ((0, 1), (2, 3)):
        decisions = [results[rank]["decisions"] for rank in group]
        assert len(decisions[0]) == 1 and decisions[1] == decisions[0], decisions
        assert "any tokens" in decisions[0][0][0]
        assert results[group[0]]["routes"] == results[group[1]]["routes"]


_references: dict = {}


def assert_same_training(got, want, tolerance=1e-6):
    for rank, (g, w) in enumerate(zip(got, want)):
        for step, (a, b) in enumerate(zip(g["losses"], w["losses"])):
            assert abs(a - b) <= tolerance * abs(b), f"rank {rank} step {step}: loss {a} vs {b}"
        for name, value in w["params"].items():
            diff = (g["params"][name] - value).abs().max().item()
            assert diff <= tolerance * max(1.0, value.abs().max().item()), f"rank {rank} {name}: max diff {diff}"


def train(pool, coc, reference_coc=None, **model):
    """``coc`` against the same training with ``reference_coc`` (default: coc-inject off)."""
    key = repr((sorted(model.items()), reference_coc))
    if key not in _references:
        _references[key] = pool.run("tests.moe.moe_cases:train_gpt", coc=reference_coc, **model)
    got = pool.run("tests.moe.moe_cases:train_gpt", coc=coc, **model)
    assert_same_training(got, _references[key])
    return got


@pytest.mark.parametrize("model", [
    {"ep": 2}, {"ep": 4, "experts": 8}, {"ep": 2, "tp": 2, "etp": 1, "sp": True}, {"ep": 2, "tp": 2, "etp": 2, "sp": True},
    {"ep": 2, "recompute_granularity": "selective", "recompute_modules": ["moe"]},
    {"ep": 2, "moe_shared_expert_intermediate_size": 32},
    {"ep": 2, "moe_aux_loss_coeff": 0.01, "moe_router_load_balancing_type": "aux_loss"},
    pytest.param({"ep": 2, "add_bias_linear": True}, marks=newest_only),  # 0.13: "Bias is not supported for MoE"
], ids=["ep2", "ep4", "ep2-tp2-sp", "ep2-etp2-sp", "recompute", "shared-expert", "aux-loss", "biases"])
def test_gpt_trains_as_megatron(pool, model):
    got = train(pool, {"moe_overlap": "1"}, **model)
    pieces = 4 if model.get("experts", 4) // model["ep"] == 2 else 8
    assert all(in_pieces(r["routes"], pieces) for r in got), got[0]["routes"]


def test_what_the_pieces_do_not_run_goes_to_megatron_with_its_reason(pool):
    reasons = pool.run("tests.moe.moe_cases:refusal_reasons")[0]
    assert reasons.pop("alltoall + SequentialMLP") is None
    expected = {
        "EP 1": "expert parallelism 1", "allgather": "allgather dispatcher",
        "moe_permute_fusion": "moe_permute_fusion", "overlap_moe_expert_parallel_comm": "coc-inject steps aside",
        "moe_shared_expert_overlap": "moe_shared_expert_overlap", "moe_pad_expert_input_to_capacity": "capacity",
        "fp8": "FP8", "delay_wgrad_compute": "delay_wgrad_compute",
        "other experts": "InferenceGroupedMLP experts: pieces need", "TE op fuser": "TEGroupedMLP's fused path",
        "flex": "flex dispatcher (DeepEP",
    }
    # not fields before 0.14 (overlap_moe_expert_parallel_comm) and 0.13 (delay_wgrad_compute); TEGroupedMLP built
    # by its 0.17+ builder only
    assert set(expected) - set(reasons) <= {"overlap_moe_expert_parallel_comm", "delay_wgrad_compute", "TE op fuser"}
    expected = {case: words for case, words in expected.items() if case in reasons}
    assert sorted(reasons) == sorted(expected)
    for case, words in expected.items():
        assert words in reasons[case], (case, reasons[case])


def test_a_refused_layer_runs_megatrons_dispatcher_and_says_why(pool):
    results = run(pool, ep=2, experts=4, moe_token_dispatcher_type="allgather")
    for r in results:
        assert r["route"][0] == "megatron" and "allgather dispatcher" in r["route"][1]
        assert r["out"] == 0.0 and r["x_grad"] == 0.0 and r["param_grad"] == 0.0


@pytest.mark.parametrize("experts", [4, pytest.param(2, marks=not_on_oldest)], ids=["2local", "1local"])
def test_expert_tensor_parallelism(pool, experts):
    """EP 2 x expert TP 2: each piece's all-to-all, then the all-gather over the expert-TP group; the
    combine's reduce-scatter, then its all-to-all."""
    results = run(pool, ep=2, etp=2, experts=experts)
    local = experts // 2
    check_exact(results, -(-8 // local))


def test_multi_copy_runs_blocks_of_moe_layers_as_copies_their_pieces_inside_each(pool):
    """A block with MoE layers runs as copies (each copy's dispatcher state its own), its MoE layers in
    pieces inside each copy, the same training as coc-inject off (tests/multi_copy/test_multi_copy_moe.py:
    each routing loss)."""
    got = train(pool, {"moe_overlap": "1", "multi_copy": 2}, ep=2)
    for r in got:
        assert r["blocks"] == [None], r["blocks"]
        assert in_pieces(r["routes"], 4), r["routes"]


@pytest.mark.parametrize("coc,reference,model,pieces", [
    ({"moe_overlap": "1", "parallel_num": 4}, None, {"ep": 2, "tp": 2, "sp": True}, 4),
    ({"moe_overlap": "auto", "parallel_num": AUTO}, None, {"ep": 2, "tp": 2, "sp": True}, None),
    ({"moe_overlap": "1", "cp_algo": "ring"}, {"cp_algo": "ring"}, {"ep": 2, "cp": 2}, 4),
], ids=["coc-linears", "both-auto", "context-parallel"])
def test_composes_with_the_other_wings(pool, coc, reference, model, pieces):
    """TP x EP with CoC's chunked (and auto) linears around the MoE layers; CP x EP with coc-inject's ring
    attention (Megatron's local attention refuses CP > 1: the reference runs the ring too)."""
    got = train(pool, coc, reference, **model)
    for r in got:
        routes = [route for route in r["routes"] if route != ("megatron", AUTO_CHOSE_MEGATRON)]
        assert r["routes"] and (in_pieces(routes, pieces) or not routes), r["routes"]


@pytest.mark.parametrize("fused", [False, True], ids=["bf16", "bf16-fused-wgrad"])
def test_the_pieces_backward_holds_at_most_one_fp32_experts_gradient_beyond_megatrons(pool, fused):
    """Peak CPU memory allocated through an MoE layer's backward (torch's profiler, every allocation; bf16
    weights, 4 local experts, 2 pieces each): the pieces' at most Megatron's own + one local expert's gradient
    in fp32. Before, every local expert's gradient was held in fp32 at once (a copy of the fused-accumulation
    placeholder with ``gradient_accumulation_fusion``), and each later piece allocated a new sum. The
    gradients (``main_grad`` with fused accumulation) as Megatron's: bf16 within the grouped pieces' bound."""
    results = pool.run("tests.moe.memory_cases:backward_peak_case", fused=fused)
    for rank, r in enumerate(results):
        assert r["pieces"] == 8 and r["local_experts"] == 4 and r["same_params"], r
        assert (r["fused_calls"] > 0) == fused
        one_fp32_expert = 4 * r["expert_numel"]
        assert r["pieces_peak"] <= r["off_peak"] + one_fp32_expert, (rank, r["pieces_peak"], r["off_peak"],
                                                                     one_fp32_expert)
        bound = 1e-5 if fused else 2.0 ** -6  # main_grad in fp32; bf16: test_moe_grouped.BF16_BOUND
        assert r["grad_diff"] <= bound * max(1.0, r["grad_scale"]), (rank, r["grad_diff"], r["grad_scale"])
        assert r["x_grad_diff"] <= 2.0 ** -6 * max(1.0, r["x_grad_scale"]), (rank, r["x_grad_diff"])


def test_a_megatron_bridge_like_provider_runs_every_wing(pool):
    """A GPT whose config is a Megatron-Bridge-like provider (tests/settings/bridge_like.py: a TransformerConfig
    subclass with seq_length, vocab_size, generation_config, ... set off their defaults), TP 2 SP x EP 2: the
    linears' chunks, the batch copies and the MoE pieces all run (before, each stepped aside naming the first
    provider field), and it trains as coc-inject off on Megatron's own TransformerConfig (within 1e-6).
    Every wing's allow-list, the CP attention's included: tests/settings/test_config_subclasses.py."""
    from tests.settings.bridge_like import PROVIDER_SETTINGS

    model = {"ep": 2, "tp": 2, "sp": True}
    key = repr((sorted(model.items()), None))  # the reference test_composes_with_the_other_wings shares
    if key not in _references:
        _references[key] = pool.run("tests.moe.moe_cases:train_gpt", coc=None, **model)
    got = pool.run("tests.moe.moe_cases:train_gpt", coc={"moe_overlap": "1", "parallel_num": 4, "multi_copy": 2},
                   config_class="tests.settings.bridge_like:GPTProviderLike", **PROVIDER_SETTINGS, **model)
    assert_same_training(got, _references[key])
    for r in got:
        assert r["config_class"] == "GPTProviderLike"
        assert r["linear_calls"] > 0 and r["blocks"] == [None], (r["linear_calls"], r["blocks"])
        assert in_pieces(r["routes"], 4), r["routes"]


def test_pieces_step_aside_under_autocast_naming_it(pool):
    # Megatron's enable_autocast (CPU torch.autocast in bf16 here): the pieces are not verified under it.
    from coc_inject.moe.guards import AUTOCAST

    for rank, r in enumerate(run(pool, ep=2, experts=4, topk=2, autocast=True)):
        assert r["route"] == ("megatron", AUTOCAST), (rank, r["route"])
        assert r["out"] == 0 and r["x_grad"] == 0 and r["param_grad"] == 0, (rank, r)
