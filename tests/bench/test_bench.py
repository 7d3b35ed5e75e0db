"""Bench arithmetic (pure) and the emulated link's set-up / teardown contract."""

import os
import subprocess
import sys

import pytest

from coc_inject.testbed import link
from coc_inject.bench.cases import linears_figures as report


def synthetic(megatron_ms, variants_ms, compute_ms, comm_ms, reps=5):
    s = lambda ms: [ms / 1e3] * reps  # noqa: E731
    times = {"megatron": {"forward": s(megatron_ms), "backward": s(10)},
             "compute-only": {"forward": s(compute_ms)}, "comm-only": {"forward": s(comm_ms)}}
    for name, ms in variants_ms.items():
        times[name] = {"forward": s(ms), "backward": s(10)}
    return {"case": "row", "label": "Row mm+AR", "times": times, "timeline": []}


def test_ideal_and_efficiency():
    # C = 70, M = 140, Megatron 210: N=4 ideal = 140 + 70/4 = 157.5; saving 70*3/4 = 52.5.
    case = report.summarize_case(synthetic(210, {"N=4": 183.75, "N=1": 210}, 70, 140))
    n4 = case["variants"]["N=4"]
    assert n4["ideal_ms"] == pytest.approx(157.5)
    assert n4["efficiency"] == pytest.approx(0.5)  # saved 26.25 of 52.5
    assert n4["forward_speedup"] == pytest.approx(210 / 183.75)
    assert n4["ideal_speedup"] == pytest.approx(210 / 157.5)
    assert n4["fwd_bwd_speedup"] == pytest.approx(220 / 193.75)
    assert case["variants"]["N=1"]["efficiency"] is None  # one chunk: no ideal saving


def test_speedup_is_the_median_of_per_repetition_ratios():
    result = synthetic(100, {"N=2": 50}, 10, 10, reps=3)
    result["times"]["megatron"]["forward"] = [0.100, 0.300, 0.100]
    result["times"]["N=2"]["forward"] = [0.050, 0.100, 0.200]
    # ratios 2.0, 3.0, 0.5 -> median 2.0 (a ratio of medians would give 1.0)
    assert report.summarize_case(result)["variants"]["N=2"]["forward_speedup"] == pytest.approx(2.0)


def test_table_lists_every_variant():
    table = report.format_table(report.summarize([synthetic(210, {"N=2": 180, "N=8": 160}, 70, 140)]))
    assert "compute-only 70.0 ms, comm-only 140.0 ms" in table
    assert all(name in table for name in ("megatron", "N=2", "N=8"))


def test_link_needs_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(link.LinkError, match="needs root"):
        link.EmulatedLink.check_available()


def test_bench_link_without_root_is_a_clear_error():
    code = ("import os, sys; os.geteuid = lambda: 1000; from coc_inject.cli import main; "
            "sys.exit(main(['bench', '--link', '1gbit']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--link needs root" in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_link_is_torn_down_even_after_an_error():
    names = None
    with pytest.raises(RuntimeError, match="boom"):
        with link.EmulatedLink("100mbit") as emulated:
            names = list(emulated.names)
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert all(name in listed for name in names)
            qdisc = subprocess.run(["tc", "-n", names[0], "qdisc", "show", "dev", link.INTERFACE],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            raise RuntimeError("boom")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)


def test_link_rejects_more_than_two_ranks():
    with pytest.raises(link.LinkError, match="ranks=4 is invalid"):
        link.EmulatedLink("1gbit", ranks=4)


def test_compute_only_twin_skips_float_collectives_and_runs_integer_ones(pool2):
    """link.no_collectives on 2 gloo ranks: a float all_reduce is a no-op (async too: its wait returns at
    once), a float gather zero-fills; an integer all_reduce still sums, an integer gather and all-to-all
    still exchange (their results steer control flow); leaving it, collectives run again."""
    results = pool2.run("bench_cases:compute_only_collectives")
    for rank, result in enumerate(results):
        assert result["floats"] == result["waited"] == [float(rank + 1)] * 3
        assert result["done"] is True
        assert result["gathered_floats"] == [0.0, 0.0]
        assert result["integers"] == [3, 3, 3]
        assert result["gathered_integers"] == [1, 2]
        assert result["exchanged"] == [rank, 10 + rank]
        assert result["after"] == [3.0] * 3


class _NeverCompletes:
    """A work like gloo's reduce_scatter_single in torch 2.13: no future, is_completed() stays False."""

    def __init__(self):
        self.waited = False

    def get_future(self):
        raise RuntimeError("Work::getFuture not implemented.")

    def is_completed(self):
        return False

    def wait(self):
        self.waited = True
        return True


def test_timeline_of_a_work_that_never_reports_completion_ends_at_its_wait():
    from coc_inject.pipeline import schedules

    works = []

    def communicate(start, stop, computed):
        works.append(_NeverCompletes())
        return works[-1]

    with schedules.traced(schedules.TimelineTracer()) as tracer:
        schedules.run_compute_first([(0, 2), (2, 4)], lambda start, stop: None, communicate)
    events = tracer.finish()  # used to poll forever
    assert all(work.waited for work in works)
    comm = [event for event in events if event[0] == "comm"]
    assert [event[1] for event in comm] == [0, 2]
    assert all(end is not None and end >= begin for _, _, begin, end in comm)


# -- the auto variant --------------------------------------------------------------------------


def test_auto_variant_is_figured_at_the_n_it_chose():
    result = synthetic(210, {"N=4": 183.75, "auto": 183.75}, 70, 140)
    decision = {"chunks": 4, "source": "trials", "key": "row [4096, 1024, 1024] float32 TP2 cpu",
                "times_ms": {"1": 420.0, "2": 400.0, "4": 380.0}, "noise_ms": 12.6, "coc_calls": [1] * 5}
    result["auto"] = decision
    case = report.summarize_case(result)
    auto, n4 = case["variants"]["auto"], case["variants"]["N=4"]
    assert auto["chunks"] == 4 and auto["decision"] == decision
    for key in ("forward_ms", "backward_ms", "fwd_bwd_ms", "forward_speedup", "backward_speedup",
                "fwd_bwd_speedup", "ideal_ms", "ideal_speedup", "efficiency"):
        assert auto[key] == pytest.approx(n4[key]), key  # same times, same N: same figures
    assert auto["ideal_ms"] == pytest.approx(157.5)


def test_auto_that_chose_megatron_has_no_ideal_saving():
    result = synthetic(210, {"auto": 200}, 70, 140)
    result["auto"] = {"chunks": 1, "source": "trials", "key": "k", "times_ms": {"1": 1.0, "2": 2.0},
                      "noise_ms": 0.1, "coc_calls": [0] * 5}
    auto = report.summarize_case(result)["variants"]["auto"]
    assert auto["chunks"] == 1 and auto["efficiency"] is None and auto["ideal_speedup"] == 1.0
    assert auto["forward_speedup"] == pytest.approx(210 / 200)


def test_table_shows_auto_beside_the_fixed_counts_with_its_decision():
    result = synthetic(210, {"N=2": 180, "N=8": 160, "auto": 160}, 70, 140)
    result["auto"] = {"chunks": 8, "source": "trials", "key": "k", "times_ms": {"1": 4.5, "2": 3.25, "8": 3.0},
                      "noise_ms": 0.14, "coc_calls": [1] * 5}
    table = report.format_table(report.summarize([result]))
    rows = [line.split() for line in table.splitlines()]
    auto_row = next(row for row in rows if row[:2] == ["auto", "N=8"])
    assert auto_row[2] == "160.0"  # its forward median
    assert "auto chose N=8 (trials: N=1 4.50 ms, N=2 3.25 ms, N=8 3.00 ms; noise 0.14 ms)" in table


def test_old_results_without_auto_still_summarize():
    case = report.summarize_case(synthetic(210, {"N=2": 180}, 70, 140))
    assert set(case["variants"]) == {"megatron", "N=2"} and "chunks" not in case["variants"]["N=2"]


@pytest.mark.parametrize("argv,expected", [([], [1, 2, 4, 8, "auto"]), (["--chunks", "2", "AUTO"], [2, "auto"]),
                                           (["--chunks", "4"], [4])])
def test_chunks_option_takes_counts_and_auto(argv, expected):
    from coc_inject.bench.run import build_parser

    assert build_parser().parse_args(argv).chunks == expected


@pytest.mark.parametrize("word", ["0", "-2", "four", "2.5"])
def test_bad_chunks_word_is_a_clear_error(word, capsys):
    from coc_inject.bench.run import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--chunks", "2", word])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"argument --chunks: {word!r} is invalid: expected an integer >= 1" in error and "or auto" in error


@pytest.mark.parametrize("slow,expect_coc,seconds", [((1,), True, 0.3), ((2, 4, 8), False, 0.1)],
                         ids=["megatron-slow", "coc-slow"])
def test_auto_decides_once_before_the_repetitions_and_they_run_its_n(pool2, tmp_path, slow, expect_coc, seconds):
    # a slowed baseline must beat one hiccup's noise (0.3 s); slowed CoC counts lose unless two runs of three
    # hiccup by more than the delay (0.1 s)
    results = pool2.run("bench_cases:auto_variant", case="row-sp", chunks=[2, "auto"], reps=3,
                        tune_cache=str(tmp_path / "tune.json"), slow=slow, seconds=seconds)
    decision = results[0]["auto"]
    for result in results:
        # One decision per rank for the whole case: the untimed call's trials; the warm-up and
        # timed repetitions re-install auto but reuse it (no trials, no cache look-up).
        assert result["decisions_made"] == [("row-sp", decision["chunks"], "trials")]
        assert result["auto"]["chunks"] == decision["chunks"]  # every rank ran the same N
        assert result["timed"]["auto"] == result["timed"]["N=2"] == result["timed"]["megatron"] == 3
    assert (decision["chunks"] > 1) is expect_coc
    assert set(decision["times_ms"]) == {"1", "2", "4", "8"}
    # The timed auto calls ran the decided path: one CoC call each, or Megatron's (none).
    assert decision["coc_calls"] == ([1] * 3 if expect_coc else [0] * 3)


def test_answers_are_awaited_briefly_after_a_failure_and_the_first_failure_sets_the_end(monkeypatch):
    """The rule of the bench's local ranks and the tests' rank pool (ranks.AnswerWait): until the timeout,
    and once a rank failed AFTER_A_FAILURE_S past that failure at most; a second failure adds nothing."""
    from coc_inject.testbed import ranks

    clock = [100.0]
    monkeypatch.setattr(ranks.time, "monotonic", lambda: clock[0])
    endless, timed = ranks.AnswerWait(), ranks.AnswerWait(timeout=60.0)
    assert endless.left() is None and timed.left() == 60.0  # None: without end (an infinite float overflows waits)
    clock[0] = 110.0
    for wait in (endless, timed):
        wait.failure()
    assert endless.left() == timed.left() == ranks.AFTER_A_FAILURE_S
    clock[0] = 112.0
    for wait in (endless, timed):
        wait.failure()  # a second rank's failure: the end stays where the first set it
    assert endless.left() == timed.left() == ranks.AFTER_A_FAILURE_S - 2.0
    clock[0] = 200.0
    assert endless.left() == timed.left() == 0.0
    near_its_end = ranks.AnswerWait(timeout=60.0)  # at 200: until 260
    clock[0] = 258.0
    near_its_end.failure()
    assert near_its_end.left() == 2.0  # the timeout comes first


def test_local_ranks_start_without_coc_variables_and_the_parent_keeps_its_own(monkeypatch):
    import os

    from coc_inject.testbed.ranks import without_coc_variables

    monkeypatch.setenv("COC_PARALLEL_NUM", "4")
    monkeypatch.setenv("USE_COC_FUSED_KERNEL", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with without_coc_variables():
        assert "COC_PARALLEL_NUM" not in os.environ and "USE_COC_FUSED_KERNEL" not in os.environ
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["COC_PARALLEL_NUM"] == "4" and os.environ["USE_COC_FUSED_KERNEL"] == "1"


def _dies_on_rank_1(rank, world, port):
    if rank == 1:
        os._exit(3)
    return "rank 0 answered" if rank == 0 else None


def test_a_rank_that_dies_without_answering_stops_the_run_with_its_exit_code():
    from coc_inject.testbed import ranks

    with pytest.raises(RuntimeError, match="rank 1 exit code 3"):
        ranks.run_local_ranks(_dies_on_rank_1, 2, ranks.free_port())


@pytest.mark.parametrize("cuda, method", [(False, "forkserver"), (True, "spawn")])
def test_local_ranks_are_spawned_where_an_accelerator_is_visible(monkeypatch, cuda, method):
    """A fork server that imported megatron-core may have initialised CUDA: its forked ranks then fail
    at their first CUDA call (seen on an H200), so with a device the ranks are spawned."""
    import torch

    from coc_inject.testbed import ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert ranks.rank_context().get_start_method() == method


def test_local_ranks_start_with_no_cuda_device_where_one_is_visible(monkeypatch):
    """The ranks are CPU ranks: with CUDA hidden, torch's own device checks (dynamo's, in Megatron's
    compiled router) never meet Megatron's CPU shims (a TypeError on an H200 before)."""
    import torch

    from coc_inject.testbed import ranks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    seen = ranks.run_local_ranks(_visible_devices, 2, ranks.free_port())
    assert seen == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def _visible_devices(rank, world, port):
    return os.environ.get("CUDA_VISIBLE_DEVICES") if rank == 0 else None


def _joins_a_group(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        return dist.get_world_size() if rank == 0 else None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("starts", ["the tests' rank pool", "the bench's local ranks"])
def test_ranks_whose_port_was_taken_meanwhile_start_again_on_another(monkeypatch, starts):
    """make test runs two releases' suites side by side: the port free_port found may be taken before
    rank 0 listens on it (EADDRINUSE at a pool's start-up, seen in a fresh-clone run). The ranks start
    again on another port (ranks.on_a_free_port), the other rank, blocked on the lost one, given up on
    a few seconds after rank 0 failed."""
    import socket

    import dist_harness
    from coc_inject.testbed import ranks

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        given = [taken.getsockname()[1]]
        real = ranks.free_port
        monkeypatch.setattr(ranks, "free_port", lambda: given.pop() if given else real())
        if starts == "the bench's local ranks":
            assert ranks.on_a_free_port(lambda port: ranks.run_local_ranks(_joins_a_group, 2, port)) == 2
            assert not given
            return
        pool = dist_harness.RankPool(2)
        try:
            assert not given and pool.broken is None and len(pool.procs) == 2
            assert pool.run("os:getpid") != [None, None]
        finally:
            pool.close()
