"""``coc-inject bench --cases row row-sp column-sp column-bwd``: Megatron's TP linears unpatched vs
through the injector, forward and backward timed apart.

Variants: unpatched Megatron, each fixed chunk count ``N=c``, and ``auto`` (``COC_PARALLEL_NUM=auto``
with a fresh tune cache): its decision -- the engine's own trials -- is made by one untimed call
before the repetitions, and every timed ``auto`` call reuses it (the engine's tuner is carried
across the per-variant re-installs), so the timed repetitions measure the decided path, never
trials or a cache look-up. Beside them, the forward matmul alone (C) and its collective alone (M),
for the pipelining ideal of N chunks: ``max(C, M) + min(C, M)/N``; the ideal *saving* against
Megatron is ``min(C, M) * (1 - 1/N)`` and the overlap efficiency is the share of it achieved.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from coc_inject import job, meter
from coc_inject.linears import install as linears
from coc_inject.linears.guards import tp_group
from coc_inject.bench import engine, report, startup
from coc_inject.testbed import ranks
from coc_inject.testbed.models import LINEARS as CASES, LinearCase, build_linear
from coc_inject.bench.cases import linears_figures as figures
from coc_inject.config import AUTO, CocConfig
from coc_inject.pipeline import agreement, collectives, schedules
from coc_inject.routes import LayerCase
from coc_inject.timer import Timer, median, seconds

AUTO_VARIANT = "auto"


def _install(variant: str, layer=None, auto=None) -> None:
    """Patch for ``variant``; with ``layer``, the one-time cross-rank config check runs now, so that
    no timed call pays for it. ``auto``: (config, tuner); the tuner is handed to the new engine."""
    linears.uninstall()
    if variant == "megatron":
        return
    if variant == AUTO_VARIANT:
        linears.install(auto[0])
        if auto[1] is not None:  # the decided tuner, handed to the new installation
            job.current().tuners[job.LINEARS] = auto[1]
    elif variant == "N=1":  # Megatron's own path behind the wrapper: the wrapper's cost ((1,1,1) never matches)
        linears.install(CocConfig(parallel_num=1, customized_coc={(1, 1, 1): 2}))
    else:
        linears.install(CocConfig(parallel_num=int(variant.split("=")[1]), enable_coc_in_column_backward=True))
    if layer is not None:
        agreement.ensure_same_config(tp_group(layer), job.current().config)


def _comm_only(case: LinearCase, layer, x, group):
    """The forward collective alone, on buffers of its size (None: the case has none)."""
    tp, rows = group.size(), x.shape[0] * x.shape[1]
    if case.collective == "all_reduce":
        buffer = torch.empty(rows, layer.output_size, dtype=x.dtype, device=x.device)
        return lambda: dist.all_reduce(buffer, group=group)
    if case.collective == "reduce_scatter":
        full = torch.empty(rows, layer.output_size, dtype=x.dtype, device=x.device)
        shard = torch.empty(rows // tp, layer.output_size, dtype=x.dtype, device=x.device)
        return lambda: dist.reduce_scatter_tensor(shard, full, group=group)
    if case.collective == "all_gather":
        local = x.reshape(rows, -1)
        full = torch.empty(rows * tp, local.shape[1], dtype=x.dtype, device=x.device)
        return lambda: dist.all_gather_into_tensor(full, local, group=group)
    return None


def decide_auto(layer, x, config) -> tuple:
    """One untimed forward+backward with ``auto`` installed: the engine's tuner decides this layer's
    key (trials, or the cache). Returns (tuner, JSON-able decision)."""
    _install(AUTO_VARIANT, layer, (config, None))
    try:
        out, _ = layer(x.clone().requires_grad_(True))
        out.backward(torch.ones_like(out))
        layer.zero_grad(set_to_none=True)
        tuner = job.current().tuners.get(job.LINEARS)
    finally:
        linears.uninstall()
    if tuner is None or len(tuner.decisions) != 1:
        raise RuntimeError(f"auto made {0 if tuner is None else len(tuner.decisions)} decisions for one layer "
                           "call, expected 1 (did the call fall back to Megatron before tuning?)")
    (key, decision), = tuner.decisions.items()
    return tuner, {"chunks": decision.chunks, "source": decision.source, "key": key.text(),
                   "times_ms": {str(c): t for c, t in sorted(decision.times_ms.items())}, "noise_ms": decision.noise_ms}


def measure_case(case: LinearCase, *, m, k, n, dtype, device, chunks, reps, warmup=1, tune_cache=None) -> dict:
    """``chunks``: chunk counts and/or ``"auto"``; ``tune_cache``: the auto variant's (fresh) cache."""
    layer, x = build_linear(case, m, k, n, dtype, device)
    timer = Timer(device)
    fixed = [c for c in chunks if c != AUTO_VARIANT]
    auto, decided = None, None
    if AUTO_VARIANT in chunks:
        engine.progress("coc-inject bench", f"{case.label}: auto trials")
        config = CocConfig(parallel_num=AUTO, enable_coc_in_column_backward=True, tune_cache=tune_cache)
        tuner, decided = decide_auto(layer, x, config)
        auto = (config, tuner)

    def layer_run(variant):
        def run():
            _install(variant, layer, auto)
            inp = x.clone().requires_grad_(True)
            (out, _), forward = timer(lambda: layer(inp))
            grad = torch.ones_like(out)
            backward = timer(lambda: out.backward(grad))[1]
            layer.zero_grad(set_to_none=True)
            if variant != AUTO_VARIANT:
                return {"forward": forward, "backward": backward}
            tuner = auto[1]  # the timed auto calls must run the decision made before, nothing new
            if len(tuner.decisions) != 1 or next(iter(tuner.decisions.values())).chunks != decided["chunks"]:
                raise RuntimeError("auto made a new decision during the timed repetitions: "
                                   f"{[d.describe(k) for k, d in tuner.decisions.items()]}")
            return {"forward": forward, "backward": backward}, linears.engine().calls  # 0: Megatron's path
        return run

    def alone(fn):
        def run():
            linears.uninstall()
            return {"forward": timer(fn)[1] if fn is not None else 0.0}
        return run

    rows_in = torch.randn(m, k, dtype=dtype, device=device)  # the forward matmul's [m, k] operand
    runs = {v: layer_run(v) for v in ["megatron", *(f"N={c}" for c in fixed), *([AUTO_VARIANT] if auto else [])]}
    runs["compute-only"] = alone(lambda: torch.matmul(rows_in, layer.weight.t()))
    runs["comm-only"] = alone(_comm_only(case, layer, x, tp_group(layer)))
    times, kept = engine.measure(runs, reps, device=device, warm_ups=warmup, label=f"{case.label}: ")
    linears.uninstall()
    shown = max(fixed) if fixed else max(decided["chunks"], 2)
    result = {"case": case.name, "label": case.label, "times": times, "timeline": timeline(layer, x, shown)}
    if decided is not None:
        result["auto"] = {**decided, "coc_calls": kept[AUTO_VARIANT]}  # per timed repetition
    return result


def timeline(layer, x, chunks: int) -> list:
    """Per-chunk compute and communication intervals of one CoC forward (host clock, ms)."""
    _install(f"N={chunks}", layer)
    try:
        with schedules.traced(schedules.TimelineTracer()) as tracer:
            dist.barrier()
            begin = meter.now()
            layer(x.clone())
            dist.barrier()
    finally:
        linears.uninstall()
    return [(kind, start_row, 1e3 * (t0 - begin), 1e3 * (t1 - begin))
            for kind, start_row, t0, t1 in tracer.finish() if kind != "launch"]


def host_overhead_per_chunk(device, dtype, rows_per_chunk: int = 8, calls: int = 300) -> dict:
    """Host time each extra chunk costs, on tiny shapes (Row mm+AR, 8 rows per chunk, 32x32):
    ``pipeline_us``, coc-inject's own work per chunk (the slope of the forward time over N = 2 -> 16
    with the collective launch stubbed out, minus one chunk's matmul); ``collective_launch_us``, the
    backend's cost to start one async collective, which every extra chunk also pays; their sum."""
    def forward_time(chunks):
        layer, x = build_linear(CASES[LayerCase.ROW], rows_per_chunk * chunks, 32, 32, dtype, device)
        _install(f"N={chunks}")
        try:
            layer(x)  # the one-time config agreement happens here, with the real collective
            with collectives.all_reduce_replaced(lambda tensor, group: None), torch.no_grad():
                return median(lambda: layer(x), calls)[1]  # host time: no device synchronisation
        finally:
            linears.uninstall()

    slope = (forward_time(16) - forward_time(2)) / 14
    chunk = torch.randn(rows_per_chunk, 32, dtype=dtype, device=device)
    weight_t = torch.randn(32, 32, dtype=dtype, device=device).t()
    out = torch.empty(rows_per_chunk, 32, dtype=dtype, device=device)
    matmul = median(lambda: torch.matmul(chunk, weight_t, out=out), calls)[1]
    launches = []
    for _ in range(calls // 10):
        dist.barrier()
        handles, elapsed = seconds(lambda: [collectives.all_reduce_async(chunk, None) for _ in range(8)])
        launches.append(elapsed / 8)
        collectives.wait_all(handles)
    pipeline_us, launch_us = 1e6 * (slope - matmul), 1e6 * statistics.median(launches)
    return {"pipeline_us": pipeline_us, "collective_launch_us": launch_us, "total_us": pipeline_us + launch_us,
            "rows_per_chunk": rows_per_chunk}


def run_rank(args, device) -> dict | None:
    """Everything one rank measures; rank 0 returns the results."""
    dtype, (m, k, n) = getattr(torch, args.dtype), args.shape
    with tempfile.TemporaryDirectory(prefix="coc-bench-tune-") as scratch:  # auto: a fresh cache per run
        results = [measure_case(CASES[name], m=m, k=k, n=n, dtype=dtype, device=device, chunks=list(args.chunks),
                                reps=args.reps, tune_cache=os.path.join(scratch, "tune.json"))
                   for name in args.cases if name in CASES]
    engine.progress("coc-inject bench", "host overhead per chunk (tiny shapes)")
    overhead = host_overhead_per_chunk(device, dtype)
    if dist.get_rank() != 0:
        return None
    sys.stderr.write("\n")
    return {"results": results, "host_overhead": overhead}


def bench(args) -> int:
    """Prints the table, writes bench.json and bench.png into --out."""
    started = time.time()
    setup = ranks.Setup(link=args.link, threads=args.threads)
    measured = ranks.run(setup, run_rank, args)
    if measured is None:
        return 0  # not rank 0 of a torchrun job
    summary = figures.summarize(measured["results"])
    m, k, n = args.shape
    title = (f"coc-inject bench: {ranks.describe_where(setup)}; [M,K]x[K,N] = [{m},{k}]x[{k},{n}] {args.dtype}, "
             f"{args.reps} interleaved repetitions")
    print(title)
    print(figures.format_table(summary))
    overhead = measured["host_overhead"]
    print(f"host overhead per chunk (tiny shapes): coc-inject pipeline {overhead['pipeline_us']:.1f} us + "
          f"backend collective launch {overhead['collective_launch_us']:.1f} us = {overhead['total_us']:.1f} us")
    start_up = None
    if args.startup_reps and not ranks.under_torchrun():
        start_up = startup.summarize(*startup.measure(sys.executable, args.startup_reps), sys.executable)
        delta = start_up["median_delta_vs_bare_ms"]
        print(f"bootstrap start-up cost (python -c pass, {args.startup_reps} reps): off {delta['off']:+.2f} ms, "
              f"on {delta['on']:+.2f} ms")
    payload = {"title": title, "argv": sys.argv, "targets": figures.TARGETS, "seconds": time.time() - started,
               "summary": summary, "host_overhead": overhead, "startup": start_up, "raw": measured["results"]}
    report.write(args.out, "bench", payload, figures.panels(summary, measured["results"]), title, size=(6.5, 4.8))
    return 0
