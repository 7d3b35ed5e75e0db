"""The one timer: how long a call takes, device-synchronised, over repetitions, the slowest rank's.

* :func:`seconds`: one call's wall time, the device synchronised before and after (CUDA / NPU,
  where its tensors live; nothing on the CPU); :class:`Timer`: the same after a barrier, with the
  device's events where it has them (the bench's timings, every rank starting together);
* :func:`schedule`: warm-up rounds, then timed rounds each rotated by one, so that drift in the
  machine's speed spreads over every candidate; :func:`median`: the median of repetitions;
* :func:`slowest`: the MAX over a process group, one all-reduce on the group's device (NCCL and
  HCCL refuse CPU tensors): a step is as slow as its slowest rank.

Used by the online tuner's trials (tuning/online.py), the bench engine and cases, the self-test
and ``coc-inject tune``. When things happened (timelines, traces) is coc_inject.meter's.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from coc_inject.meter import now


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA / NPU); nothing on the CPU or without a device."""
    kind = getattr(device, "type", None)
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "npu":
        torch.npu.synchronize(device)  # torch_npu registers torch.npu


def seconds(fn, device=None) -> tuple:
    """(fn's result, its wall seconds), ``device`` synchronised before and after."""
    synchronize(device)
    begin = now()
    result = fn()
    synchronize(device)
    return result, now() - begin


def median(fn, reps: int, device=None) -> tuple:
    """(the last result, the median seconds of ``reps`` calls, at least one), each as :func:`seconds`."""
    times, result = [], None
    for _ in range(max(1, reps)):
        result, elapsed = seconds(fn, device)
        times.append(elapsed)
    return result, statistics.median(times)


def align(group, device) -> None:
    """The ranks of ``group`` start together: an all-reduce of nothing on the group's device."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


class Timer:
    """Wall time of a call on every rank, after a barrier (ranks start together), device-synchronised
    (CUDA/NPU events where present). ``timer(fn)`` -> (fn's result, seconds)."""

    def __init__(self, device: torch.device):
        module = getattr(torch, device.type, None)
        self.events = module if device.type in ("cuda", "npu") and hasattr(module, "Event") else None

    def __call__(self, fn):
        dist.barrier()
        if self.events is None:
            return seconds(fn)
        start, end = self.events.Event(enable_timing=True), self.events.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end) / 1e3


def schedule(candidates: list, rounds: int, warm_ups: int = 1) -> tuple[list, list]:
    """``warm_ups`` warm-up rounds (in order), then ``rounds`` timed rounds, each rotated by one:
    drift in the machine's speed spreads over all candidates."""
    timed = []
    for r in range(rounds):
        shift = r % len(candidates)
        timed += candidates[shift:] + candidates[:shift]
    return list(candidates) * warm_ups, timed


def slowest(values: list, device, group=None) -> list:
    """``values`` (seconds), each the MAX over the ranks of ``group`` (default: the world): one
    all-reduce on ``device``, the group's; in a single process, as they are."""
    if not values or not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()
