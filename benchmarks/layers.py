"""Time real megatron-core layers unpatched vs coc-inject, forward and backward separately.

    python benchmarks/layers.py [--reps 15] [--rows 4096] [--hidden 1024] [--ffn 1024]
                                [--chunks 2 4] [--json out.json]

Two gloo ranks (torch.multiprocessing, 1 thread each, plain loopback). For every case
(Row no-SP, Row SP, Column SP, Column no-SP with COC_ENABLE_IN_COLUMN_BACKWARD) the variants
-- unpatched Megatron and CoC with each chunk count -- are interleaved inside every
repetition, because matmul time on these VMs jumps 1.3-2x at random. Reported: the median
time per variant and direction, and the median of per-repetition ratios unpatched / CoC
(> 1 means CoC is faster). Rank 0's timings are reported; ranks synchronise with a barrier
before each timed call.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = {
    "row": dict(kind="row", sequence_parallel=False),
    "row-sp": dict(kind="row", sequence_parallel=True),
    "column-sp": dict(kind="column", sequence_parallel=True),
    "column-bwd": dict(kind="column", sequence_parallel=False),
}


def _build(kind, sequence_parallel, hidden, ffn):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    config = ModelParallelConfig(tensor_model_parallel_size=dist.get_world_size(),
                                 sequence_parallel=sequence_parallel, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=False)
    init = torch.nn.init.xavier_normal_
    if kind == "row":
        return RowParallelLinear(ffn, hidden, config=config, init_method=init, bias=False,
                                 input_is_parallel=True, skip_bias_add=True)
    return ColumnParallelLinear(hidden, ffn, config=config, init_method=init, bias=False)


def _timed(fn):
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron's SP buffers, on CPU
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    from coc_inject import patching
    from coc_inject.config import CocConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    results = {}
    for case_name in args.cases:
        case = CASES[case_name]
        layer = _build(case["kind"], case["sequence_parallel"], args.hidden, args.ffn)
        rows = args.rows // world if case["kind"] == "column" and case["sequence_parallel"] else args.rows
        width = layer.input_size if case["kind"] == "column" else layer.input_size_per_partition
        x = torch.randn(rows, 1, width)
        variants = ["megatron"] + [f"coc-{n}" for n in args.chunks]
        times = {v: {"forward": [], "backward": []} for v in variants}
        for rep in range(args.reps + 1):  # repetition 0 warms up (and runs the config check)
            for variant in variants:
                patching.uninstall()
                if variant != "megatron":
                    patching.install(CocConfig(parallel_num=int(variant.split("-")[1]),
                                               enable_coc_in_column_backward=True))
                inp = x.clone().requires_grad_(True)
                (out, _), forward = _timed(lambda: layer(inp))
                grad = torch.ones_like(out)
                _, backward = _timed(lambda: out.backward(grad))
                layer.zero_grad(set_to_none=True)
                if rep:
                    times[variant]["forward"].append(forward)
                    times[variant]["backward"].append(backward)
        patching.uninstall()
        results[case_name] = times
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def summarize(results, chunks):
    summary = {}
    for case, times in results.items():
        reference = times["megatron"]
        summary[case] = {}
        for variant, directions in times.items():
            row = {}
            for direction, samples in directions.items():
                row[f"{direction}_median_ms"] = 1e3 * statistics.median(samples)
                if variant != "megatron":
                    ratios = [r / t for r, t in zip(reference[direction], samples)]
                    row[f"{direction}_speedup"] = statistics.median(ratios)
            summary[case][variant] = row
    return summary


def print_table(summary):
    print(f"{'case':<11} {'variant':<9} {'fwd ms':>8} {'fwd x':>6} {'bwd ms':>8} {'bwd x':>6}")
    for case, variants in summary.items():
        for variant, row in variants.items():
            fx = f"{row['forward_speedup']:.2f}" if "forward_speedup" in row else "-"
            bx = f"{row['backward_speedup']:.2f}" if "backward_speedup" in row else "-"
            print(f"{case:<11} {variant:<9} {row['forward_median_ms']:8.1f} {fx:>6} "
                  f"{row['backward_median_ms']:8.1f} {bx:>6}")
    print("x = median over repetitions of (Megatron time / CoC time); > 1: CoC faster")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rows", type=int, default=4096, help="m = seq*batch (full sequence)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=1024, help="ffn size (split over 2 ranks)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    for key in [k for k in os.environ if k.startswith(("COC_", "USE_COC_"))]:
        del os.environ[key]
    procs = [context.Process(target=_worker, args=(rank, 2, port, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = queue.get()
    for proc in procs:
        proc.join()
    summary = summarize(results, args.chunks)
    print(f"2 ranks, gloo over loopback, 1 thread/rank, m={args.rows} k/n={args.hidden}/{args.ffn} fp32, "
          f"{args.reps} interleaved repetitions")
    print_table(summary)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in vars(args).items()},
                                         "summary": summary, "raw_seconds": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
