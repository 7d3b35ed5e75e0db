"""Ranks that disagree on the copies' or the MoE pieces' settings are told apart at the wing's first call
(#51 item 3), on 2 gloo ranks: every rank raises an error naming the setting, each rank's value and the
ranks, within a bounded time; a rank without the wing (no bootstrap there) leaves its peer timing out
with an error naming its setting and the rank that never joined, never a hang or rows paired wrong.

Before, only the linears and the attention checked: copies 2 beside 4 issued collectives of other sizes
(gloo: paired wrong or stuck), pieces beside Megatron's dispatcher too. The pool's own timeout bounds a
hang: the test then fails, it does not hang."""

import pytest

from dist_harness import RankPool
from scope import newest_only

CASES = "tests.settings.wing_agreement_cases"
POOL_TIMEOUT_S = 120  # a hang (before: copies of other sizes) fails the test after this; the startup too
AGREEMENT_TIMEOUT_S = 6.0  # the cases' agreement timeout (60 s in a job)


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2, timeout=POOL_TIMEOUT_S)
    yield pool
    pool.close()


def _named_on_every_rank(results, *fragments):
    for rank, result in enumerate(results):
        said = result["said"]
        assert said is not None and "differs across the ranks" in said, (rank, result)
        for fragment in fragments:
            assert fragment in said, (rank, fragment, said)
        assert result["seconds"] < AGREEMENT_TIMEOUT_S, result  # both joined: no wait for a timeout


@newest_only
def test_copies_2_beside_4_is_named_on_both_ranks(pool):
    results = pool.run_per_rank(f"{CASES}:copies", [{"prefix": "copies-2-4", "copies": 2},
                                                    {"prefix": "copies-2-4", "copies": 4}])
    _named_on_every_rank(results, "COC_MULTI_COPY is 2 on rank 0 and 4 on rank 1")


@newest_only
def test_copies_beside_a_rank_without_coc_inject_time_out_naming_the_setting_and_the_rank(pool):
    """Rank 1 has no bootstrap (nothing installed): rank 0's copies never start; it says so after the
    agreement's timeout, then runs Megatron's block beside rank 1's."""
    results = pool.run_per_rank(f"{CASES}:copies", [
        {"prefix": "copies-off", "copies": 2, "timeout_s": AGREEMENT_TIMEOUT_S, "megatron_after": True},
        {"prefix": "copies-off", "copies": 1}])
    said = results[0]["said"]
    assert said is not None and "never joined" in said and "ranks [1]" in said, results
    assert "COC_MULTI_COPY=2" in said, said
    assert AGREEMENT_TIMEOUT_S <= results[0]["seconds"] < AGREEMENT_TIMEOUT_S + 10, results
    assert results[1]["said"] is None


@newest_only
def test_copies_beside_a_rank_with_only_the_linears_is_named_where_their_checks_meet(pool):
    """Rank 1 runs coc-inject with the linears chunked and no copies: its linears' check and rank 0's
    copies' check meet on the tensor-parallel group's keys: both named at once, no timeout."""
    results = pool.run_per_rank(f"{CASES}:copies", [{"prefix": "copies-linears", "copies": 2, "parallel_num": 2},
                                                    {"prefix": "copies-linears", "copies": 1, "parallel_num": 2}])
    _named_on_every_rank(results, "COC_MULTI_COPY is 2 on rank 0 and 1 on rank 1")


@newest_only
def test_pieces_beside_a_rank_without_them_time_out_naming_the_setting_and_the_rank(pool):
    results = pool.run_per_rank(f"{CASES}:pieces", [
        {"prefix": "pieces-off", "moe_overlap": "1", "timeout_s": AGREEMENT_TIMEOUT_S, "megatron_after": True},
        {"prefix": "pieces-off", "moe_overlap": "0"}])
    said = results[0]["said"]
    assert said is not None and "never joined" in said and "ranks [1]" in said, results
    assert "COC_MOE_OVERLAP=1" in said, said
    assert AGREEMENT_TIMEOUT_S <= results[0]["seconds"] < AGREEMENT_TIMEOUT_S + 10, results
    assert results[1]["said"] is None


def test_pieces_auto_beside_1_is_named_on_both_ranks(pool):
    """auto's trials beside pieces at once: other collectives from the first call on. (Also on 0.12.1,
    whose dispatcher finds its expert groups through the parallel state.)"""
    results = pool.run_per_rank(f"{CASES}:pieces", [{"prefix": "pieces-auto-1", "moe_overlap": "auto"},
                                                    {"prefix": "pieces-auto-1", "moe_overlap": "1"}])
    _named_on_every_rank(results, "COC_MOE_OVERLAP is auto on rank 0 and 1 on rank 1")


@newest_only
def test_agreeing_ranks_run_on_and_check_once(pool):
    """Equal settings: nothing said; three block calls exchange once, over the tensor-parallel group (the
    context-parallel one has one rank): a later call reads a flag."""
    results = pool.run(f"{CASES}:copies", prefix="copies-equal", copies=2, calls=3)
    assert [result["said"] for result in results] == [None, None], results
    assert [result["exchanges"] for result in results] == [[[0, 1]], [[0, 1]]], results


@newest_only
def test_equal_settings_with_a_fact_apart_are_named_by_the_fact():
    """A rank whose copies cannot run (its torch's autograd, multi_copy/autograd_check.py) beside one whose
    can: equal settings, other collectives. A fact only some ranks' checks give (another wing's check met
    on the group's keys) is not compared."""
    from coc_inject.config import CocConfig
    from coc_inject.pipeline import agreement

    config = CocConfig(multi_copy=2)

    def payload(**facts):
        return {"fingerprint": config.fingerprint(), "settings": config.agreed_values(), "facts": facts}

    can = "multi-copy can run here"
    assert agreement._differences([0, 1, 2], [payload(**{can: True}), payload(**{can: False}), payload(**{can: True})]) \
        == [f"{can} is True on ranks [0, 2] and False on rank 1"]
    assert agreement._differences([0, 1], [payload(**{can: True}), payload()]) == []
