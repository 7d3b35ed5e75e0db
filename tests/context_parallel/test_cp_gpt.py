"""Context parallelism on a real megatron-core GPT (local spec), 4 gloo ranks: each algorithm against
the same model at CP=1 with Megatron's own attention -- losses and parameters after SGD steps within
1e-5 relative; memory kept for backward; errors for what cannot run exactly; COC_CP_ALGO=auto (equal
losses, one decision on every rank with one rank's timings skewed, the cache round trip, deterministic
mode, auto on some ranks and a fixed algorithm on others)."""

import json
from pathlib import Path

import pytest

from tests.dist_harness import RankPool
from tests.scope import newest_only

# The whole set on the newest release; the older releases (tests/scope.py) run the CP=2 training cases
# and the construction errors.


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4)
    yield pool
    pool.close()


_references: dict = {}


def reference(pool, tp, **kwargs):
    key = (tp, repr(sorted(kwargs.items())))
    if key not in _references:
        _references[key] = pool.run("tests.context_parallel.cp_gpt_cases:train", tp=tp, cp=1, **kwargs)
    return _references[key]


def assert_same_training(got, want):
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g["tp_rank"] == w["tp_rank"]
        for step, (a, b) in enumerate(zip(g["losses"], w["losses"])):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} vs {b} at CP=1"
        for name, value in w["params"].items():
            diff = (g["params"][name] - value).abs().max().item()
            scale = value.abs().max().item()
            assert diff <= 1e-5 * scale, f"rank {rank} {name}: max diff {diff} vs max |param| {scale}"


def run(pool, tp, cp, coc, want_algorithms, **kwargs):
    got = pool.run("tests.context_parallel.cp_gpt_cases:train", tp=tp, cp=cp, coc=coc, **kwargs)
    assert all(r["algorithms"] == want_algorithms for r in got), [r["algorithms"] for r in got]
    assert_same_training(got, reference(pool, tp, **kwargs))


@pytest.mark.parametrize("algorithm", ["ring", "ulysses", "allgather"])
def test_cp2_equals_cp1(pool, algorithm):
    run(pool, 1, 2, {"cp_algo": algorithm}, [algorithm])


@pytest.mark.parametrize("tp,model", [(1, {}), (2, {"heads": 8, "groups": 2, "sp": True})], ids=["tp1", "tp2-gqa-sp"])
def test_flash_attention_at_cp1_equals_megatrons_attention(pool, tp, model):
    """COC_FLASH_ATTN=1: layers built with CP = 1 run the CPU flash kernel, equal to Megatron's unfused
    local attention within 1e-5 (losses and parameters after 3 SGD steps)."""
    got = pool.run("tests.context_parallel.cp_gpt_cases:train", tp=tp, cp=1, coc={"flash_attn": True}, **model)
    assert all(r["algorithms"] == ["local"] and r["kernels"] == ["cpu-flash"] for r in got), got[0]["kernels"]
    assert_same_training(got, reference(pool, tp, **model))


@newest_only
@pytest.mark.parametrize("mask,kernels", [("none", ["cpu-flash"]), ("padding", [])])
def test_flash_attention_masks_and_megatrons_path_for_the_rest(pool, mask, kernels):
    """No mask runs the kernel; a padding mask (neither causal nor empty) runs Megatron's attention."""
    got = pool.run("tests.context_parallel.cp_gpt_cases:train", tp=1, cp=1, coc={"flash_attn": True}, mask=mask)
    assert all(r["kernels"] == kernels for r in got)
    assert_same_training(got, reference(pool, 1, mask=mask))


@newest_only
def test_flash_attention_reference_kernel_forced(pool):
    got = pool.run("tests.context_parallel.cp_gpt_cases:train", tp=1, cp=2, coc={"cp_algo": "ring", "attn_kernel": "reference"})
    assert all(r["kernels"] == ["reference"] for r in got)
    assert_same_training(got, reference(pool, 1))


@newest_only
@pytest.mark.parametrize("coc,want", [
    ({"cp_algo": "ring"}, ["ring"]),
    ({"cp_algo": "ring", "cp_window": 2}, ["double-ring w=2"]),
    ({"cp_algo": "hybrid", "cp_ulysses_degree": 2}, ["hybrid u=2"]),
], ids=["ring", "double-ring", "hybrid"])
def test_cp4_equals_cp1(pool, coc, want):
    run(pool, 1, 4, coc, want, seq=128)


@newest_only
@pytest.mark.parametrize("algorithm", ["ring", "ulysses"])
def test_tp2_cp2_sequence_parallel_gqa(pool, algorithm):
    run(pool, 2, 2, {"cp_algo": algorithm}, [algorithm], heads=8, groups=2, sp=True)


@newest_only
def test_rope(pool):
    run(pool, 1, 2, {"cp_algo": "ring"}, ["ring"], rope=True)


@newest_only
@pytest.mark.parametrize("cp_comm_type,want", [
    ("a2a", ["ulysses"]), ("all_gather", ["allgather"]), (["p2p", "a2a"], ["ring", "ulysses"])])
def test_megatron_follows_cp_comm_type(pool, cp_comm_type, want):
    run(pool, 1, 2, {"cp_algo": "megatron"}, want, cp_comm_type=cp_comm_type)


@newest_only
def test_layer_called_twice_in_a_step(pool):
    run(pool, 1, 2, {"cp_algo": "ring"}, ["ring"], call_twice=True)


@newest_only
@pytest.mark.parametrize("algorithm", ["ring", "ulysses"])
def test_no_mask(pool, algorithm):
    run(pool, 1, 2, {"cp_algo": algorithm}, [algorithm], mask="none", mask_type="no_mask")


@newest_only
def test_causal_mask_type_without_a_mask_tensor(pool):
    run(pool, 1, 2, {"cp_algo": "ring"}, ["ring"], mask="none")


@newest_only
def test_saved_memory_is_linear_in_the_sequence_and_a_fraction_of_cp1(pool):
    megatron = pool.run("tests.context_parallel.cp_gpt_cases:saved_attention_bytes", tp=1, cp=1, seq=256)[0]
    for algorithm in ("ring", "ulysses", "allgather"):
        coc = {"cp_algo": algorithm}
        short = max(pool.run("tests.context_parallel.cp_gpt_cases:saved_attention_bytes", tp=1, cp=2, coc=coc, seq=128))
        long = max(pool.run("tests.context_parallel.cp_gpt_cases:saved_attention_bytes", tp=1, cp=2, coc=coc, seq=256))
        assert long <= 2.5 * short, (algorithm, short, long)
        assert long <= 0.25 * megatron, (algorithm, long, megatron)


def error_of(pool, **kwargs):
    errors = pool.run("tests.context_parallel.cp_gpt_cases:expect_error", **kwargs)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    return errors[0]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(attention_dropout=0.1), "attention_dropout=0.1 is refused by context-parallel attention"),
    (dict(heads=2, groups=2, coc={"cp_algo": "ulysses"}, cp=4), "num_attention_heads=2"),
    (dict(coc={"cp_algo": "hybrid"}, cp=4), "COC_CP_ULYSSES_DEGREE"),
    # No Ulysses degree can split CP 2: the error says what hybrid needs, not to set a degree.
    (dict(coc={"cp_algo": "hybrid"}), "COC_CP_ALGO=hybrid: hybrid needs CP >= 4"),
    (dict(coc={"cp_algo": "ring", "cp_window": 3}, cp=4), "COC_CP_WINDOW=3"),
    (dict(coc={"cp_algo": "megatron"}, cp_comm_type="fancy"), "cp_comm_type='fancy'"),
], ids=["dropout", "ulysses-heads", "hybrid-degree", "hybrid-cp2", "window", "cp_comm_type"])
def test_construction_errors_name_the_feature(pool, kwargs, needle):
    kwargs = {"tp": 1, "cp": 2, "coc": {"cp_algo": "ring"}, **kwargs}
    message = error_of(pool, **kwargs)
    assert "ContextParallelError" in message and needle in message, message
    assert needle == "COC_CP_ULYSSES_DEGREE" or "set COC_CP_ULYSSES_DEGREE" not in message, message


@newest_only
@pytest.mark.parametrize("call,needle", [
    (dict(packed_seq_params=object()), "packed sequences"),
    (dict(attention_bias=object()), "attention_bias"),
    (dict(rows=31), "odd number"),
    (dict(autocast=True), "torch.autocast is on (Megatron's enable_autocast)"),
], ids=["packed", "bias", "odd-rows", "autocast"])
def test_call_errors_name_the_feature(pool, call, needle):
    errors = pool.run("tests.context_parallel.cp_gpt_cases:attention_call_error", tp=1, cp=2, coc={"cp_algo": "ring"}, **call)
    assert all(e is not None and needle in e for e in errors), errors


@newest_only
def test_a_mask_that_is_not_causal_is_refused(pool):
    import torch

    mask = torch.zeros(1, 1, 32, 64, dtype=torch.bool)
    mask[..., -1] = True  # a padded last key
    errors = pool.run("tests.context_parallel.cp_gpt_cases:attention_call_error", tp=1, cp=2, coc={"cp_algo": "ring"}, mask=mask)
    assert all(e is not None and "neither causal nor empty" in e for e in errors), errors


@newest_only
def test_ranks_with_different_algorithms_fail_alike(pool):
    coc = [{"cp_algo": "ring"}, {"cp_algo": "ulysses"}, {"cp_algo": "ring"}, {"cp_algo": "ulysses"}]
    errors = pool.run_per_rank("tests.context_parallel.cp_gpt_cases:expect_error",
                               [dict(tp=1, cp=2, coc=c, what="train") for c in coc])
    assert all(e is not None and "differs across the ranks" in e for e in errors), errors


@newest_only
def test_hybrid_ulysses_groups_are_destroyed_with_megatrons(pool):
    got = pool.run("tests.context_parallel.cp_gpt_cases:ulysses_groups_destroyed_with_megatrons")
    assert got == [{"live": True, "destroyed": True, "forgotten": True}] * 4, got


# -- COC_CP_ALGO=auto ------------------------------------------------------------------------


def choices_by_cp_group(results) -> dict:
    """{CP group's global ranks: the set of choices its ranks made} (each group decides on its own)."""
    groups: dict = {}
    for result in results:
        groups.setdefault(tuple(result["cp_ranks"]), set()).add(result["decisions"][0]["choice"])
    return groups


def train_auto(pool, tp=1, cp=2, **kwargs):
    return pool.run("tests.context_parallel.cp_gpt_cases:train", tp=tp, cp=cp, **kwargs)


@newest_only
@pytest.mark.parametrize("tp,model", [(1, {}), (2, {"heads": 8, "groups": 2, "sp": True})], ids=["tp1", "tp2-sp-gqa"])
def test_auto_losses_equal_cp1_and_decide_at_the_first_step(pool, tp, model):
    got = train_auto(pool, tp=tp, coc={"cp_algo": "auto", "tune_cache": None}, **model)
    assert_same_training(got, reference(pool, tp, **model))
    for result in got:
        assert result["algorithms"] == ["auto among ring/ulysses/allgather"]
        # one key (every layer and step has the same shape), decided by trials at the first call
        assert [(d["source"], sorted(d["times_ms"])) for d in result["decisions"]] == [
            ("trials", ["allgather", "ring", "ulysses"])]
    assert all(len(choices) == 1 for choices in choices_by_cp_group(got).values())


@newest_only
def test_one_rank_skewed_still_one_decision(pool):
    slow = 0.3  # far beyond a busy machine's scheduling hiccups
    got = train_auto(pool, coc={"cp_algo": "auto", "tune_cache": None}, steps=1, skew={1: ("ulysses", slow)})
    decisions = [r["decisions"][0] for r in got]
    assert got[0]["cp_ranks"] == [0, 1]  # rank 1's group
    assert all(len(choices) == 1 for choices in choices_by_cp_group(got).values())
    assert decisions[0]["choice"] != "ulysses"
    # MAX over the CP group: rank 1's delay is in every rank of its group's timings
    for rank in (0, 1):
        assert decisions[rank]["times_ms"]["ulysses"] >= slow * 1e3


@newest_only
def test_cache_round_trip_runs_no_trial(pool, tmp_path):
    cache = str(tmp_path / "tune.json")
    first = train_auto(pool, coc={"cp_algo": "auto", "tune_cache": cache}, steps=1)
    entries = json.loads(Path(cache).read_text())["entries"]
    # both CP groups of the pool tried the same key on the same host: one entry, the last writer's
    assert len(entries) == 1
    (cached,) = [entry["choice"] for entry in entries.values()]
    assert cached in {r["decisions"][0]["choice"] for r in first}
    second = train_auto(pool, coc={"cp_algo": "auto", "tune_cache": cache}, steps=1)
    for a, b in zip(first, second):
        assert a["decisions"][0]["source"] == "trials"
        assert (b["decisions"][0]["source"], b["decisions"][0]["choice"]) == ("cache", cached)
        assert b["decisions"][0]["times_ms"] == {}


@newest_only
def test_a_job_takes_the_decision_of_coc_inject_tune_and_runs_no_trial(pool, tmp_path):
    from tests.bench.test_tune_cli import attention_entries, run_tune_attention

    # The pool's GPT (hidden 64, 4 heads, seq 64, micro-batch 2) at TP 1 x CP 2 in a world of 4.
    cache = str(tmp_path / "tune.json")
    _, (row,), _ = run_tune_attention("--hidden", "64", "--ffn", "256", "--heads", "4", "--seq", "64",
                                      "--micro-batch", "2", "--cp", "2", "--world", "4", "--cache", cache)
    assert row["source"] == "trials"
    # Both CP groups of the world decided; the cache keeps the last writer's choice, as in a job.
    ((choice, _, _),) = attention_entries(cache).values()
    got = train_auto(pool, coc={"cp_algo": "auto", "tune_cache": cache}, steps=1)
    for result in got:
        assert [(d["source"], d["choice"], d["times_ms"]) for d in result["decisions"]] == [("cache", choice, {})]


@newest_only
def test_deterministic_runs_no_trial_and_uses_ring(pool, tmp_path):
    got = train_auto(pool, coc={"cp_algo": "auto", "tune_cache": str(tmp_path / "none.json"), "deterministic": True},
                steps=1)
    for result in got:
        decision = result["decisions"][0]
        assert decision["choice"] == "ring" and decision["source"].startswith("deterministic default")


@newest_only
def test_auto_on_some_ranks_and_a_fixed_algorithm_on_others_fails_alike(pool):
    coc = [{"cp_algo": "auto", "tune_cache": None}, {"cp_algo": "ring"}] * 2
    errors = pool.run_per_rank("tests.context_parallel.cp_gpt_cases:expect_error", [dict(tp=1, cp=2, coc=c, what="train") for c in coc])
    assert all(e is not None and "differs across the ranks" in e for e in errors), errors


@newest_only
def test_a_subclass_with_its_own_forward_keeps_megatrons_refusal(pool):
    errors = pool.run("tests.context_parallel.cp_gpt_cases:subclass_with_own_forward_error", coc={"cp_algo": "ring"})
    assert all(e is not None and "only supported by TEDotProductAttention" in e for e in errors), errors
