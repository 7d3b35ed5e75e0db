"""Bench arithmetic (pure) and the emulated link's set-up / teardown contract."""

import os
import subprocess
import sys

import pytest

from coc_inject.bench import link, report


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

    tracer = schedules.TimelineTracer()
    schedules.tracer = tracer
    try:
        schedules.run_compute_first([(0, 2), (2, 4)], lambda start, stop: None, communicate)
    finally:
        schedules.tracer = None
    events = tracer.finish()  # used to poll forever
    assert all(work.waited for work in works)
    comm = [event for event in events if event[0] == "comm"]
    assert [event[1] for event in comm] == [0, 2]
    assert all(end is not None and end >= begin for _, _, begin, end in comm)
