"""COC_MEASURE on real ranks: a TP 2 (sequence-parallel) GPT block of real megatron-core layers trained
two steps on 2 gloo processes, coc-inject installed the way a job gets it (the bootstrap's hooks on
``megatron.core.tensor_parallel.layers``, settings from the environment).

* Off costs nothing: with COC_MEASURE unset (CoC's linears on), torch.distributed's collectives are
  the originals, no Exposure exists and the meter's clock is never read on the step's path.
* On: the report's wings ("linears" for the chunks, "megatron tensor-parallel" for Megatron's own
  mappings), Megatron's qualified layer names, both phases, every collective the step issued
  counted (against a recorder of the test's own beneath the meter), and losses bitwise those of the
  same run unmeasured.

The worker functions live here too (``test_meter_multirank:<name>``); the ranks start once per module.
"""

from __future__ import annotations

import gc
import os
import sys
from types import SimpleNamespace

import pytest

VARIABLES = ("COC_MEASURE", "COC_PARALLEL_NUM", "COC_MEASURE_EVERY", "COC_MEASURE_WARN", "COC_TRACE")
BLOCK = SimpleNamespace(layers=1, hidden=64, heads=4, ffn=128, seq=32, batch=2)
STEPS = 2


def _through_the_hooks(environ: dict) -> None:
    """coc-inject as the bootstrap installs it: ``environ``'s settings, each hook of a module imported."""
    import importlib

    from coc_inject import bootstrap, job

    for name in VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(environ)
    job.forget()
    for hook, target in ((bootstrap.HOOK, bootstrap.TARGET), *bootstrap.WING_HOOKS):
        if target in sys.modules:
            module_name, function = hook.split(":")
            getattr(importlib.import_module(module_name), function)(sys.modules[target])


def run_block(environ: dict) -> dict:
    """Two training steps of the block with ``environ``'s settings; what the test checks."""
    import torch
    import torch.distributed as dist

    from coc_inject import dist_interception, job, meter
    from coc_inject.testbed.models import build_block

    originals = {name: getattr(dist, name) for name in dist_interception.EVERY_COLLECTIVE if hasattr(dist, name)}
    _through_the_hooks(environ)
    clock_reads = [0]
    real_now = meter.now

    def counted_now():
        clock_reads[0] += 1
        return real_now()

    recorded = []

    def recorder(name, current):
        def recording(*args, **kwargs):
            if exposure is None or not exposure._own:  # the meter's own reduce at a step's end (peers.py) left out
                recorded.append(name)
            return current(*args, **kwargs)
        return recording

    try:
        installation = job.current()
        exposure = installation.exposure if installation is not None else None
        wrapped = sorted(name for name, function in originals.items() if getattr(dist, name) is not function)
        block, hidden, mask = build_block(BLOCK)
        optimizer = torch.optim.SGD(block.parameters(), lr=0.1)
        losses = []
        meter.now = counted_now
        try:
            with dist_interception.replaced(recorder, dist_interception.EVERY_COLLECTIVE):
                for _ in range(STEPS):
                    optimizer.zero_grad()
                    out = block(hidden.clone().requires_grad_(True), mask)
                    loss = out.float().pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    losses.append(loss.item())
        finally:
            meter.now = real_now
        report = exposure.report() if exposure is not None else None
    finally:
        job.uninstall()
        for name in VARIABLES:
            os.environ.pop(name, None)
        job.forget()
    gc.collect()
    measure_module = sys.modules.get("coc_inject.measure.exposure")
    live = 0 if measure_module is None else sum(isinstance(o, measure_module.Exposure) for o in gc.get_objects())
    return {"losses": losses, "report": report, "exposure": exposure is not None, "wrapped": wrapped,
            "clock_reads": clock_reads[0], "recorded": recorded,
            "restored": all(getattr(dist, name) is function for name, function in originals.items()),
            "live_exposures": live if exposure is None else None}


@pytest.fixture(scope="module")
def runs(pool2):
    """Each configuration's run on both ranks: CoC's linears off / on (2 chunks), unmeasured / measured."""
    configurations = {"off": {}, "measured": {"COC_MEASURE": "1"}, "coc": {"COC_PARALLEL_NUM": "2"},
                      "coc measured": {"COC_PARALLEL_NUM": "2", "COC_MEASURE": "1"}}
    return {name: pool2.run("test_meter_multirank:run_block", environ=environ)
            for name, environ in configurations.items()}


def test_off_costs_nothing(runs):
    for rank, result in enumerate(runs["coc"]):
        assert result["exposure"] is False and result["report"] is None, rank
        assert result["wrapped"] == [] and result["restored"], rank  # torch.distributed's own functions
        assert result["live_exposures"] == 0, rank
        assert result["clock_reads"] == 0, rank  # coc_inject.meter.now never called on the step's path
        assert len(result["recorded"]) > 0, rank  # the step did communicate


def test_measured_wraps_every_collective_and_reads_the_clock(runs):
    import torch.distributed as dist

    from coc_inject import dist_interception

    for rank, result in enumerate(runs["coc measured"]):
        assert result["exposure"] is True and result["restored"], rank  # put back by job.uninstall()
        assert result["wrapped"] == sorted(name for name in dist_interception.EVERY_COLLECTIVE if hasattr(dist, name))
        assert result["clock_reads"] > 0, rank  # the counter would have seen the meter


def _layers(report):
    return [key.split(" | ") for key in report["total"]["layers"]]


def test_the_report_names_the_wings_layers_and_phases(runs):
    for rank, result in enumerate(runs["coc measured"]):
        report = result["report"]
        assert report["clock"] == "host" and [row["step"] for row in report["per_step"]] == list(range(1, STEPS + 1))
        wings = report["total"]["wings"]
        assert "linears" in wings and wings["linears"]["collectives"] > 0, wings
        assert set(wings) <= {"linears", "megatron tensor-parallel"}, wings
        layers = _layers(report)
        assert {phase for _, phase, _ in layers} == {"forward", "backward"}, layers
        named = {name for name, _, wing in layers if wing == "linears"}
        assert any(name.endswith("mlp.linear_fc1") for name in named), named
        assert any(name.endswith("self_attention.linear_proj") for name in named), named
        assert all(name.startswith("layers.0.") for name, _, _ in layers if name != "(no layer)"), layers
    for rank, result in enumerate(runs["measured"]):  # the linears off: Megatron's own mappings
        wings = result["report"]["total"]["wings"]
        assert set(wings) == {"megatron tensor-parallel"}, wings
        layers = _layers(result["report"])
        assert {phase for _, phase, _ in layers} == {"forward", "backward"}, layers
        assert any(name.endswith("mlp.linear_fc2") for name, _, _ in layers), layers


def test_every_collective_the_steps_issued_is_counted(runs):
    for name in ("measured", "coc measured"):
        for rank, result in enumerate(runs[name]):
            total = result["report"]["total"]["total"]
            assert total["collectives"] == len(result["recorded"]) > 0, (name, rank)
            assert sum(row["total"]["collectives"] for row in result["report"]["per_step"]) == total["collectives"]
            assert total["bytes"] > 0 and total["communication_s"] > 0 and total["exposed_s"] >= 0


def test_measuring_changes_nothing_of_the_training(runs):
    for unmeasured, measured in (("off", "measured"), ("coc", "coc measured")):
        for rank in range(2):
            assert runs[measured][rank]["losses"] == runs[unmeasured][rank]["losses"], (measured, rank)
            assert runs[measured][rank]["recorded"] == runs[unmeasured][rank]["recorded"], (measured, rank)


def selftest_rows(broken: bool = False) -> list:
    """``coc-inject selftest``'s meter case on this rank (``broken``: a meter that never counts a wait)."""
    import torch
    import torch.distributed as dist

    from coc_inject.measure import records
    from coc_inject.selftest import meter
    from coc_inject.selftest.common import Context

    ctx = Context(torch.device("cpu"), "float32", 1, dist.group.WORLD, dist.get_world_size(), dist.get_rank(), None)
    exposed = records.Collective.exposed
    if broken:
        records.Collective.exposed = property(lambda self: 0.0)
    try:
        return meter.run(ctx)
    finally:
        records.Collective.exposed = exposed


def test_the_selftest_case_passes_and_fails_a_wrong_meter(pool2):
    from coc_inject.selftest import meter

    for rows in pool2.run("test_meter_multirank:selftest_rows"):
        assert [row["case"] for row in rows] == ["waited at once: all exposed", "covered by 2x compute: hidden"]
        assert all(row["passed"] and row["bound"] == 0.1 for row in rows), rows
        exposed, hidden = rows
        assert exposed["coc_ms"] >= 1e3 * meter.DURATION * 0.9 and exposed["hidden_pct"] < 10
        assert hidden["coc_ms"] < 1e3 * meter.DURATION * 0.1 and hidden["hidden_pct"] > 90
    for rows in pool2.run("test_meter_multirank:selftest_rows", broken=True):
        assert [row["passed"] for row in rows] == [False, True], rows
        assert rows[0]["errors"]["exposed"] > 0.9


def skewed_steps(late_rank: int, sleep_s: float, steps: int = 3, numel: int = 1 << 18) -> dict:
    """Each step: ``late_rank`` computes ``sleep_s`` longer (a real sleep), then every rank all-reduces over
    the world through the meter; an optimizer step ends the step. The report's figures, and the lines said."""
    import logging

    import torch
    import torch.distributed as dist

    from coc_inject import job, log
    from coc_inject.config import CocConfig
    from coc_inject.measure import install

    exposure = install.install(CocConfig(measure=(1, None)))
    log.configure("info")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    log.logger.addHandler(handler)
    try:
        parameter = torch.nn.Parameter(torch.zeros(2))
        optimizer = torch.optim.SGD([parameter], lr=0.0)
        module = torch.nn.Linear(2, 2)
        for _ in range(steps):
            module(torch.zeros(1, 2))  # a forward: the meter tells a step by it
            if dist.get_rank() == late_rank:
                import time

                time.sleep(sleep_s)
            dist.all_reduce(torch.ones(numel))
            optimizer.step()
        exposure.finish()
        report = exposure.report()
    finally:
        log.logger.removeHandler(handler)
        job.uninstall()
    return {"total": report["total"]["total"], "steady": report["steady"]["total"], "said": said}


def test_waiting_for_a_slower_rank_is_told_apart_from_the_link(pool2):
    """#43 item 2: rank 1 reaches each all-reduce 600 ms late. Rank 0's wait for it is booked as waiting for
    slower ranks, not as exposed communication; its communication is the link's, as rank 1's (+-10%, with a
    floor for this machine's scheduling); rank 1 waits for no one."""
    early, late = pool2.run("tests.measure.test_meter_multirank:skewed_steps", late_rank=1, sleep_s=0.6)
    steps = 3
    # 600 ms, not 300: a sleep overshoot on a busy 2-core machine stays well inside 15%
    assert early["total"]["peers_s"] == pytest.approx(0.6 * steps, rel=0.15), early["total"]
    assert late["total"]["peers_s"] < 0.02 * steps, late["total"]
    link = late["total"]["communication_s"]
    assert early["total"]["communication_s"] == pytest.approx(link, rel=0.10, abs=0.01 * steps)
    assert early["total"]["exposed_s"] < 0.05 * steps, early["total"]
    assert any("waiting for slower ranks (not charged to any wing)" in line for line in early["said"]), early["said"]
