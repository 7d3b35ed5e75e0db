"""The one runner of every bench case, inside each rank (spawned by coc_inject.testbed.ranks).

A case hands :func:`measure` its variants as data: ``{name: run}``, Megatron as it is first, where
``run()`` makes one call of the variant and returns its pass times ``{"forward": s, "backward": s}``
(or ``{"fwd_bwd": s}``), or ``(pass times, anything to keep per timed repetition)``. What a variant
installs around its call (patches, the no-op collectives of coc_inject.testbed.link.no_collectives
for the compute-only twin) is the case's run, not the runner's. The runner warms every variant up, then
interleaves them over the repetitions in a rotating order (coc_inject.timer.schedule: drift in the
machine's speed spreads over every variant) and takes the MAX over ranks once at the end: a step
is as slow as its slowest rank (timer.slowest). Figures are made by coc_inject.bench.report.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist

from coc_inject import timer


def progress(tag: str, message: str) -> None:
    """One overwritten stderr line on rank 0 (``tag``: which bench)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        sys.stderr.write(f"\r[{tag}] {message:<72}")
        sys.stderr.flush()


def measure(runs: dict, reps: int, *, device: torch.device, warm_ups: int = 1, tag: str = "coc-inject bench",
            label: str = "") -> tuple:
    """Every run ``warm_ups`` times, then ``reps`` rotating rounds. Returns (times, kept): times
    ``{name: {pass: [seconds per repetition]}}``, the MAX over ranks (the same on every rank); kept
    ``{name: [what the run kept, per timed repetition]}`` (this rank's). ``device``: the one the bench
    runs on, where the group's backend (NCCL, HCCL, gloo) takes the timings' all-reduce."""
    names = list(runs)
    warm, timed = timer.schedule(names, reps, warm_ups)
    for name in warm:
        progress(tag, f"{label}warm-up {name}")
        runs[name]()
    times, kept = {name: {} for name in names}, {name: [] for name in names}
    for index, name in enumerate(timed):
        progress(tag, f"{label}repetition {index // len(names) + 1}/{reps}")
        sample = runs[name]()
        seconds, extra = sample if isinstance(sample, tuple) else (sample, None)
        for phase, value in seconds.items():
            times[name].setdefault(phase, []).append(value)
        if extra is not None:
            kept[name].append(extra)
    return slowest_rank(times, device), kept


def slowest_rank(times: dict, device: torch.device) -> dict:
    """``{name: {pass: [seconds]}}`` with each figure the MAX over ranks (timer.slowest: one all-reduce
    on ``device``, the bench's)."""
    values = iter(timer.slowest([value for passes in times.values() for samples in passes.values()
                                 for value in samples], device))
    return {name: {phase: [next(values) for _ in samples] for phase, samples in passes.items()}
            for name, passes in times.items()}


def fwd_bwd(timed: timer.Timer, step, enter=None):
    """A run: ``step()`` (forward and backward) timed as one pass, inside ``enter()`` if given."""
    def run():
        with (enter or nullcontext)():
            return {"fwd_bwd": timed(step)[1]}
    return run
