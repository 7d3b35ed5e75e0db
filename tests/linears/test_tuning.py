"""COC_PARALLEL_NUM=auto (issue 10): the decision rule, the cache, and real layers on 2 and 4
gloo ranks: equal results to unpatched Megatron, identical decisions on every rank even when one
rank's timings are skewed, cached decisions run no trials, deterministic mode."""

import json
import statistics
import multiprocessing
import os

import pytest

from coc_inject import timer
from coc_inject.tuning import online as tuning
from coc_inject.tuning.cache import TuneCache
from coc_inject.tuning.online import DecisionKey
from scope import newest_only

KEY = DecisionKey("row", 32, 32, 32, "float32", 2, "cpu", True)


# -- the rule, pure ------------------------------------------------------------------------------


@pytest.mark.parametrize("samples,expected", [
    ({1: [10, 10, 10], 2: [8, 8, 8], 4: [9, 9, 9]}, 2),       # clearly faster
    ({1: [10, 10, 10], 2: [9.8, 9.8, 9.8]}, 1),               # 2% < the 3% floor
    ({1: [10, 6, 14], 2: [7, 7, 7]}, 1),                      # inside N=1's own spread (+-4)
    ({1: [10, 10, 10], 2: [6, 6, 6], 4: [6, 6, 6]}, 2),       # a tie goes to fewer chunks
    ({1: [10, 10, 10]}, 1),                                   # no CoC candidate (rows too few)
    ({1: [5, 5, 5], 2: [8, 8, 8]}, 1),                        # CoC slower
])
def test_choice_beats_megatron_by_more_than_the_noise(samples, expected):
    assert tuning.choose(samples)[0] == expected


def test_schedule_warms_up_then_rotates():
    warm_up, timed = timer.schedule([1, 2, 4], rounds=3)
    assert warm_up == [1, 2, 4]
    assert timed == [1, 2, 4, 2, 4, 1, 4, 1, 2]
    assert timer.schedule([1, 2], rounds=1, warm_ups=2) == ([1, 2, 1, 2], [1, 2])


# -- the cache -----------------------------------------------------------------------------------


def test_cache_round_trip_and_identity(tmp_path):
    path = str(tmp_path / "sub" / "tune.json")
    cache = TuneCache(path)
    assert cache.get(cache.key(KEY, "host a")) is None
    cache.put(cache.key(KEY, "host a"), 4, {1: 10.0, 4: 7.5})
    fresh = TuneCache(path)
    assert fresh.get(fresh.key(KEY, "host a")) == 4
    assert fresh.get(fresh.key(KEY, "host b")) is None  # another machine: not valid there
    data = json.loads(open(path).read())
    assert data["version"] == 1 and list(data["entries"].values())[0]["times_ms"] == {"1": 10.0, "4": 7.5}


@pytest.mark.parametrize("content", ["{not json", '{"version": 9, "entries": {}}', "[]"])
def test_corrupt_cache_is_one_warning_and_empty(tmp_path, caplog, content):
    from coc_inject import log

    log.reset_once()
    path = tmp_path / "tune.json"
    path.write_text(content)
    cache = TuneCache(str(path))
    with caplog.at_level("WARNING", logger="coc_inject"):
        assert cache.get(cache.key(KEY, "h")) is None
        assert cache.get(cache.key(KEY, "h")) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "unreadable or corrupt" in said[0] and str(path) in said[0]
    cache.put(cache.key(KEY, "h"), 2, {})
    assert TuneCache(str(path)).get(cache.key(KEY, "h")) == 2  # rewritten, valid again


def _writer(path, worker, count):
    cache = TuneCache(path)
    for i in range(count):
        cache.put(json.dumps([worker, i]), 2 + (i % 3), {1: 1.0})


@newest_only  # the cache file's locking: no Megatron in it
def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "tune.json")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_writer, args=(path, w, 25)) for w in range(4)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(60)
        assert p.exitcode == 0
    entries = json.loads(open(path).read())["entries"]
    assert len(entries) == 100
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".tune-")]  # no temporaries left


def test_unwritable_cache_is_one_warning(tmp_path, caplog):
    from coc_inject import log

    log.reset_once()
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = TuneCache(str(blocker / "tune.json"))  # its directory is a file
    with caplog.at_level("WARNING", logger="coc_inject"):
        cache.put(cache.key(KEY, "h"), 2, {})
        cache.put(cache.key(KEY, "h"), 4, {})
    assert len(caplog.records) == 1 and "cannot write the tune cache" in caplog.records[0].getMessage()
    assert cache.get(cache.key(KEY, "h")) == 4  # still used in this run


# -- real layers ---------------------------------------------------------------------------------

# A skewed run's delay: far beyond a busy 2-core machine's scheduling hiccups (0.05 s lost to one in CI:
# a CoC run's outlier widened its noise past the delay, and Megatron's path was kept).
SKEW_S = 0.3

CASES = [("row", False), ("row", True), ("column", True), ("column", False)]
IDS = ["row", "row-sp", "column-sp", "column-bwd"]


@pytest.mark.parametrize("kind,sp", CASES, ids=IDS)
def test_auto_matches_unpatched_and_agrees(pool2, kind, sp):
    results = pool2.run("tuning_cases:auto_call", kind=kind, sequence_parallel=sp)
    for result in results:
        assert result["errors"] <= 1e-5
        assert result["grads_only_from_real_calls"]  # trials added nothing to any gradient
        assert len(result["decisions"]) == 1 and result["decisions"][0][1] == "trials"
    assert results[0]["decisions"] == results[1]["decisions"]
    chosen = results[0]["decisions"][0][0]
    assert results[0]["coc_calls"] == (0 if chosen == 1 else 2)


@pytest.mark.parametrize("slow,expect_coc,delay", [((1,), True, SKEW_S), ((2, 4, 8), False, 0.1)],
                         ids=["megatron-slow", "coc-slow"])
def test_one_rank_skewed_every_rank_decides_the_same(pool2, slow, expect_coc, delay):
    # Rank 1 alone sees the slow runs; MAX over the group makes rank 0 decide as it does. Slowed CoC counts
    # keep Megatron's path unless two of its three runs hiccup by more than the delay: 0.1 s is plenty there.
    results = pool2.run("tuning_cases:auto_call", kind="row", sequence_parallel=True,
                        skew={1: (slow, delay)})
    decisions = [r["decisions"] for r in results]
    assert decisions[0] == decisions[1]
    assert (decisions[0][0][0] != 1) is expect_coc
    for result in results:
        assert result["errors"] <= 1e-5


@newest_only  # the agreement over 4 ranks (2 ranks: every release)
def test_skew_on_four_ranks(pool4):
    results = pool4.run("tuning_cases:auto_call", kind="column", sequence_parallel=True, seq=32,
                        skew={3: ((1,), SKEW_S)})
    assert all(r["decisions"] == results[0]["decisions"] for r in results)
    assert results[0]["decisions"][0][0] != 1 and all(r["errors"] <= 1e-5 for r in results)


def test_second_run_with_the_cache_runs_no_trial(pool2, tmp_path):
    path = str(tmp_path / "tune.json")
    first = pool2.run("tuning_cases:auto_call", kind="row", sequence_parallel=True, cache=path,
                      skew={0: ((1,), SKEW_S)})
    second = pool2.run("tuning_cases:auto_call", kind="row", sequence_parallel=True, cache=path)
    chosen = first[0]["decisions"][0][0]
    assert chosen != 1
    for result in second:
        assert result["decisions"] == [(chosen, "cache")]
        assert "(trials" not in result["log"] and "(cache)" in result["log"]


def test_ranks_with_different_caches_use_rank_zeros(pool2, tmp_path):
    # Each rank reads its own file: rank 0 says 4, rank 1 says 8.
    for rank, chunks in ((0, 4), (1, 8)):
        cache = TuneCache(str(tmp_path / f"r{rank}.json"))
        key = DecisionKey("row-sp", 32, 32, 32, "float32", 2, "cpu", True)
        import socket

        cache.put(cache.key(key, f"host {socket.gethostname()}; world 2; TP 2; gloo"), chunks, {})
    results = pool2.run_per_rank("tuning_cases:auto_call",
                                 [dict(kind="row", sequence_parallel=True, cache=str(tmp_path / f"r{r}.json"))
                                  for r in range(2)])
    for result in results:
        assert result["decisions"] == [(4, "cache")] and result["coc_calls"] == 2 and result["errors"] <= 1e-5


def test_deterministic_runs_no_trial_and_repeats_bitwise(pool2):
    runs = [pool2.run("tuning_cases:auto_call", kind="row", sequence_parallel=True, deterministic=True)
            for _ in range(2)]
    for results in runs:
        for result in results:
            assert result["decisions"][0][0] == 1 and result["decisions"][0][1].startswith("deterministic default")
            assert result["errors"] == 0.0  # Megatron's own path: the same numbers as unpatched


def test_auto_on_one_rank_fixed_on_another_is_an_error_everywhere(pool2):
    from coc_inject.config import AUTO

    messages = pool2.run("layer_cases:mismatched_config", chunks_by_rank=[AUTO, 4])
    for message in messages:
        assert message is not None and "differs across the ranks" in message


@newest_only  # coc-inject's CLI
def test_cli_modes_accept_auto():
    from coc_inject.cli import toggles

    assert toggles("auto") == {"COC_PARALLEL_NUM": "auto", "USE_COC_FUSED_KERNEL": "0", "COC_DISABLE": None}
    assert toggles("4")["COC_PARALLEL_NUM"] == "4"
    with pytest.raises(SystemExit, match="'auto', 'fused' or 'off'"):
        toggles("autotune")


@pytest.mark.parametrize("second_round,expected", [
    ({1: [10, 10, 10], 2: [10.1, 10.1, 10.1]}, 1),  # the first round's winner was its draw: the baseline kept
    ({1: [10, 10, 10], 2: [9, 9, 9]}, 2),           # it wins again: confirmed
])
def test_a_winner_among_many_candidates_is_confirmed_by_a_second_round(monkeypatch, second_round, expected):
    """confirm=True (multi-copy's trials with every wing on auto): the fastest of many noisy candidates
    is timed again against the baseline and kept only if it wins that round too; without confirm one
    round decides."""
    import torch

    from coc_inject.config import CocConfig

    first_round = {1: [10, 10, 10], 2: [9.5, 9.5, 9.5], 4: [9.8, 9.8, 9.8], 8: [9.9, 9.9, 9.9]}
    asked = []

    def trials(self, candidates, *rest):
        asked.append(list(candidates))
        return first_round if len(asked) == 1 else second_round

    monkeypatch.setattr(tuning.Tuner, "_trials", trials)
    monkeypatch.setattr(tuning.Tuner, "_agreed_cached", lambda *args: None)
    monkeypatch.setattr(tuning, "hardware_identity", lambda *args: "test host")
    monkeypatch.setattr(tuning.dist, "get_rank", lambda: 0)
    tuner = tuning.Tuner(CocConfig(), None)
    assert tuner.decide(KEY, None, torch.device("cpu"), [1, 2, 4, 8], 1, None, confirm=True) == expected
    assert asked == [[1, 2, 4, 8], [1, 2]]
    assert tuner.decisions[KEY].confirmation_ms == {c: 1e3 * statistics.median(v) for c, v in second_round.items()}
    assert (": confirmed" if expected == 2 else ": not confirmed") in tuner.decisions[KEY].describe(KEY)
    asked.clear()
    other = DecisionKey("row", 64, 32, 32, "float32", 2, "cpu", True)
    assert tuner.decide(other, None, torch.device("cpu"), [1, 2, 4, 8], 1, None) == 2  # one round decides
    assert asked == [[1, 2, 4, 8]]


@pytest.mark.parametrize("stored,trials_run", [
    ({"chunks": 2, "times_ms": {"1": 10.0, "2": 9.5}}, True),  # a first round's winner, from before the second round
    ({"chunks": 2, "times_ms": {"1": 10.0, "2": 9.5}, "confirmation_ms": {"1": 10.0, "2": 9.0}}, False),
    ({"chunks": 1, "times_ms": {"1": 10.0, "2": 10.5}}, False),  # the baseline needs no confirmation
])
def test_a_cached_winner_counts_for_a_confirmed_decision_only_with_its_second_round(monkeypatch, tmp_path, stored,
                                                                                     trials_run):
    """COC_TUNE_CACHE: a confirm=True decision takes a cached winner other than the baseline only where
    the entry holds the second round's times; a new decision stores them."""
    import json

    import torch

    from coc_inject.config import CocConfig
    from coc_inject.tuning.cache import VERSION, TuneCache

    monkeypatch.setattr(tuning, "hardware_identity", lambda *args: "test host")
    monkeypatch.setattr(tuning.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(tuning.dist, "get_global_rank", lambda group, rank: 0)
    monkeypatch.setattr(tuning.dist, "broadcast_object_list", lambda *args, **kwargs: None)
    path = tmp_path / "tune.json"
    cache = TuneCache(str(path))
    path.write_text(json.dumps({"version": VERSION, "entries": {cache.key(KEY, "test host"): stored}}))
    asked = []

    def trials(self, candidates, *rest):
        asked.append(list(candidates))
        return {c: [10.0 if c == 1 else 9.0] * 3 for c in candidates}

    monkeypatch.setattr(tuning.Tuner, "_trials", trials)
    group = type("Group", (), {"rank": lambda self: 0})()
    tuner = tuning.Tuner(CocConfig(), cache)
    choice = tuner.decide(KEY, group, torch.device("cpu"), [1, 2, 4], 1, None, confirm=True)
    assert bool(asked) == trials_run
    if trials_run:
        assert choice == 2 and asked == [[1, 2, 4], [1, 2]]
        entry = json.loads(path.read_text())["entries"][cache.key(KEY, "test host")]
        assert entry["confirmation_ms"] == {"1": 10000.0, "2": 9000.0}  # the trials return seconds
    else:
        assert choice == stored["chunks"] and tuner.decisions[KEY].source == "cache"
