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


def test_a_verdict_reads_its_config_again_only_after_a_set_and_unwatches_at_uninstall():
    """The values a verdict is keyed by are re-read only once an attribute of a watched config was set (its
    class counts sets while installed): a call costs an int compare, a change in place still re-decides."""
    import dataclasses

    from coc_inject import verdicts

    @dataclasses.dataclass
    class Config:
        size: int = 1

    class Installation:
        def __init__(self):
            self.undo, self.verdict_owners = [], {}

    class Owner:
        pass

    reads = []

    def read(config):
        reads.append(config.size)
        return (config.size,)

    installation, owner, config = Installation(), Owner(), Config()
    verdict = verdicts.remember(installation, owner, "_v", config, read, None, "decided")
    assert "__setattr__" in Config.__dict__ and reads == [1]
    assert all(verdict.holds(installation, config) for _ in range(5)) and reads == [1]  # nothing set: no re-read
    config.size = 1  # set to the same value: read again once, still holds
    assert verdict.holds(installation, config) and verdict.holds(installation, config) and reads == [1, 1]
    config.size = 2
    assert not verdict.holds(installation, config)
    while installation.undo:  # what uninstall() does
        installation.undo.pop()()
    assert "__setattr__" not in Config.__dict__
    verdicts.drop(installation.verdict_owners)
    assert "_v" not in owner.__dict__
