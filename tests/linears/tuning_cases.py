"""Worker functions for tests/linears/test_tuning.py: real megatron-core layers with COC_PARALLEL_NUM=auto."""

from __future__ import annotations

import io
import logging
import time

import torch
import torch.distributed as dist

from layer_cases import build_layer, make_input, relative_error, run_layer


def _skewing(tuner, slow_chunks, seconds):
    """Make this rank's trial runs of ``slow_chunks`` take ``seconds`` longer (a real delay)."""
    decide = tuner.chunks

    def chunks(key, group, device, rows, run, **kwargs):
        def skewed(n):
            run(n)
            if n in slow_chunks:
                time.sleep(seconds)
        return decide(key, group, device, rows, skewed, **kwargs)

    tuner.chunks = chunks


def auto_call(kind, *, sequence_parallel, cache=None, deterministic=False, skew=None, calls=2, seq=16,
              candidates=(2, 4, 8)):
    """Unpatched vs auto on the same layer; ``skew``: {rank: (chunk counts, seconds)} delays.

    Returns errors, decisions (chunks, source), CoC calls and the log."""
    from coc_inject import job, log
    from coc_inject.linears import install as linears
    from coc_inject.config import AUTO, CocConfig

    linears.uninstall()
    layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=True, skip_bias_add=False,
                        dtype="float32", hidden=32, ffn=64)
    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=seq, batch=2, dtype="float32")
    reference, _, _ = run_layer(layer, x)
    config = CocConfig(parallel_num=AUTO, enable_coc_in_column_backward=True, tune_cache=cache,
                       deterministic=deterministic, tune_candidates=candidates)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log.configure("debug")
    log.logger.addHandler(handler)
    assert linears.install(config)
    try:
        tuner = job.current().tuner(job.LINEARS)
        mine = (skew or {}).get(dist.get_rank())
        if mine:
            _skewing(tuner, *mine)
        results = [run_layer(layer, x)[0] for _ in range(calls)]
        decisions = [(d.chunks, d.source) for d in tuner.decisions.values()]
        calls_made = linears.engine().calls
    finally:
        linears.uninstall()
        log.logger.removeHandler(handler)
        log.configure("info")
    return {
        "errors": max(relative_error(r[name], reference[name]) for r in results for name in reference),
        "grads_only_from_real_calls": all(torch.equal(results[0][name], results[-1][name]) for name in reference),
        "decisions": decisions,
        "coc_calls": calls_made,
        "log": stream.getvalue(),
    }
