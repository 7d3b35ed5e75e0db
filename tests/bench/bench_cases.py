"""Worker functions for tests/bench/test_bench.py: the bench's ``auto`` variant on real megatron-core layers."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def auto_variant(*, case, chunks, reps, tune_cache, slow=(), slow_rank=1, seconds=0.03):
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
