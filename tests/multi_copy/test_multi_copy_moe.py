"""Multi-copy parallel through MoE layers (tests/multi_copy/moe_copies_cases.py): a real megatron-core MoE
GPT, TP 2 with SP x EP 2 on 4 gloo ranks, 2 copies against the same model without copies, each routing
loss, with and without COC_MOE_OVERLAP=1: losses and parameters after 3 SGD steps within 1e-5 (fp32), the
aux-loss tracker's values (summed over the TP group, as Megatron reduces them before logging) and the
expert bias within 1e-5, every collective in the same order on every rank; what does not decompose runs
Megatron's block with its reason."""

import pytest

from tests.context_parallel.test_cp_gpt import pool  # noqa: F401 - a fixture (4 ranks, per module)
from coc_inject.routes import copies_of
from tests.scope import newest_only

CASE = "tests.multi_copy.moe_copies_cases:train"
TOL = 1e-5
_references: dict = {}


def reference(pool, **kwargs):
    key = repr(sorted(kwargs.items()))
    if key not in _references:
        _references[key] = pool.run(CASE, copies=1, **kwargs)
    return _references[key]


def _tp_summed(results, step, name):
    return [sum(results[r]["tracker"][step][name] for r in group) for group in ((0, 1), (2, 3))]


def differences(got, want) -> dict:
    """The largest differences: losses (relative), parameters (relative to their largest), the tracker's
    values summed over each TP group, the expert bias."""
    out = {"loss": 0.0, "params": 0.0, "tracker": 0.0, "expert_bias": 0.0}
    for g, w in zip(got, want):
        out["loss"] = max([out["loss"]] + [abs(a - b) / abs(b) for a, b in zip(g["losses"], w["losses"])])
        for name, value in w["params"].items():
            out["params"] = max(out["params"], ((g["params"][name] - value).abs().max() / value.abs().max()).item())
        for mine, theirs in zip(g["expert_bias"], w["expert_bias"]):
            out["expert_bias"] = max([out["expert_bias"]] + [(a - b).abs().max().item() for a, b in zip(mine, theirs)])
    for step, values in enumerate(want[0]["tracker"]):
        for name in values:
            for a, b in zip(_tp_summed(got, step, name), _tp_summed(want, step, name)):
                out["tracker"] = max(out["tracker"], ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item())
    return out


def normalised(calls):
    """A rank's collectives with each group named by its size and stride (TP: stride 1, EP: stride 2 here),
    an all-to-all's shape left out (its rows are the routing's, different per rank)."""
    out = []
    for op, ranks, shape, copy, deferred in calls:
        group = ranks if ranks == "world" else (len(ranks), ranks[1] - ranks[0] if len(ranks) > 1 else 0)
        out.append((op, group, None if op == "all_to_all_single" else shape, copy, deferred))
    return out


def run(pool, routing, moe_overlap="0", b=4, record=False, **model):
    want = reference(pool, routing=routing, moe_overlap=moe_overlap, b=b, **model)
    got = pool.run(CASE, copies=2, routing=routing, moe_overlap=moe_overlap, b=b, record=record, **model)
    assert all(r["blocks"] == [(2, None)] for r in got), [r["blocks"] for r in got]
    if moe_overlap != "0":
        assert all(r["moe_routes"] and set(r["moe_routes"]) == {("pieces", 4)} for r in got), \
            [r["moe_routes"] for r in got]
    diff = differences(got, want)
    assert all(value <= TOL for value in diff.values()), diff
    # the copies' backward from one thread (a call from another raises); the pieces' experts add calls
    assert all(r["autograd_calls"] >= 3 for r in got)
    return got, want


def _router_forms_each_loss_apart() -> bool:
    """megatron-core 0.16+ (TopKRouter._apply_aux_loss); 0.13 to 0.15 run such blocks without copies."""
    from megatron.core.transformer.moe.router import TopKRouter

    return hasattr(TopKRouter, "_apply_aux_loss")


@pytest.mark.parametrize("moe_overlap", ["0", "1"])
@pytest.mark.parametrize("routing", ["aux_loss", "seq_aux_loss", "z_loss", "expert_bias"])
def test_each_routing_loss_trains_like_no_copies(pool, routing, moe_overlap):
    if not _router_forms_each_loss_apart():
        pytest.skip("this megatron-core's router forms every loss in one method: such blocks run without copies")
    got, want = run(pool, routing, moe_overlap)
    if routing == "expert_bias":  # the bias moved, and the counts behind it are every copy's
        assert all((bias != 0).any() for bias in got[0]["expert_bias"][-1])
        for g, w in zip(got, want):
            assert all((a == b).all() for step_g, step_w in zip(g["tokens_per_expert"], w["tokens_per_expert"])
                       for a, b in zip(step_g, step_w))
    else:
        name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}.get(routing, routing)
        assert all(float(r["tracker"][0][name].abs().sum()) > 0 for r in got)  # logged, and compared above


@newest_only
@pytest.mark.parametrize("b", [4, 1], ids=["batch-split", "sequence-split"])
def test_every_routing_loss_at_once_and_the_collectives_in_one_order_on_every_rank(pool, b):
    """aux_loss and seq_aux_loss together with the z-loss, pieces inside each copy; micro-batch 1: the
    copies split the sequence (seq_aux_loss then combines each sequence's counts over the copies)."""
    got, _ = run(pool, "all", "1", b=b, record=True)
    first = normalised(got[0]["collectives"])
    assert first.count(None) == 0 and any(call[0] == "all_to_all_single" and call[3] == 1 for call in first)
    for rank, result in enumerate(got[1:], start=1):
        assert normalised(result["collectives"]) == first, f"rank {rank} issued its collectives in another order"


@newest_only
def test_the_losses_formed_per_copy_alone_would_differ(pool):
    """The tests can fail: with each copy's routing losses formed as Megatron forms them for one batch
    (no combined counts, no weights), the training or the logged losses differ beyond the tolerance."""
    want = reference(pool, routing="all", moe_overlap="0", b=4)
    got = pool.run(CASE, copies=2, routing="all", moe_overlap="0", b=4, per_copy_losses=True)
    diff = differences(got, want)
    assert diff["tracker"] > 100 * TOL and diff["params"] > TOL, diff


def _chunks_mlps_for_training() -> bool:
    """megatron-core 0.19+: TransformerLayer calls its MLP once per chunk of the sequence."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "mlp_chunks_for_training" in TransformerConfig.__dataclass_fields__


@newest_only
def test_chunked_mlps_meet_chunk_by_chunk_or_name_the_setting(pool):
    """Issue 51 item 2: with mlp_chunks_for_training=2 each copy reaches its routers' meetings once per
    chunk. Batch copies: copy c's i-th arrival meets the other copy's i-th (the copies' samples of
    Megatron's chunk i), the lm loss, the batch and sequence aux losses, the z-loss and the logged values as
    without copies (before: the second chunk met the other copy's first-chunk counts, load-balancing
    loss 4.0682 against 4.0637). Sequence copies (micro-batch 1) hold other positions in their chunks than
    Megatron's: the block runs Megatron's, naming the setting; without a load-balancing loss (the
    z-loss, a mean over tokens) they run, exact."""
    if not _router_forms_each_loss_apart() or not _chunks_mlps_for_training():
        pytest.skip("this megatron-core has no mlp_chunks_for_training")
    got, _ = run(pool, "all", "0", mlp_chunks_for_training=2)
    assert all(float(r["tracker"][0]["load_balancing_loss"].abs().sum()) > 0 for r in got)
    refused = pool.run(CASE, copies=2, routing="all", b=1, steps=1, mlp_chunks_for_training=2)
    reason = "mlp_chunks_for_training=2 is refused by sequence copies: chunked MLPs with an MoE load-balancing loss"
    assert all(r["blocks"] == [(1, r["blocks"][0][1])] and reason in r["blocks"][0][1] for r in refused), \
        [r["blocks"] for r in refused]
    run(pool, "z_loss", "0", b=1, mlp_chunks_for_training=2)


# Every recompute form megatron-core offers an MoE GPT here, each with every routing loss it may take
# under copies (moe_act needs grouped GEMM experts, which cannot be built on the CPU; it steps aside as
# layernorm does: recompute.reason).
SELECTIVE = dict(recompute_granularity="selective")
FULL = dict(recompute_granularity="full", recompute_num_layers=1)
RECOMPUTE = {
    # issue 41's reproduction: TP 2 SP x EP 2, 1 layer, full uniform recompute; the recomputed chunk's
    # copies shared Megatron's dispatcher (gloo stopped in alltoallv; NCCL trained silently wrong)
    "full-uniform": (dict(FULL, recompute_method="uniform", layers=1), "every_but_aux_loss", "0"),
    # the batch aux_loss too: the recomputed chunks' copies meet as the forward's do
    "full-block": (dict(FULL, recompute_method="block"), "every", "1"),
    # Megatron's checkpoint of the whole MoE layer, recomputed inside the copies' backward (the copies'
    # forward took it for a chunk of layers: "backward through the graph a second time"; then alltoallv)
    "selective-moe": (dict(SELECTIVE, recompute_modules=["moe"]), "every_but_aux_loss", "1"),
    "selective-sub-layers": (dict(SELECTIVE, recompute_modules=["core_attn", "mlp", "shared_experts"],
                                  moe_shared_expert_intermediate_size=32), "every", "0"),
}  # layernorm: test_what_does_not_decompose_runs_megatrons_block_with_the_reason


@newest_only
@pytest.mark.parametrize("form", list(RECOMPUTE))
def test_every_recompute_form_trains_like_no_copies(pool, form):
    """Full recompute's chunks are recomputed as copies in the forward's own scope (each MoE layer's
    dispatcher per copy, the routing losses formed per copy, the copies meeting for the batch
    aux_loss); any other checkpoint runs Megatron's inside the copies' backward: every routing loss
    and the expert bias as without copies, every rank's collectives in one order."""
    model, routing, moe_overlap = RECOMPUTE[form]
    got, _ = run(pool, routing, moe_overlap, record=True, **model)
    first = normalised(got[0]["collectives"])
    assert any(call[0] == "all_to_all_single" for call in first)
    for rank, result in enumerate(got[1:], start=1):
        assert normalised(result["collectives"]) == first, f"rank {rank} issued its collectives in another order"
    assert all((bias != 0).any() for bias in got[0]["expert_bias"][-1])


@newest_only
@pytest.mark.parametrize("routing,reason,model", [
    ("global_aux_loss", "global_aux_loss (its running token count", {}),
    ("capacity", "moe_expert_capacity_factor=1.0 is refused by multi-copy: a capacity per copy", {}),
    ("aux_loss", "the batch aux_loss under Megatron's own recompute (selective 'moe'",
     dict(SELECTIVE, recompute_modules=["moe"])),
    ("every", "selective recompute of layernorm (Megatron keeps each call's output-discarding checkpoint",
     dict(SELECTIVE, recompute_modules=["core_attn", "layernorm"])),
])
def test_what_does_not_decompose_runs_megatrons_block_with_the_reason(pool, routing, reason, model):
    got = pool.run(CASE, copies=2, routing=routing, steps=1, **model)
    assert all(len(r["blocks"]) == 1 and r["blocks"][0][0] == 1 and reason in r["blocks"][0][1] for r in got), \
        [r["blocks"] for r in got]


@newest_only
def test_each_layer_holds_megatrons_dispatcher_after_the_copies(pool):
    got = pool.run("tests.multi_copy.moe_copies_cases:dispatcher_left_as_found")
    assert all(r["same"] and r["classes"] == ["MoEAlltoAllTokenDispatcher"] and r["blocks"] == [2] for r in got), got


@newest_only
def test_auto_tries_moe_copies_alike_on_every_rank_and_leaves_the_routers_as_found(pool):
    """COC_MULTI_COPY=auto with COC_MOE_OVERLAP=auto: the MoE block's trials (forward and backward on a
    detached input, the pieces' own trials inside) agree over TP x DP x CP, every rank its all-to-alls
    reach; the training, the logged losses and the expert bias equal no copies (the trials' routing left
    no count or logged loss behind)."""
    want = reference(pool, routing="all", moe_overlap="auto", b=4)
    got = pool.run(CASE, copies="auto", routing="all", moe_overlap="auto", b=4)
    decisions = [r["decisions"] for r in got]
    assert len(decisions[0]) == 1 and all(d == decisions[0] for d in decisions), decisions
    choice = decisions[0][0][1]
    assert all(r["blocks"] == [(copies_of(choice), None if choice != 1 else "auto: no copies were faster for this shape")]
               for r in got), [r["blocks"] for r in got]
    diff = differences(got, want)
    assert all(value <= TOL for value in diff.values()), diff


@newest_only
def test_copies_with_tuned_pieces_run_megatrons_dispatcher_where_their_trials_are_faster(pool):
    """#44 item 4: COC_MULTI_COPY=2 + COC_MOE_OVERLAP=auto: the block's trials also try the copies with
    Megatron's dispatcher inside; one rank's slower trials with the pieces decide it for every rank its
    all-to-alls reach (MAX over TP x DP x CP); the MoE layers then run Megatron's dispatcher inside the
    copies with the reason, and train as without copies."""
    from coc_inject.routes import COPIES_CHOSE_DISPATCHER, Inner, inside

    want = reference(pool, routing="aux_loss", moe_overlap="auto", b=4)
    got = pool.run("tests.multi_copy.moe_copies_cases:train_inner_choice", routing="aux_loss", b=4)
    assert all([choice for _, choice in r["decisions"]] == [inside(2, Inner(experts=False))] for r in got), \
        [r["decisions"] for r in got]
    assert all(r["blocks"] == [(2, None)] for r in got), [r["blocks"] for r in got]
    assert all(r["moe_routes"] and set(r["moe_routes"]) == {("megatron", COPIES_CHOSE_DISPATCHER)} for r in got), \
        [r["moe_routes"] for r in got]
    diff = differences(got, want)
    assert all(value <= TOL for value in diff.values()), diff


@newest_only
def test_the_copies_trials_through_the_pieces_under_megatrons_gpu_defaults(pool):
    """Issue 41: COC_MULTI_COPY=2 COC_PARALLEL_NUM=auto COC_MOE_OVERLAP=1 under fused wgrad accumulation and
    Megatron's DDP (tests/gpu_defaults): the block's trials run the copies' backward through the pieces,
    whose experts' backward accumulated into parameters whose main_grad the trial had taken off
    ("'Parameter' object has no attribute 'main_grad'" in DDP's hook). Trains as without coc-inject,
    the trials leaving main_grad and DDP's buckets as found."""
    from coc_inject.config import AUTO
    from tests.gpu_defaults.test_gpu_defaults import assert_same

    case = "tests.gpu_defaults.gpu_defaults_cases:train"
    want = pool.run(case, kind="moe", ep=2)
    got = pool.run(case, coc={"multi_copy": 2, "parallel_num": AUTO, "moe_overlap": "1"}, kind="moe", ep=2)
    assert all(any("multi-copy" in d for d in r["decisions"]) for r in got), [r["decisions"] for r in got]
    assert_same(got, want, "fp32")
