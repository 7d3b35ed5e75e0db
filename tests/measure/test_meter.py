"""COC_MEASURE's meter on constructed schedules whose answers are known (one process, no network).

The collectives are fakes with the signature of torch.distributed's (``fake(*tensors, group=None,
async_op=False)``), wrapped by the meter's own ``metered.wrapper``: a fake network runs each one for
a known duration (collectives on one group queue behind each other) and completes its work's real
``torch.futures.Future`` at the true end, which it notes. Times are only ever compared with those
known sleeps (400 ms, generous: the machine is shared) within a tolerance. Then: steps cut at the
optimizer step, auto's trials left out, the warnings, the installation's undo, and the device
event path against tests/fakes/device_events.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from coc_inject import log, meter, trial
from coc_inject.config import CocConfig
from coc_inject.measure import advice, clocks, metered
from coc_inject.measure.exposure import Exposure
from fakes.device_events import FakeDevice

D = 0.400  # a collective's time on the fake network, seconds (long: the machine is shared, threads wake late)
TOLERANCE = 0.20  # of D: 80 ms, against a busy machine's late wake-ups; every claim below is about D (400 ms) or more


class FakeNetwork:
    """Runs fake collectives: each takes ``duration`` on the network, from its issue or, where another
    is in flight on its group, from that one's true end (a queue per group); its work's future
    completes at its own end, which the network notes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queues: dict = {}  # group -> [span index, ...] not yet finished, the first in flight
        self.spans: list = []  # [name, group, true start, true end], in issue order
        self.issued = 0

    def _start(self, index: int, duration: float, future) -> None:
        self.spans[index][2] = meter.now()

        def finish():
            with self._lock:
                self.spans[index][3] = meter.now()
                queue = self._queues[self.spans[index][1]]
                queue.pop(0)
                following = queue[0] if queue else None
            future.set_result(None)
            if following is not None:
                self._start(*following)

        timer = threading.Timer(duration, finish)
        timer.daemon = True
        timer.start()

    def collective(self, name: str, duration: float = D):
        network = self

        def fake(*tensors, group=None, async_op=False, op=None):
            future = torch.futures.Future()
            with network._lock:
                network.issued += 1
                index = len(network.spans)
                network.spans.append([name, id(group), None, None])
                queue = network._queues.setdefault(id(group), [])
                queue.append((index, duration, future))
                first = len(queue) == 1
            if first:
                network._start(index, duration, future)
            work = FakeWork(future)
            if not async_op:
                work.wait()
                return None
            return work

        fake.__name__ = name
        return fake


class FakeWork:
    def __init__(self, future):
        self._future = future

    def wait(self, timeout=None):
        self._future.wait()
        return True

    def get_future(self):
        return self._future


@pytest.fixture
def measured():
    """``measured(config) -> Exposure`` armed (module and optimizer hooks), disarmed after the test."""
    made = []

    def make(config=None, **fields):
        exposure = Exposure(config or CocConfig(**{"measure": (1, None), **fields}))
        exposure.arm()
        made.append(exposure)
        return exposure

    yield make
    for exposure in made:
        exposure.disarm()


def close(value: float, truth: float, tolerance: float = TOLERANCE * D) -> bool:
    return abs(value - truth) <= tolerance


def one_step(exposure):
    exposure.end_step()
    return exposure.per_step[-1] if exposure.per_step else None


# --- the numbers on known schedules ------------------------------------------------------


def test_waited_for_at_once_is_fully_exposed(measured):
    exposure, network = measured(), FakeNetwork()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce"))
    work = all_reduce(torch.zeros(4), async_op=True)
    issued = meter.now()
    work.wait()
    waited = meter.now()
    exposure.end_step()
    (_, _, start, end), total = network.spans[0], exposure.first["total"]
    assert total["exposed_s"] <= waited - issued  # the wait, nothing more
    assert end - start >= D  # the fake ran as long as asked, at least (a loaded machine: later)
    assert total["collectives"] == 1 and total["bytes"] == 16
    assert close(total["exposed_s"], end - start) and close(total["communication_s"], end - start)
    assert total["hidden_pct"] < 100 * TOLERANCE


def test_covered_by_longer_compute_is_fully_hidden(measured):
    exposure, network = measured(), FakeNetwork()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce"))
    work = all_reduce(torch.zeros(4), async_op=True)
    time.sleep(2 * D)  # compute, longer than the collective
    work.wait()
    exposure.end_step()
    (_, _, start, end), total = network.spans[0], exposure.first["total"]
    assert total["exposed_s"] < TOLERANCE * D
    assert close(total["communication_s"], end - start)  # the network's time, not until the late wait
    assert total["hidden_pct"] > 100 - 100 * TOLERANCE
    assert exposure.first["step_s"] >= 2 * D


def test_half_covered_is_half_hidden(measured):
    exposure, network = measured(), FakeNetwork()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce"))
    work = all_reduce(torch.zeros(4), async_op=True)
    time.sleep(D / 2)
    waited_from = meter.now()
    work.wait()
    exposure.end_step()
    (_, _, start, end), total = network.spans[0], exposure.first["total"]
    assert close(total["exposed_s"], end - waited_from)
    assert close(total["communication_s"], end - start)
    assert close(total["hidden_s"], waited_from - start)
    assert 20 <= total["hidden_pct"] <= 80  # about half: D/2 slept, which a busy machine may overshoot


def test_a_synchronous_call_is_exposed_for_all_its_communication(measured):
    exposure, network = measured(), FakeNetwork()
    all_gather = metered.wrapper(exposure, "all_gather_into_tensor", network.collective("all_gather_into_tensor"))
    assert all_gather(torch.zeros(8), torch.zeros(4)) is None  # the call's own result
    exposure.end_step()
    (_, _, start, end), total = network.spans[0], exposure.first["total"]
    assert total["bytes"] == 48
    assert total["exposed_s"] == pytest.approx(total["communication_s"], abs=1e-9)
    assert close(total["exposed_s"], end - start) and total["hidden_pct"] < 1e-6


def test_a_collective_queued_behind_another_on_its_group_is_not_charged_its_time(measured):
    exposure, network = measured(), FakeNetwork()
    first_group, second_group = object(), object()
    exposure.group_name = lambda group: {id(first_group): "a", id(second_group): "b"}[id(group)]
    wrapped = {name: metered.wrapper(exposure, name, network.collective(name))
               for name in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor")}
    queued = [wrapped["all_reduce"](torch.zeros(4), group=first_group, async_op=True),
              wrapped["reduce_scatter_tensor"](torch.zeros(2), torch.zeros(4), group=first_group, async_op=True),
              wrapped["all_gather_into_tensor"](torch.zeros(8), torch.zeros(4), group=second_group, async_op=True)]
    for work in queued:
        work.wait()
    exposure.end_step()
    spans = {name: end - start for name, _, start, end in network.spans}
    rows = exposure.first["collectives"]
    # one name per operation, whichever torch form issued it (metered.OPERATION)
    assert set(rows) == {"a all_reduce", "a reduce_scatter", "b all_gather"}
    for (name, _, _, _), key in zip(network.spans, ("a all_reduce", "a reduce_scatter", "b all_gather")):
        assert spans[name] >= D
        assert close(rows[key]["communication_s"], spans[name]), (key, rows[key], spans)
    # the second on group a went out with the first and waited its turn: 2 D in flight, D its own
    assert network.spans[1][2] >= network.spans[0][3] and network.spans[1][3] - network.spans[0][2] >= 2 * D
    assert close(exposure.first["total"]["communication_s"], sum(spans.values()), 3 * TOLERANCE * D)


# --- steps -------------------------------------------------------------------------------


class Model:
    """A module forward (what the meter counts to tell a step) and two optimizers stepping back to back,
    as Megatron's chained optimizer's inner ones do."""

    def __init__(self):
        self.module = torch.nn.Linear(2, 2)
        weights, bias = self.module.parameters()
        self.optimizers = [torch.optim.SGD([weights], lr=0.0), torch.optim.SGD([bias], lr=0.0)]

    def step(self, collective, calls: int = 1):
        self.module(torch.zeros(1, 2))
        for _ in range(calls):
            collective(torch.zeros(4))
        for optimizer in self.optimizers:
            optimizer.step()


def test_inner_optimizers_stepping_back_to_back_end_one_step(measured):
    exposure, network, model = measured(), FakeNetwork(), Model()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce", 0.001))
    model.step(all_reduce, calls=2)
    assert exposure.step == 2 and [row["step"] for row in exposure.per_step] == [1]
    model.step(all_reduce, calls=3)
    assert exposure.step == 3
    assert [(row["step"], row["total"]["collectives"]) for row in exposure.per_step] == [(1, 2), (2, 3)]
    for optimizer in model.optimizers:  # no forward since: not a step
        optimizer.step()
    assert exposure.step == 3


def test_a_step_range_records_only_its_steps(measured):
    exposure, network, model = measured(measure=(2, 3)), FakeNetwork(), Model()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce", 0.001))
    seen = []
    for step in range(1, 6):
        seen.append(exposure.recording)
        model.step(all_reduce, calls=step)
    assert seen == [False, True, True, False, False]
    assert network.issued == 1 + 2 + 3 + 4 + 5  # every call went through
    assert [(row["step"], row["total"]["collectives"]) for row in exposure.per_step] == [(2, 2), (3, 3)]
    assert exposure.first["step"] == 2 and exposure.total["total"]["collectives"] == 5
    assert exposure.report()["measured_steps"] == [2, 3]


def test_module_hooks_claim_only_measured_steps_and_go_after_the_last(measured):
    """Outside COC_MEASURE's range the module hooks only count forwards (no stack, no autograd node
    claimed); past the range's end they and the optimizer hook are removed (#41 item 8)."""
    exposure, network, model = measured(measure=(2, 2)), FakeNetwork(), Model()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce", 0.001))
    claimed = []
    for step in range(1, 5):
        x = torch.ones(1, 2, requires_grad=True)
        out = model.module(x)
        claimed.append("coc_layer" in out.grad_fn.metadata)
        all_reduce(torch.zeros(4))
        for optimizer in model.optimizers:
            optimizer.step()
        if step == 2:
            assert exposure.layers._handles == [] and exposure._step_hook is None
    assert claimed == [False, True, False, False]
    assert [row["step"] for row in exposure.per_step] == [2] and exposure.step == 3  # no step counted after


def test_nothing_is_metered_while_a_device_graph_is_captured(measured, monkeypatch):
    """A collective issued while the current stream is captured (CUDA graphs) is called through: no
    event recorded (it would be replayed with the graph, not timed), no record (#41 item 8)."""
    device = FakeDevice()
    device.is_current_stream_capturing = lambda: True
    monkeypatch.setattr(clocks, "device_module", lambda device_type: device if device_type == "meta" else None)
    exposure = measured()
    calls = []
    all_reduce = metered.wrapper(exposure, "all_reduce", lambda tensor, **kwargs: calls.append(tensor))
    all_reduce(torch.empty(4, device="meta"))
    assert len(calls) == 1 and device.calls == [] and exposure.issued == 0
    device.is_current_stream_capturing = lambda: False
    all_reduce(torch.empty(4, device="meta"))
    assert len(calls) == 2 and exposure.issued == 1 and "record" in device.names()


def test_the_end_of_run_line_and_warnings_cover_the_steady_steps(measured, said, monkeypatch):
    """#43 items 1 and 3: the first measured step and any step with auto's trials are left out of the
    steady figures; the end of the run says them on rank 0 with the steps they cover, and judges
    COC_MEASURE_WARN on them."""
    monkeypatch.setattr(advice, "_on_cuda", lambda: False)
    config = CocConfig(parallel_num=2, measure=(1, None), measure_warn=50)
    exposure, network, model = measured(config), FakeNetwork(), Model()
    fast = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce", 0.001))
    engine = _issued_by("coc_inject.linears.engine_of_the_test")

    def hidden(tensor):  # issued, then covered by compute longer than it
        work = engine(fast, tensor, async_op=True)
        time.sleep(0.2)  # long against a late timer thread (the collective itself takes 1 ms)
        work.wait()

    def exposed_with_a_trial(tensor):
        with trial.isolated([model.module]):
            pass
        engine(fast, tensor)  # waited for at once

    for step in range(1, 6):
        model.step(exposed_with_a_trial if step in (1, 3) else hidden)
    exposure.finish()
    assert exposure.steady_steps == [2, 4, 5] and exposure.trial_steps == [1, 3]
    report = exposure.report()
    assert report["steady"]["steps"] == 3 and report["steady"]["wings"]["linears"]["hidden_pct"] > 50
    (line,) = [text for text in said() if text.startswith("end of run")]
    assert line.startswith("end of run, steady steps 2, 4-5, left out: steps 1, 3:"), line
    assert exposure.warnings == []  # the steady steps hid more than 50%; steps 1 and 3 alone would warn


@pytest.fixture
def said():
    """The meter's log lines (INFO and above) while the test runs."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.configure("info")
    log.logger.addHandler(handler)
    yield lambda: [record.getMessage() for record in records]
    log.logger.removeHandler(handler)


def test_a_line_every_k_measured_steps(measured, said):
    exposure, network, model = measured(measure_every=2), FakeNetwork(), Model()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce", 0.001))
    for step in range(1, 6):
        model.step(all_reduce, calls=step)
    lines = [line for line in said() if line.startswith(("step", "steady"))]
    # the first measured step alone, then every 2 steady steps (the first left out of them)
    assert [line.split(":")[0] for line in lines] == ["step 1", "steady steps 2-3", "steady steps 4-5"]
    assert ", 1 collectives)" in lines[0]
    assert ", 5 collectives)" in lines[1] and ", 9 collectives)" in lines[2]


def test_auto_trials_are_not_recorded(measured):
    exposure, network, model = measured(), FakeNetwork(), Model()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce", 0.001))

    def with_a_trial(tensor):
        with trial.isolated([model.module]):
            assert trial.active()
            all_reduce(tensor)
            all_reduce(tensor)
        all_reduce(tensor)

    model.step(with_a_trial)
    assert network.issued == 3
    assert exposure.first["total"]["collectives"] == 1


# --- warnings ----------------------------------------------------------------------------


def _issued_by(module_name: str):
    """A caller whose code is ``module_name``'s, as the meter reads the stack (a wing's engine)."""
    namespace = {"__name__": module_name}
    exec("def call(collective, *args, **kwargs):\n    return collective(*args, **kwargs)\n", namespace)
    return namespace["call"]


def test_a_wing_hiding_less_than_the_threshold_is_warned_about(measured, said, monkeypatch):
    monkeypatch.setattr(advice, "_on_cuda", lambda: False)
    config = CocConfig(parallel_num=2, measure=(1, None), measure_warn=50)
    exposure, network, model = measured(config), FakeNetwork(), Model()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce"))
    engine = _issued_by("coc_inject.linears.engine_of_the_test")
    model.step(lambda tensor: engine(all_reduce, tensor, async_op=True).wait())  # waited for at once
    assert exposure.warnings == []  # judged at the end of the run, not on the first step
    exposure.finish()
    row = exposure.first["wings"]["linears"]
    assert row["hidden_pct"] < 50 and row["exposed_s"] >= (1 - TOLERANCE) * D
    (warning,) = exposure.warnings
    assert warning.startswith("COC_MEASURE: linears hid ") and "COC_MEASURE_WARN=50" in warning
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in warning  # not on CUDA
    assert warning in said()
    # on CUDA, the hint, unless it is 1
    monkeypatch.setattr(advice, "_on_cuda", lambda: True)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    (warning,) = advice.warnings(config, exposure.first, 1)
    assert "CUDA_DEVICE_MAX_CONNECTIONS is unset: the chunked pipeline needs 1" in warning
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert "CUDA_DEVICE_MAX_CONNECTIONS is 8" in advice.warnings(config, exposure.first, 1)[0]
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in advice.warnings(config, exposure.first, 1)[0]
    # a threshold below what it hid: no warning; 0: never
    assert advice.warnings(CocConfig(parallel_num=2, measure=(1, None), measure_warn=0), exposure.first, 1) == []


def test_a_wing_hiding_enough_is_not_warned_about(measured, monkeypatch):
    monkeypatch.setattr(advice, "_on_cuda", lambda: True)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    config = CocConfig(parallel_num=2, measure=(1, None), measure_warn=50)
    exposure, network, model = measured(config), FakeNetwork(), Model()
    all_reduce = metered.wrapper(exposure, "all_reduce", network.collective("all_reduce"))
    engine = _issued_by("coc_inject.pipeline.engine_of_the_test")

    def hidden(tensor):
        work = engine(all_reduce, tensor, async_op=True)
        time.sleep(2 * D)
        work.wait()

    model.step(hidden)
    assert exposure.first["wings"]["linears"]["hidden_pct"] > 90
    assert exposure.warnings == []


# --- the installation --------------------------------------------------------------------


def _collectives_and_aliases():
    import importlib

    import torch.distributed as dist

    from coc_inject import dist_interception

    where = [(dist, name) for name in dist_interception.EVERY_COLLECTIVE if hasattr(dist, name)]
    for module_name, aliases in dist_interception.MEGATRON_ALIASES.items():
        module = importlib.import_module(module_name)
        where += [(module, alias) for alias in aliases if hasattr(module, alias)]
    return {(owner.__name__, name): getattr(owner, name) for owner, name in where}, where


def test_install_then_uninstall_puts_every_collective_and_alias_back(monkeypatch):
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    from coc_inject import job
    from coc_inject.measure import install

    before, where = _collectives_and_aliases()
    assert len([key for key in before if key[0] != "torch.distributed"]) == 5  # Megatron's aliases
    hooks = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
             len(optim_module._global_optimizer_post_hooks))
    environment = dict(os.environ)
    try:
        exposure = install.install(CocConfig(measure=(1, None)))
        assert job.current().exposure is exposure and install.install(job.current().config) is exposure
        for owner, name in where:
            now = getattr(owner, name)
            assert now is not before[(owner.__name__, name)], name
            assert now.__wrapped__ is before[(owner.__name__, name)], name  # the meter's, round the original
        assert len(nn_module._global_forward_pre_hooks) == hooks[0] + 1  # the layers' (the coverage's own
        assert len(optim_module._global_optimizer_post_hooks) > hooks[2]  # step hook comes with it)
    finally:
        job.uninstall()
        os.environ.clear()
        os.environ.update(environment)
    for owner, name in where:
        assert getattr(owner, name) is before[(owner.__name__, name)], name
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
            len(optim_module._global_optimizer_post_hooks)) == hooks
    assert job.current() is None


# --- the device's events (tests/fakes/device_events.py) ---------------------------------


def test_device_events_recorded_per_call_resolved_later_synchronised_once_at_the_end(measured, monkeypatch):
    device = FakeDevice()
    monkeypatch.setattr(clocks, "device_module", lambda device_type: device if device_type == "meta" else None)
    exposure = measured()
    done_at = {}

    def fake(tensor, group=None, async_op=False):  # the stream waits until the collective is done
        end = device.now + 10.0
        if not async_op:
            device.now = end
            return None
        done_at["work"] = end

        class Work:
            def wait(self):
                device.now = max(device.now, done_at["work"])

        return Work()

    all_reduce = metered.wrapper(exposure, "all_reduce", fake)
    x = torch.empty(4, device="meta")
    # step 1: issued at 0 ms (done at 10), compute to 5, waited 5 -> 10; then a synchronous one 20 -> 30
    work = all_reduce(x, async_op=True)
    device.now = 5.0
    work.wait()
    device.now = 20.0
    all_reduce(x)
    assert device.calls and set(device.names()) == {"Event", "record"}  # the hot path: no query, no sync
    assert all(call == ("Event", True) for call in device.calls if call[0] == "Event")
    assert device.names().count("Event") == device.names().count("record") == 1 + 1 + 2 + 2  # the anchor, each call's marks
    calls = len(device.calls)
    exposure.end_step()  # the device has not got there yet: kept, no host sync
    assert exposure.first is None and "synchronize" not in device.names() and "elapsed_time" not in device.names()
    assert "query" in device.names(calls)

    # step 2: the device has finished step 1 (not step 2) by its end
    device.now = 100.0
    all_reduce(x)
    device.run_until(30.0)
    calls = len(device.calls)
    exposure.end_step()
    assert "synchronize" not in device.names() and "elapsed_time" in device.names(calls)
    total = exposure.first["total"]
    assert exposure.first["step"] == 1 and total["collectives"] == 2 and len(exposure.per_step) == 1
    assert total["exposed_s"] == pytest.approx(0.005 + 0.010, abs=1e-9)
    assert total["communication_s"] == pytest.approx(0.010 + 0.010, abs=1e-9)
    assert total["hidden_pct"] == pytest.approx(25.0)
    assert exposure.report()["clock"] == "fake_cuda events"

    # the end: one synchronisation, step 2 resolved
    exposure.finish()
    assert device.names().count("synchronize") == 1
    assert [row["step"] for row in exposure.per_step] == [1, 2] and exposure.total["total"]["collectives"] == 3
    assert exposure.per_step[1]["total"]["exposed_s"] == pytest.approx(0.010, abs=1e-9)
