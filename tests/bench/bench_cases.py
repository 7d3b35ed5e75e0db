"""Worker functions for tests/bench/test_bench.py: the bench's ``auto`` variant on real megatron-core layers."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def auto_variant(*, case, chunks, reps, tune_cache, slow=(), slow_rank=1, seconds=0.3):
    """measure_case with ``auto``; on ``slow_rank`` the trial runs of the counts in ``slow`` take
    ``seconds`` longer (a real delay, so the decision is known). Counts every decision the
    engine's tuners make while the case is measured."""
    from coc_inject.tuning import online as tuning
    from coc_inject.bench.cases import linears as layers

    decide, chunks_for = tuning.Tuner._decide, tuning.Tuner.chunks
    made = []

    def counting_decide(self, key, group, device, *args):
        decision = decide(self, key, group, device, *args)
        made.append((key.case, decision.chunks, decision.source))
        return decision

    def skewed_chunks(self, key, group, device, rows, run, **kwargs):
        def delayed(n):
            run(n)
            if n in slow and dist.get_rank() == slow_rank:
                time.sleep(seconds)
        return chunks_for(self, key, group, device, rows, delayed, **kwargs)

    tuning.Tuner._decide, tuning.Tuner.chunks = counting_decide, skewed_chunks
    try:
        result = layers.measure_case(layers.CASES[case], m=32, k=16, n=16, dtype=torch.float32,
                                     device=torch.device("cpu"), chunks=chunks, reps=reps,
                                     tune_cache=f"{tune_cache}.rank{dist.get_rank()}")
    finally:
        tuning.Tuner._decide, tuning.Tuner.chunks = decide, chunks_for
    return {"auto": result["auto"], "timed": {v: len(t["forward"]) for v, t in result["times"].items()},
            "decisions_made": made}


def compute_only_collectives():
    """Collectives inside the compute-only twin (coc_inject.testbed.link.no_collectives) and after it:
    a float collective does nothing (all_reduce leaves its tensor, a gather zero-fills its output), an
    integer one still runs (its result steers control flow: the MoE dispatcher's token counts)."""
    from coc_inject.testbed import link

    rank, world = dist.get_rank(), dist.get_world_size()
    with link.no_collectives():
        floats = torch.full((3,), float(rank + 1))
        dist.all_reduce(floats)
        waited = torch.full((3,), float(rank + 1))
        work = dist.all_reduce(waited, async_op=True)
        done = work.wait()
        integers = torch.full((3,), rank + 1, dtype=torch.int64)
        dist.all_reduce(integers)
        gathered_floats = torch.full((world,), -1.0)
        dist.all_gather_into_tensor(gathered_floats, torch.tensor([float(rank + 1)]))
        gathered_integers = torch.full((world,), -1, dtype=torch.int32)
        dist.all_gather_into_tensor(gathered_integers, torch.tensor([rank + 1], dtype=torch.int32))
        exchanged = torch.empty(world, dtype=torch.int64)
        dist.all_to_all_single(exchanged, torch.arange(world, dtype=torch.int64) + 10 * rank)
    after = torch.full((3,), float(rank + 1))
    dist.all_reduce(after)
    return {"floats": floats.tolist(), "waited": waited.tolist(), "done": done, "integers": integers.tolist(),
            "gathered_floats": gathered_floats.tolist(), "gathered_integers": gathered_integers.tolist(),
            "exchanged": exchanged.tolist(), "after": after.tolist()}
