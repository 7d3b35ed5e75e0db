"""Multi-copy parallel (COC_MULTI_COPY) on a real megatron-core GPT, 4 gloo ranks: the same training
as without copies (losses and parameters after 3 SGD steps within 1e-5 relative, fp32, dropout 0)
at TP 2 and 4 with and without sequence parallelism, with CoC's chunked linears, with context
parallelism, with recompute; every collective in the same order on every rank; the calls copies
cannot run exactly run Megatron's block with the reason."""

import pytest

from coc_inject.config import AUTO
from tests.scope import newest_only
from tests.context_parallel.test_cp_gpt import assert_same_training, pool  # noqa: F401 - pool: a fixture (4 ranks, per module)


_references: dict = {}


def reference(pool, **kwargs):
    key = repr(sorted(kwargs.items()))
    if key not in _references:
        _references[key] = pool.run("tests.multi_copy.multi_copy_cases:train", copies=1, **kwargs)
    return _references[key]


def run(pool, want_routes=((2, None),), copies=2, **kwargs):
    got = pool.run("tests.multi_copy.multi_copy_cases:train", copies=copies, **kwargs)
    assert all(r["routes"] == [tuple(route) for route in want_routes] for r in got), [r["routes"] for r in got]
    options = {k: v for k, v in kwargs.items() if k not in ("chunks", "record", "poison")}  # the same reference
    assert_same_training(got, reference(pool, **options))
    return got


@pytest.mark.parametrize("sp", [False, True])
def test_copies_train_like_no_copies(pool, sp):  # TP 4: the collective-order tests below
    run(pool, tp=2, sp=sp, b=4)


@newest_only
@pytest.mark.parametrize("chunks", [4, AUTO])
def test_with_coc_chunked_linears(pool, chunks):
    """Poisoned: a collective left in flight reads NaN until its wait. With 4 chunks no re-gather is
    issued ahead at a band's start (segments.py: it would queue ahead of CoC's row linear's chunked
    all-gathers in the same band); the chunked column linear issues its own ahead of its dgrad chunks."""
    got = run(pool, tp=2, sp=True, b=4, chunks=chunks, poison=True)
    if chunks == 4:
        assert all(r["gathers_served"] == 0 for r in got), [r["gathers_served"] for r in got]


@newest_only
def test_copies_with_tuned_linears_run_megatrons_linears_where_their_trials_are_faster(pool):
    """COC_MULTI_COPY=2 + COC_PARALLEL_NUM=auto: the block's trials decide whether the copies' linears
    chunk; one rank's slower chunked trials decide it for its group (MAX over ranks)."""
    from coc_inject.routes import COPIES_CHOSE_MEGATRON, Inner, inside

    got = pool.run("tests.multi_copy.multi_copy_cases:train_linears_choice", tp=2, sp=True, b=4)
    assert all(r["decisions"] == [inside(2, Inner(linears=False))] and r["routes"] == [(2, None)] for r in got), got[0]["decisions"]
    assert all(COPIES_CHOSE_MEGATRON in r["megatron_reasons"] for r in got), [r["megatron_reasons"] for r in got]
    assert_same_training(got, reference(pool, tp=2, sp=True, b=4))


@newest_only
def test_with_fused_kernels(pool):
    """USE_COC_FUSED_KERNEL=1 (symm_mem through fake CPU kernels): each copy's linears run the fused
    kernel: the block's calls double; the output layer's, one per step outside the block, do not."""
    want = pool.run("tests.multi_copy.multi_copy_cases:train_fused", copies=1, tp=2, sp=True, b=4)
    got = pool.run("tests.multi_copy.multi_copy_cases:train_fused", copies=2, tp=2, sp=True, b=4)
    assert all(r["routes"] == [(2, None)] for r in got), [r["routes"] for r in got]
    steps = len(want[0]["losses"])  # the output layer's fused call, once per step
    assert all(w["fused_calls"] > steps and g["fused_calls"] - steps == 2 * (w["fused_calls"] - steps)
               for g, w in zip(got, want)), [(g["fused_calls"], w["fused_calls"]) for g, w in zip(got, want)]
    assert_same_training(got, want)


@newest_only
def test_with_selective_recompute(pool):
    """Selective recompute keeps the cuts: the backward overlaps; every rank's collectives in one order."""
    got = run(pool, tp=2, sp=True, b=4, recompute_granularity="selective", recompute_modules=["core_attn"],
              record=True)
    assert all(r["backward_in_turn"] == [] for r in got), got[0]["backward_in_turn"]
    first = [(op, shape, copy, deferred) for op, _, shape, copy, deferred in got[0]["collectives"]]
    assert all([(op, shape, copy, deferred) for op, _, shape, copy, deferred in r["collectives"]] == first
               for r in got[1:])


@newest_only
def test_selective_recompute_of_layernorm_runs_megatrons_block_with_the_reason(pool):
    """Megatron keeps each call's output-discarding checkpoint on the layer from the norm to its discard,
    after the attention's collectives: the copies' turns would swap them (moe_act, mla_up_proj alike)."""
    got = pool.run("tests.multi_copy.multi_copy_cases:train", copies=2, tp=2, sp=True, b=4, steps=1,
                   recompute_granularity="selective", recompute_modules=["core_attn", "layernorm"])
    why = "selective recompute of layernorm (Megatron keeps each call's output-discarding checkpoint on the module"
    assert all(len(r["routes"]) == 1 and r["routes"][0][0] == 1 and r["routes"][0][1].startswith(why)
               for r in got), [r["routes"] for r in got]


def test_selective_recompute_off_the_allow_list_is_a_reason():
    """Only core_attn, moe and shared_experts run as copies (issue 41: the copies took any checkpoint for a
    chunk of layers; "backward through the graph a second time" under mlp); mlp only where a layer
    checkpoints a dense MLP (Megatron's MoE layers ignore it)."""
    from types import SimpleNamespace as Fake

    from coc_inject.multi_copy import recompute

    def block(modules, dense=True, granularity="selective"):
        return Fake(config=Fake(recompute_granularity=granularity, recompute_modules=modules),
                    layers=[Fake(recompute_mlp=dense and "mlp" in modules)])

    assert recompute.reason(block(["core_attn", "moe", "shared_experts"])) is None
    assert recompute.reason(block(["mlp"], granularity="full")) is None
    assert recompute.reason(block(["core_attn", "mlp"], dense=False)) is None
    assert recompute.reason(block(["core_attn", "mlp"])).startswith("selective recompute of mlp (the dense MLP's")
    for module in ("layernorm", "moe_act", "mla_up_proj"):
        assert "output-discarding checkpoint" in recompute.reason(block([module]))
    assert "allow-list" in recompute.reason(block(["some_new_module"]))


def phases(call: list, in_backward: list) -> list:
    """A block call's collectives cut where they pass between the copies' forward on threads (the
    block's, a chunk's recomputed forward) and their backward from one thread."""
    runs = []
    for record, backward in zip(call, in_backward):
        if not runs or runs[-1][0] != backward:
            runs.append((backward, []))
        runs[-1][1].append(record)
    return runs


@pytest.mark.parametrize("method,layers", [("uniform", 1), pytest.param("block", 1, marks=newest_only),
                                           pytest.param("uniform", 2, marks=newest_only)])
def test_full_recompute_runs_the_recomputed_forward_as_copies_and_the_backward_in_bands(pool, method, layers):
    """Full recompute (3 layers, TP 2 SP): each chunk's forward is recomputed as copies taking turns,
    its cuts recorded, and its backward runs in bands like a block without recompute: training as
    without copies (poison on: no collective read before its wait), every rank's collectives in the
    same order, each stretch in the copies' interleave; no reason to run the backward in turn."""
    got = run(pool, tp=2, sp=True, b=4, layers=3, recompute_granularity="full", recompute_method=method,
              recompute_num_layers=layers, record=True, poison=True)
    assert all(r["backward_in_turn"] == [] for r in got), got[0]["backward_in_turn"]
    def relative(records):  # TP 2 in a world of 4: each rank's groups, named by their ranks' offsets
        return [(op, ranks if ranks == "world" else tuple(r - min(ranks) for r in ranks), *rest)
                for op, ranks, *rest in records]

    first, flags = got[0]["collectives"], got[0]["in_backward"]
    for rank, result in enumerate(got[1:], start=1):
        assert relative(result["collectives"]) == relative(first), f"rank {rank} issued its collectives in another order"
        assert result["in_backward"] == flags
    chunks = {"uniform": -(-3 // layers), "block": layers}[method]
    backward_steps, position = 0, 0
    for call in block_calls(first):
        start = first.index(call[0], position)
        position = start + len(call)
        runs = phases(call, flags[start:position])
        for backward, records in runs:
            assert records == interleaved(records), records
            if backward:  # every layer's linears cut the copies' backward: deferred collectives in turns
                deferred = [r[3] for r in records if r[4]]
                assert deferred and deferred == [0, 1] * (len(deferred) // 2), records
        if any(backward for backward, _ in runs):  # per chunk its forward again (threads), then its bands
            backward_steps += 1
            assert [b for b, _ in runs][-2 * chunks:] == [False, True] * chunks, [(b, len(r)) for b, r in runs]
    assert backward_steps == 3
    assert all(r["gathers_served"] == 3 * 3 * 2 * 2 for r in got), [r["gathers_served"] for r in got]


def test_full_recompute_on_two_ranks(pool2):
    """TP 2 SP on a world of 2: full recompute (uniform, 1 layer a chunk) with copies trains as without."""
    options = dict(tp=2, sp=True, b=4, layers=2, recompute_granularity="full", recompute_method="uniform",
                   recompute_num_layers=1)
    want = pool2.run("tests.multi_copy.multi_copy_cases:train", copies=1, **options)
    got = pool2.run("tests.multi_copy.multi_copy_cases:train", copies=2, poison=True, **options)
    assert all(r["routes"] == [(2, None)] and r["backward_in_turn"] == [] for r in got), got[0]["routes"]
    assert_same_training(got, want)


@newest_only
def test_with_context_parallel_ring(pool):
    run(pool, tp=2, cp=2, coc={"cp_algo": "ring"}, sp=True, b=4)


@newest_only
def test_copies_inside_each_pipeline_stage(pool):
    """TP 2 x PP 2: stage 0's block splits its embedding output, stage 1's the input tensor Megatron
    hands it; the stages exchange the joined activations and gradients."""
    want = pool.run("tests.multi_copy.multi_copy_cases:train_pipeline", copies=1)
    got = pool.run("tests.multi_copy.multi_copy_cases:train_pipeline", copies=2)
    assert all(r["routes"] == [(2, None)] for r in got), [r["routes"] for r in got]
    assert sorted(r["first_stage"] for r in got) == [False, False, True, True]
    assert all(loss > 0 for r in got if not r["first_stage"] for loss in r["losses"])
    assert_same_training(got, want)


def interleaved(records: list) -> list:
    """The order the copies' turns give ``records`` (one block call's collectives, each (op, ranks,
    shape, copy, deferred)): each copy's collectives in segments -- in the forward a segment ends at
    each collective (its wait hands the turn on), in the backward at each collective left in flight
    -- and segment j of copy 0, then of copy 1, ..."""
    backward = any(record[4] for record in records)
    segments: dict = {}
    for record in records:
        mine = segments.setdefault(record[3], [[]])
        mine[-1].append(record)
        if record[4] or not backward:
            mine.append([])
    longest = max(len(s) for s in segments.values())
    return [record for j in range(longest) for copy in sorted(segments)
            for record in (segments[copy][j] if j < len(segments[copy]) else [])]


def block_calls(log: list) -> list:
    """The runs of consecutive collectives issued inside copies."""
    calls, current = [], []
    for record in log + [(None, None, None, None, False)]:
        if record[3] is not None:
            current.append(record)
        elif current:
            calls.append(current)
            current = []
    return calls


def same_block_calls_on_every_rank(got: list) -> tuple[list, list]:
    """Every rank's collectives in one order; rank 0's block calls, and those of them in the backward.
    One block per step for 3 steps: its forward and its backward."""
    first = got[0]["collectives"]
    for rank, result in enumerate(got[1:], start=1):
        assert result["collectives"] == first, f"rank {rank} issued its collectives in another order"
    calls = block_calls(first)
    backward = [call for call in calls if any(record[4] for record in call)]
    assert len(calls) == 2 * 3 and len(backward) == 3, calls
    return calls, backward


@pytest.mark.parametrize("sp", [True, pytest.param(False, marks=newest_only)], ids=["sp", "no-sp"])
def test_every_rank_issues_the_same_collectives_in_the_copies_interleave(pool, sp):
    """TP 4 training as without copies (3 steps), every collective of it in the same order on every
    rank, each block call's in the interleave of the copies' turns."""
    calls, backward = same_block_calls_on_every_rank(run(pool, tp=4, sp=sp, b=4, record=True))
    for call in calls:
        assert call == interleaved(call), call
        assert [r[3] for r in call].count(0) == [r[3] for r in call].count(1) >= 2 * 2  # two layers
    for call in backward:  # each layer's column linears (and with SP the row linears' mappings) end a segment
        assert [r[3] for r in call if r[4]] == [0, 1] * (2 * 2 * (2 if sp else 1)), call


def test_backward_reads_no_collective_before_its_wait(pool):
    """Poison: a collective left in flight reads NaN until its wait. With the cuts' waits the training
    equals no copies; without them (a deliberately broken backward) the NaN reaches the gradients."""
    got = run(pool, tp=2, sp=True, b=4, poison=True)
    assert all(r["autograd_calls"] == 3 for r in got)  # one per step's block backward, on its one thread
    # Every column linear's re-gather of its input (2 layers x 2 linears x 2 copies, 3 steps) was issued
    # ahead and served from there, its buffer NaN until its wait.
    assert all(r["gathers_served"] == 3 * 2 * 2 * 2 for r in got), [r["gathers_served"] for r in got]
    broken = pool.run("tests.multi_copy.multi_copy_cases:train", copies=2, tp=2, sp=True, b=4, steps=1,
                      poison=True, skip_cut_waits=True)
    assert all(any(p.isnan().any() for p in r["params"].values()) for r in broken), "poison was read and not seen"


@newest_only
@pytest.mark.parametrize("b", [1, 3])
def test_a_micro_batch_whose_sequence_cannot_split_either_runs_megatrons_block(pool, b):
    """Micro-batch 1 or 3 with 2 copies splits the sequence (test_sequence_copies.py); with selective
    recompute of the core attention it cannot (the recomputed attention would not reach the earlier
    copy's keys): Megatron's block, with the reason."""
    reason = (f"micro-batch {b} is not divisible by 2 copies, and sequence copies cannot run: "
              "recompute_granularity='selective' is refused by sequence copies: recompute (the recomputed attention "
              "would not reach the earlier copies' keys)")
    run(pool, want_routes=[(1, reason)], tp=2, sp=True, b=b, recompute_granularity="selective")


@newest_only
def test_a_block_call_with_copies_leaves_no_coc_attribute_on_megatrons_objects(pool):
    """What a call found out (its route, whether its copies cut their backward) comes back through the
    call; nothing per call is left on the block or its modules."""
    got = pool.run("tests.multi_copy.block_cases:block_call", copies=2)
    assert all(r["copies"] == 2 and r["reason"] is None for r in got), got
    assert all(r["left"] == [] for r in got), [r["left"] for r in got]


MINDSPEED_CASE = "tests.multi_copy.block_cases:beside_mindspeeds_block_forward"


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recompute"])
def test_copies_run_under_mindspeeds_block_forward_as_off(pool, recompute):
    """Issue 51 item 8: MindSpeed 26.0+ puts its own TransformerBlock.forward in Megatron's place in every job,
    after coc-inject's hook (tests/fakes/mindspeed_te_checkpoint.py restates it; its full recompute's chunks
    too): the block built afterwards reads it as Megatron's and runs 2 copies under it, counted, their backward
    overlapping; output and gradients as without copies under the same forward (fp32, 1e-5 relative), nothing
    reported taken over. (megatron-core 0.19 has no _checkpointed_forward for MindSpeed's to replace.)"""
    from megatron.core.transformer.transformer_block import TransformerBlock

    if recompute and "_checkpointed_forward" not in vars(TransformerBlock):
        pytest.skip("megatron-core 0.19 moved the block's recompute out of TransformerBlock: MindSpeed's patch "
                    "manager cannot put its _checkpointed_forward there")
    want = pool.run(MINDSPEED_CASE, copies=1, recompute=recompute)
    got = pool.run(MINDSPEED_CASE, copies=2, recompute=recompute)
    assert all(w["forward"] == "mindspeed.te.pytorch.module.checkpoint" for w in want)
    for g in got:
        assert g["route"] == (2, None) and g["taken_over"] == {} and g["said"] == [], g
        assert g["in_turn"] is None, g["in_turn"]  # the recompute's chunks (MindSpeed's closure) as copies too
        assert g["forward"] == "coc_inject.multi_copy.forward", g["forward"]
        assert "1 calls (batch split 1)" in g["summary"], g["summary"]
    for g, w in zip(got, want):
        for name, value in [("output", w["output"]), ("grad", w["grad"]), *w["params"].items()]:
            mine = g[name] if name in ("output", "grad") else g["params"][name]
            assert (mine - value).abs().max() <= 1e-5 * value.abs().max(), name


def test_any_other_replacement_of_the_block_forward_steps_aside_naming_it(pool):
    """A block forward of MindSpeed's that coc-inject has not read runs alone: said beside MindSpeed (summary,
    COC_REPORT) and reported taken over, naming it."""
    got = pool.run(MINDSPEED_CASE, copies=2, replacement="unread")
    name = "mindspeed.core.transformer.transformer_block.transformer_block_forward"
    for g in got:
        assert g["forward"] == "mindspeed.core.transformer.transformer_block", g
        assert g["said"] and name in g["said"][0] and "coc-inject steps aside" in g["said"][0], g["said"]
        assert g["taken_over"]["TransformerBlock.forward"]["ours_still_runs"] is False, g["taken_over"]


@pytest.fixture
def own_pool():
    """Four ranks of its own: after this MoE GPT under MindSpeed's recompute stand-ins, the module pool's next
    block call (test_a_torch_whose_autograd_fails...) met a causal mask of another length when
    test_copies_run_under_mindspeeds_block_forward_as_off had run before both: state of the stand-ins left in
    the workers, not yet found (noted on issue 51)."""
    from tests.dist_harness import RankPool

    pool = RankPool(4)
    yield pool
    pool.close()


def test_an_unread_block_recompute_with_the_batch_aux_loss_steps_aside_naming_it(own_pool):
    """Issue 51: MindSpeed's --recompute-method block puts its own _checkpointed_forward on the block
    (tests/fakes/mindspeed_patches.block_recompute: mindspeed.core.memory.common's, restated from Megatron's). Its
    chunks are not recomputed as copies, so an MoE block with the batch aux_loss under full recompute would form
    the loss one copy at a time inside the backward, where the copies cannot meet (it stopped there with "aux_loss
    was formed where the copies cannot meet"). It steps aside at its first call naming the function and the
    aux_loss, and trains as without copies; the same code under the name of MindSpeed's read recompute
    (mindspeed.te.pytorch.module.checkpoint's) runs 2 copies, as without copies; without a meeting to hold (the
    expert bias alone) the unread one still runs copies. (On megatron-core 0.12 to 0.15
    the router forms its losses in one method: such blocks step aside for that, whatever the recompute.)"""
    from megatron.core.transformer.moe.router import TopKRouter

    case, unread, read = "tests.multi_copy.moe_copies_cases:train", "mindspeed.core.memory.common", \
        "mindspeed.te.pytorch.module.checkpoint"
    model = dict(routing="aux_loss", steps=1, layers=1, recompute_granularity="full", recompute_method="uniform",
                 recompute_num_layers=1)
    want = own_pool.run(case, copies=1, mindspeed_recompute=unread, **model)
    got = {module: own_pool.run(case, copies=2, mindspeed_recompute=module, **model) for module in (unread, read)}
    losses_apart = hasattr(TopKRouter, "_apply_aux_loss")  # megatron-core 0.16+
    for g in got[unread]:
        (copies, reason), = g["blocks"]
        assert copies == 1, g["blocks"]
        if losses_apart:
            assert f"{unread}.transformer_block_checkpointed_forward" in reason and "aux_loss" in reason, reason
        else:
            assert "routing losses on this megatron-core" in reason, reason
    for g in got[read]:
        assert g["blocks"] == [(2, None) if losses_apart else (1, got[unread][0]["blocks"][0][1])], g["blocks"]
    # no meeting to hold (the expert bias sums the copies' counts): the copies run under it as before
    assert all(g["blocks"] == [(2, None)] for g in own_pool.run(case, copies=2, mindspeed_recompute=unread,
                                                            **dict(model, routing="expert_bias")))
    for module, results in got.items():
        for g, w in zip(results, want):
            assert abs(g["losses"][0] - w["losses"][0]) <= 1e-5 * abs(w["losses"][0]), module
            for name, value in w["params"].items():
                assert (g["params"][name] - value).abs().max() <= 1e-5 * max(value.abs().max(), 1e-6), (module, name)


def test_auto_trials_leave_megatrons_logged_aux_losses_as_found_on_every_release():
    """COC_MULTI_COPY=auto's trials of an MoE block put Megatron's logged aux losses back as found
    (multi_copy/moe.routers_as_found); megatron-core 0.12 keeps them in parallel_state, not moe_utils (it raised
    AttributeError there)."""
    import types

    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    from coc_inject.multi_copy import moe as copies_moe

    if hasattr(moe_utils, "get_moe_metrics_tracker"):  # 0.19
        tracker, values = moe_utils.get_moe_metrics_tracker().metrics, lambda entry: entry.values
    else:  # 0.13 to 0.16: moe_utils' dict; 0.12: parallel_state's
        tracker = getattr(moe_utils, "get_moe_layer_wise_logging_tracker",
                          getattr(parallel_state, "get_moe_layer_wise_logging_tracker", None))()
        values = lambda entry: entry["values"]  # noqa: E731
    moe_utils.save_to_aux_losses_tracker("coc_test_loss", torch.tensor(2.0), 1, 1)
    try:
        with copies_moe.routers_as_found(types.SimpleNamespace(layers=[])):
            moe_utils.save_to_aux_losses_tracker("coc_test_loss", torch.tensor(3.0), 1, 1)
        assert values(tracker["coc_test_loss"]).tolist() == [2.0]
    finally:
        tracker.pop("coc_test_loss", None)


@newest_only
def test_a_torch_whose_autograd_fails_installs_check_runs_megatrons_block_with_the_reason(pool):
    got = pool.run("tests.multi_copy.block_cases:block_call", copies=2, broken_autograd=True)
    assert all(r["copies"] == 1 and "the copies' backward cannot rely on this torch's autograd" in r["reason"]
               and "another order" in r["reason"] for r in got), [r["reason"] for r in got]
    assert all(name == "mpu" for r in got for _, name in r["buffers"]), got[0]["buffers"]  # no copy ran


@newest_only
def test_recording_the_collectives_changes_nothing_that_runs(pool):
    """The tests' recorder only observes: with and without it the copies ask Megatron's global memory
    buffer for the same names, a copy's own in the backward too (as the docs say), and it still names
    each collective's copy, forward and backward."""
    plain = pool.run("tests.multi_copy.block_cases:block_call", copies=2)
    recorded = pool.run("tests.multi_copy.block_cases:block_call", copies=2, record=True)
    for mine, theirs in zip(recorded, plain):
        assert mine["buffers"] == theirs["buffers"], (mine["buffers"], theirs["buffers"])
        backward = {name for phase, name in theirs["buffers"] if phase == "backward"}
        assert backward == {"mpu@copy0", "mpu@copy1"}, theirs["buffers"]
        copies = [record[3] for record in mine["collectives"]]
        assert copies.count(0) == copies.count(1) > 0 and None not in copies, mine["collectives"]


@newest_only
def test_dropout_runs_megatrons_block_with_the_reason(pool):
    got = pool.run("tests.multi_copy.multi_copy_cases:train", copies=2, tp=2, b=4, steps=1, hidden_dropout=0.1)
    assert all(len(r["routes"]) == 1 and r["routes"][0][0] == 1 and "dropout > 0" in r["routes"][0][1]
               for r in got), [r["routes"] for r in got]



def train_auto(pool, **kwargs):
    got = pool.run("tests.multi_copy.multi_copy_cases:train_auto", **kwargs)
    decisions = [r["decisions"] for r in got]
    assert all(len(d) == 1 and d[0]["source"] == "trials" for d in decisions), decisions
    for group in ((0, 1), (2, 3)):  # the TP groups (DP 2): one decision on every rank of a group
        assert len({decisions[rank][0]["choice"] for rank in group}) == 1, decisions
    assert_same_training(got, reference(pool, tp=2, sp=True, b=4))
    return got


@newest_only
def test_auto_decides_at_the_first_step_alike_on_every_rank_and_trains_like_no_copies(pool):
    from coc_inject.multi_copy.auto import CopiesKey
    from coc_inject.tuning.online import TIMED_ROUNDS

    got = train_auto(pool, tp=2, sp=True, b=4)
    for result in got:  # none, 2 and 4 copies, each warmed up twice (the copies' threads' first runs are slow)
        assert result["trial_runs"] == {c: CopiesKey.WARM_UPS + TIMED_ROUNDS for c in (1, 2, 4)}, result["trial_runs"]
        choice = result["decisions"][0]["choice"]
        want = [(choice, None)] if choice != 1 else [(1, "auto: no copies were faster for this shape")]
        assert result["routes"] == want, result["routes"]


@newest_only
def test_auto_with_one_ranks_copies_slowed_steps_aside_on_every_rank(pool):
    got = train_auto(pool, tp=2, sp=True, b=4, skew={1: 0.5, 2: 0.5})  # one rank of each TP group
    assert all(r["decisions"][0]["choice"] == 1 for r in got), [r["decisions"] for r in got]
    assert all(r["routes"] == [(1, "auto: no copies were faster for this shape")] for r in got)


def test_megatrons_ddp_with_overlap_grad_reduce_hears_each_gradient_once(pool):
    case = "tests.multi_copy.multi_copy_cases:train_ddp"
    want = pool.run(case, copies=1)
    got = pool.run(case, copies=2)
    for mine, theirs in zip(got, want):
        assert len(mine["routes"]) == 1 and "copies=2" in mine["routes"][0] and "reason=None" in mine["routes"][0]
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-5)
        for step_got, step_want in zip(mine["grads"], theirs["grads"]):
            for name, grad in step_want.items():
                assert (step_got[name] - grad).abs().max() <= 1e-5 * grad.abs().max() + 1e-9, name


@pytest.mark.parametrize("chunks", [None, 4], ids=["megatron-linears", "coc-linears"])
def test_copies_under_autocast_train_like_no_copies(pool, chunks):
    """Megatron's enable_autocast (CPU torch.autocast in bf16 around forward and backward): the copies' threads
    take the caller's autocast, the layers run in its dtype as without copies (the first loss equals Megatron's
    to 1e-5: an fp32 forward would not), with CoC's chunked linears too. The second step's loss within bf16
    rounding: each copy's weight gradient is rounded to bf16 before autograd sums the copies', Megatron's once
    for the batch (the parameters after the SGD step differ by that rounding times the learning rate, not
    bounded here). No SP: Megatron's own column linear cannot reduce-scatter a bf16 dgrad into its fp32
    input's buffer."""
    options = dict(tp=2, sp=False, b=4, steps=2, autocast=True)
    got = pool.run("tests.multi_copy.multi_copy_cases:train", copies=2, **options, **({"chunks": chunks} if chunks else {}))
    want = reference(pool, **options)
    for g, w in zip(got, want):
        assert g["routes"] == [(2, None)], g["routes"]
        assert abs(g["losses"][0] - w["losses"][0]) <= 1e-5 * abs(w["losses"][0]), (g["losses"], w["losses"])
        assert abs(g["losses"][1] - w["losses"][1]) <= 2.0**-8 * abs(w["losses"][1]), (g["losses"], w["losses"])
