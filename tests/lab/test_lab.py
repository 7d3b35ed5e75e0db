"""The overlap lab (coc_inject/lab, docs/lab.md): its link model, its process group's outputs and
stream semantics on the CPU, the CUDA streams' call contract, and `coc-inject lab` on the tiny model."""

import json
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from coc_inject.lab import links, world
from coc_inject.lab.streams import CudaStreams, Lane
from tests.scope import newest_only

SLOW = replace(links.preset("1gbit"), name="slow", busbw_gbps=1e-3, latency_us=0.0)  # 1 MB/s: 4 KiB hold ~4 ms


def test_link_model_is_nccl_tests_bus_bandwidth():
    link = links.Link("x", 100.0, 0.0, "test")
    gib = 1 << 30
    assert link.seconds("all_gather", gib, 8) == pytest.approx(gib * 7 / 8 / 100e9)
    assert link.seconds("reduce_scatter", gib, 8) == pytest.approx(gib * 7 / 8 / 100e9)
    assert link.seconds("all_to_all", gib, 4) == pytest.approx(gib * 3 / 4 / 100e9)
    assert link.seconds("all_reduce", gib, 8) == pytest.approx(gib * 2 * 7 / 8 / 100e9)
    assert link.seconds("p2p", gib, 8) == pytest.approx(gib / 100e9)
    assert links.Link("y", 100.0, 10.0, "t").seconds("all_reduce", 0, 4) == pytest.approx(6 * 10e-6)
    assert link.zero().seconds("all_reduce", gib, 8) == 0.0
    assert all(p.source for p in links.PRESETS.values())
    with pytest.raises(ValueError, match="--preset 'nope'"):
        links.preset("nope")


def test_outputs_as_if_every_rank_held_this_ranks_data_and_async_waits():
    """Sync calls return with their outputs; an async one's output lands only when its transfer ends
    (after the link's time, on the group's stream), which ``wait()`` waits for."""
    with world.lab_group(SLOW, "cpu", 4) as state:
        x = torch.arange(8.0)
        dist.all_reduce(x)
        assert torch.equal(x, torch.arange(8.0) * 4)
        gathered = torch.empty(4, 3)
        dist.all_gather_into_tensor(gathered, torch.tensor([1.0, 2.0, 3.0]))
        assert torch.equal(gathered, torch.tensor([[1.0, 2.0, 3.0]] * 4))
        counts = torch.empty(32, dtype=torch.long)  # token counts: peer k's are this rank's with blocks k and 0 swapped
        dist.all_gather_into_tensor(counts, torch.tensor([10, 11, 20, 21, 30, 31, 40, 41]))
        assert counts.view(4, 8).tolist() == [[10, 11, 20, 21, 30, 31, 40, 41], [20, 21, 10, 11, 30, 31, 40, 41],
                                              [30, 31, 20, 21, 10, 11, 40, 41], [40, 41, 20, 21, 30, 31, 10, 11]]
        scattered = torch.empty(2)
        dist.reduce_scatter_tensor(scattered, torch.arange(8.0))
        assert torch.equal(scattered, torch.tensor([0.0, 4.0]))
        peak = torch.tensor([5.0])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        assert peak.item() == 5.0
        out = torch.zeros(6)
        dist.all_to_all_single(out, torch.arange(6.0), [1, 2, 1, 2], [1, 2, 1, 2])
        assert torch.equal(out, torch.arange(6.0))
        with pytest.raises(ValueError, match="output splits"):
            dist.all_to_all_single(torch.zeros(6), torch.arange(6.0), [2, 1, 1, 2], [1, 2, 1, 2])

        slow = torch.ones(1024)  # 4 KiB all-reduce of 4: 6 KiB at 1 MB/s, ~6 ms
        began = time.perf_counter()
        work = dist.all_reduce(slow, async_op=True)
        assert slow[0].item() == 1.0 and not work.is_completed()  # in flight: not yet arrived
        work.wait()
        assert slow[0].item() == 4.0 and time.perf_counter() - began >= 0.005

        sent, received = torch.arange(4.0), torch.zeros(4)  # the ring: a receive from rank 3 gets this rank's send to 1
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, received, 3), dist.P2POp(dist.isend, sent, 1)])
        for w in works:
            w.wait()
        assert torch.equal(received, sent)
        assert state.collectives > 0 and state.comm_seconds > 0


def test_one_group_runs_its_transfers_in_issue_order_groups_side_by_side():
    hold = replace(SLOW, busbw_gbps=1e12, latency_us=50_000.0)  # an all-reduce of 2: 2 ring steps of 50 ms
    with world.lab_group(hold, "cpu", 2):
        other = dist.new_group([0, 1])
        began = time.perf_counter()
        works = [dist.all_reduce(torch.ones(1), async_op=True) for _ in range(2)]  # 2 x 100 ms on one stream
        beside = dist.all_reduce(torch.ones(1), group=other, async_op=True)  # on its own group's stream
        beside.wait()
        beside_took = time.perf_counter() - began
        for w in works:
            w.wait()
        took = time.perf_counter() - began
        assert took >= 0.2 and beside_took < 0.19, (took, beside_took)


def test_settings_agreement_is_answered_for_the_absent_ranks():
    from coc_inject.config import CocConfig
    from coc_inject.pipeline import agreement

    with world.lab_group(SLOW, "cpu", 8):
        group = dist.new_group(list(range(8)))
        began = time.perf_counter()
        agreement.ensure_same_config(group, CocConfig(parallel_num=2))
        agreement.ensure_same_config(dist.new_group([0, 1]), CocConfig(parallel_num=2))
        assert time.perf_counter() - began < 5.0  # answered, not the 60 s timeout for 7 ranks that never come


class _Recorder:
    """torch.cuda as CudaStreams uses it, recording the calls (the CUDA path's contract, checked on the CPU)."""

    def __init__(self):
        self.calls, self._current = [], "compute"
        recorder = self

        class Event:
            def __init__(self, **kwargs):
                self.name = f"event{len(recorder.calls)}"

            def record(self, stream):
                recorder.calls.append(("record", self.name, stream.name))

            def query(self):
                return True

        class Stream:
            def __init__(self, name="side", device=None):
                self.name = name

            def wait_event(self, event):
                recorder.calls.append(("wait_event", self.name, event.name))

        self.Event, self.Stream = Event, Stream
        self.side_stream_made = False

    def current_stream(self, device=None):
        return self.Stream(self._current)

    def stream(self, stream):
        recorder = self

        class Context:
            def __enter__(self):
                recorder.calls.append(("enter", stream.name))
                recorder._saved, recorder._current = recorder._current, stream.name

            def __exit__(self, *exc):
                recorder.calls.append(("exit", stream.name))
                recorder._current = recorder._saved
        return Context()

    def _sleep(self, cycles):
        self.calls.append(("sleep", self._current))


class _Tensor:
    def __init__(self, calls):
        self.calls = calls

    def record_stream(self, stream):
        self.calls.append(("record_stream", stream.name))


def test_cuda_stream_contract_as_nccl():
    """The side stream starts after the caller's work (an event recorded on the caller's current stream),
    holds and writes there, records its end; the tensors are recorded on it; wait() makes the stream
    current *at wait time* wait on the end event, with no host sync."""
    cuda = _Recorder()
    streams = CudaStreams("cpu", cuda=cuda, calibrate=False)
    lane, wrote = Lane(streams), []
    token = lane.submit(0.001, 0, lambda: wrote.append(cuda._current), [_Tensor(cuda.calls)])
    assert wrote == ["side"]  # the outputs are written on the side stream
    cuda._current = "later"
    streams.wait(token)
    mark, end = cuda.calls[0][1], token.name
    assert cuda.calls == [("record", mark, "compute"), ("wait_event", "side", mark), ("enter", "side"),
                          ("sleep", "side"), ("record", end, "side"), ("exit", "side"), ("record_stream", "side"),
                          ("wait_event", "later", end)]


@newest_only
def test_lab_command_runs_every_wing_off_and_on_with_equal_losses(tmp_path):
    """`coc-inject lab --model tiny --device cpu` (each wing forced on, one timed step: the CI budget)."""
    out = tmp_path / "lab.json"
    done = subprocess.run([sys.executable, "-m", "coc_inject", "lab", "--model", "tiny", "--device", "cpu", "--on",
                           "fixed", "--steps", "1", "--warmup", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(row["part"], row["wing"]) for row in rows} == {
        ("tiny dense TP2 CP2", wing) for wing in ("linears", "context_parallel", "multi_copy", "all")} | {
        ("tiny MoE TP2 EP2", wing) for wing in ("linears", "multi_copy", "moe", "all")}
    for row in rows:
        assert row["max_loss_diff"] <= 1e-5 * max(1.0, abs(row["losses_off"][0])), row
        assert row["on_collectives"] > row["off_collectives"], row  # the wing ran (more, smaller collectives)
        for field in ("off_ms", "on_ms", "speedup", "compute_ms", "comm_ms", "limit_share"):
            assert row[field] > 0, (field, row)
        assert row["speedup"] == pytest.approx(row["off_ms"] / row["on_ms"])
