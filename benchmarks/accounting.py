"""Host time the coverage accounting adds to a layer call (issue 9 target: <= 1 us), and what
COC_MEASURE's meter adds to a collective (issue 36: its cost stated and measured).

Each measurement is the median over interleaved repetitions:
  count()   the accounting call alone (Coverage.count on a known layer) against a no-op with
            the same signature, in a tight loop;
  forward   a real megatron-core ColumnParallelLinear (TP 1, one gloo rank: the call takes
            Megatron's own path, which is counted too) through the patched forward, with the
            engine's coverage on and off;
  meter     a real gloo all_reduce of 16 floats (one rank) through the meter's wrapper
            (coc_inject.measure.metered) against torch.distributed's own, synchronous
            (``sync``), asynchronous and waited (``async``: the future's done callback and the
            timed wait too), and in a step COC_MEASURE does not measure (``idle``: the wrapper
            only calls through; round a no-op, as a gloo call's noise is larger than it). Each repetition's records are summed (a step's end) outside
            the timed loop.

    python benchmarks/accounting.py [--reps N] [--calls N] [--json PATH]
    (also: make bench-accounting)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's coc_inject
from coc_inject.testbed.ranks import free_port  # noqa: E402

TARGET_US = 1.0


def _per_call_us(function, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        function()
    return (time.perf_counter_ns() - start) / calls / 1e3


def measure_count(reps: int, calls: int) -> dict:
    import torch

    from coc_inject import coverage
    from coc_inject.config import CocConfig
    from coc_inject.routes import Chunked

    cov = coverage.Coverage(CocConfig(parallel_num=4), {})
    layer = torch.nn.Linear(8, 8)
    x = torch.zeros(4, 8)
    key = Chunked(4)

    def shape_of(layer, input_):
        return (4, 8, 8)

    def noop(layer, key, input_, shape_of):
        return None

    cov.count(layer, key, x, shape_of)  # the layer is known from its first call on
    with_accounting, without = [], []
    for _ in range(reps):
        with_accounting.append(_per_call_us(lambda: cov.count(layer, key, x, shape_of), calls))
        without.append(_per_call_us(lambda: noop(layer, key, x, shape_of), calls))
    return _summary(with_accounting, without)


def measure_forward(reps: int, calls: int) -> dict:
    import torch
    import torch.distributed as dist

    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        config = ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True,
                                     gradient_accumulation_fusion=False)
        layer = ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_, bias=False)
        x = torch.zeros(4, 1, 8)
        assert linears.install(CocConfig(parallel_num=4))
        engine = linears.engine()
        coverage_on = engine.coverage
        with torch.no_grad():
            layer(x)
            with_accounting, without = [], []
            for _ in range(reps):
                engine.coverage = coverage_on
                with_accounting.append(_per_call_us(lambda: layer(x), calls))
                engine.coverage = None
                without.append(_per_call_us(lambda: layer(x), calls))
        engine.coverage = coverage_on
        counted = sum(coverage_on.calls_by_route().values())
        assert counted == 1 + reps * calls, counted  # the accounting really ran on every call
        return _summary(with_accounting, without)
    finally:
        linears.uninstall()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def measure_meter(reps: int, calls: int) -> dict:
    import torch
    import torch.distributed as dist

    from coc_inject.config import CocConfig
    from coc_inject.measure import metered
    from coc_inject.measure.exposure import Exposure

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        x = torch.zeros(16)
        plain = dist.all_reduce
        measured = Exposure(CocConfig(measure=(1, None)))  # not armed: no module or optimizer hooks
        idle = Exposure(CocConfig(measure=(2, 2)))  # step 1 is not measured
        assert measured.recording and not idle.recording
        def noop(tensor, group=None, async_op=False):
            return None

        wrapped, passing = metered.wrapper(measured, "all_reduce", plain), metered.wrapper(idle, "all_reduce", noop)
        variants = {"sync": (lambda: wrapped(x), lambda: plain(x)),
                    "async": (lambda: wrapped(x, async_op=True).wait(), lambda: plain(x, async_op=True).wait()),
                    "idle": (lambda: passing(x), lambda: noop(x))}
        times = {name: ([], []) for name in variants}
        for function in (f for pair in variants.values() for f in pair):  # warm-up
            function()
        recorded = len(measured._records)  # the warm-up's two
        measured.end_step()
        for rep in range(reps):
            order = list(variants.items())
            order = order[rep % len(order):] + order[:rep % len(order)]  # rotating
            for name, (with_meter, without) in order:
                times[name][0].append(_per_call_us(with_meter, calls))
                times[name][1].append(_per_call_us(without, calls))
            recorded += len(measured._records)
            measured.end_step()
        assert recorded == 2 + 2 * reps * calls, recorded  # the meter really recorded every measured call
        assert measured.total["total"]["collectives"] == recorded
        return {name: _summary(*pair) for name, pair in times.items()}
    finally:
        dist.destroy_process_group()


def _summary(with_accounting: list, without: list) -> dict:
    added = [a - b for a, b in zip(with_accounting, without)]
    return {"with_us": round(statistics.median(with_accounting), 4),
            "without_us": round(statistics.median(without), 4),
            "added_us": round(statistics.median(added), 4), "reps": len(added)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--calls", type=int, default=20000, help="calls per repetition (forward: a tenth)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    results = {"count": measure_count(args.reps, args.calls),
               "forward": measure_forward(args.reps, max(1, args.calls // 10))}
    meter = measure_meter(args.reps, max(1, args.calls // 20))
    print(f"coverage accounting, host time per layer call, median of {args.reps} interleaved repetitions")
    print(f"{'measurement':<12}{'with us':>10}{'without us':>12}{'added us':>10}")
    for name, r in results.items():
        print(f"{name:<12}{r['with_us']:>10.3f}{r['without_us']:>12.3f}{r['added_us']:>10.3f}")
    worst = max(r["added_us"] for r in results.values())
    verdict = "PASS" if worst <= TARGET_US else "FAIL"
    print(f"{verdict}: accounting adds {worst:.3f} us per call at most (target <= {TARGET_US:.0f} us)")
    print(f"COC_MEASURE's meter, host time per gloo all_reduce (16 floats, 1 rank), median of {args.reps} "
          "interleaved repetitions")
    print(f"{'collective':<12}{'with us':>10}{'without us':>12}{'added us':>10}")
    for name, r in meter.items():
        print(f"{name:<12}{r['with_us']:>10.3f}{r['without_us']:>12.3f}{r['added_us']:>10.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(dict(results, meter=meter, target_us=TARGET_US), handle, indent=1)
    return 0 if worst <= TARGET_US else 1


if __name__ == "__main__":
    sys.exit(main())
