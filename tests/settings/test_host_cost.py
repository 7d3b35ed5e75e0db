"""Free when it has nothing to do (issue 52; issue 51 item 6): what a wing decides from what does not change
between calls is decided once, kept on the layer keyed by what it read (a change in place or a re-install
decides afresh) and dropped by uninstall(); at TP 1 every wing on auto runs no trial and a GPT training
step makes at most 5% more Python calls than off (cProfile's counts: deterministic, unlike timings, which
are benchmarks/host_gpt.py's: make bench-host)."""

import pytest

from tests.dist_harness import RankPool

CALLS_BOUND = 1.05


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(1)
    yield pool
    pool.close()


def test_a_cached_moe_verdict_follows_its_config_and_is_dropped_by_uninstall(pool):
    (r,) = pool.run("tests.settings.host_cost_cases:moe_verdict_follows_its_config")
    assert r["first"][0] == "megatron" and "expert parallelism 1" in r["first"][1], r
    refused = r["re-installed, refused setting"]
    assert refused[0] == "megatron" and "moe_enable_deepep" in refused[1], r
    assert "expert parallelism 1" in r["setting put back"][1], r
    assert r["left after uninstall"] == [], r


def test_every_wing_auto_at_tp1_runs_no_trial_and_adds_few_python_calls(pool):
    (r,) = pool.run("tests.settings.host_cost_cases:every_wing_auto_at_tp1")
    assert r["trials"] == 0 and not any(r["decisions"].values()), r
    assert "no tensor-, context- or expert-parallel collective" in r["copies route"], r
    assert r["on"] <= CALLS_BOUND * r["off"], (r["on"] / r["off"], r)
    assert r["left after uninstall"] == [], r
