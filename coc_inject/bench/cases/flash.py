"""``make bench-flash``: the attention kernels against what a user would run instead (issue #19's
targets), every figure a median of interleaved repetitions (the bench engine), one thread per process.

1. One block, forward + backward, ``[1, 8, 1024, 64]`` causal fp32: the fused CPU flash kernel vs the
   reference kernel (tiled fp32 torch ops) and vs the reference in one tile (the kernel every schedule
   ran before the fused kernels: the whole [1024 x 1024] scores at once), in one process.
2. Ring at CP=2 (two local ranks, loopback, the fused kernel) vs torch's ``scaled_dot_product_attention``
   on the whole sequence in one process (rank 0, the other rank waiting); 8 heads, d 64, causal; seq
   4096 and 8192, fp32 and bf16.
3. Peak resident memory of one attention forward + backward per rank (VmHWM after a reset through
   ``/proc/self/clear_refs``, minus the resident size at the reset; glibc told to unmap freed tensors,
   so the resident size follows the live ones), after a warm-up call, in a fresh pair of processes per
   sequence: its growth from seq 4096 to 8192 (linear = 2x); the same for SDPA.

    python -m coc_inject.bench.cases.flash [--out DIR]      (writes flash.json, prints the table with the targets)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from coc_inject.attention_kernels import cpu, reference
from coc_inject.bench import engine
from coc_inject.testbed import attention, memory, ranks
from coc_inject.testbed.attention import Variant
from coc_inject.bench.report import median_ms, median_ratio
from coc_inject.context_parallel.function import ContextParallelAttention
from coc_inject.timer import Timer, seconds

BLOCK = (1, 8, 1024, 64)
SEQS = (4096, 8192)
DTYPES = ("float32", "bfloat16")
UNTILED = "reference untiled"
MEMORY_REPS = 3  # the median of three: a single call's measurement can come out low under load
TARGETS = {"block_speedup": 4.0, "float32": 0.58, "bfloat16": 0.60, "memory_growth": 2.1}
TAG = "make bench-flash"


def block_kernels(reps: int) -> dict:
    """The fused kernel first: the ratios are reference / fused per repetition (> 1: fused faster)."""
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(BLOCK, generator=generator) for _ in range(4))
    tile, scale = reference.TILE, BLOCK[-1] ** -0.5

    def run(kernel, size):
        def fwd_bwd():
            out, lse = kernel.forward(q, k, v, scale, True)
            kernel.backward(dout, q, k, v, out, lse, scale, True)

        def once():
            reference.TILE = size
            return {"fwd_bwd": seconds(fwd_bwd)[1]}
        return once

    runs = {"cpu-flash": run(cpu.KERNEL, tile), "reference": run(reference.KERNEL, tile),
            UNTILED: run(reference.KERNEL, 1 << 30)}  # one tile: the reference kernel as it was before #19
    try:
        times, _ = engine.measure(runs, reps, device=q.device, tag=TAG, label="block: ")
    finally:
        reference.TILE = tile
    times = {name: passes["fwd_bwd"] for name, passes in times.items()}
    return {"shape": list(BLOCK), "ms": {n: median_ms(t) for n, t in times.items()},
            "speedup": median_ratio(times["reference"], times["cpu-flash"]),
            "speedup_vs_untiled": median_ratio(times[UNTILED], times["cpu-flash"])}


def ring_rank(args, device) -> dict | None:
    """One rank: ring CP=2 on the fused kernel vs SDPA on rank 0, interleaved; or their peak memory."""
    rank = dist.get_rank()
    if getattr(args, "reference_tile", None):  # the reference kernel in tiles of this size (1 << 30: untiled)
        reference.TILE = args.reference_tile
    schedule = attention.schedules(2, [Variant("ring", "ring")], args.head_dim)["ring"]
    kernel = attention.kernels(args)[None]
    inputs = attention.local_inputs(args, 2, rank)
    whole = attention.whole_inputs(args) if rank == 0 else None

    def ring():
        leaves = [t.clone().requires_grad_(True) for t in inputs[:3]]
        ContextParallelAttention.apply(*leaves, schedule, kernel).backward(inputs[3])

    if args.measure == "memory":
        memory.unmap_freed_memory()
        ring()  # warm-up: one-time allocations are not the attention's
        ring_peak = statistics.median(memory.resident_peak(ring, dist.barrier) for _ in range(MEMORY_REPS))
        sdpa_peak = None
        if rank == 0 and getattr(args, "sdpa", True):
            attention.sdpa(whole)
            sdpa_peak = memory.resident_peak(lambda: attention.sdpa(whole), barrier=lambda: None)
        everyone = [None] * 2
        dist.all_gather_object(everyone, ring_peak)
        return {"ring_peak_bytes": everyone, "sdpa_peak_bytes": sdpa_peak} if rank == 0 else None

    timer = Timer(device)
    runs = {"ring": lambda: {"fwd_bwd": timer(ring)[1]},  # sdpa: rank 0's, the other rank reports 0
            "sdpa": lambda: {"fwd_bwd": sum(attention.sdpa_call(whole))}}
    times, _ = engine.measure(runs, args.reps, device=device, tag=TAG, label=f"seq {args.seq} {args.dtype}: ")
    if rank != 0:
        return None
    ring_times, sdpa_times = times["ring"]["fwd_bwd"], times["sdpa"]["fwd_bwd"]
    return {"ring_ms": median_ms(ring_times), "sdpa_ms": median_ms(sdpa_times),
            "ratio": median_ratio(ring_times, sdpa_times), "kernel": kernel.name}


def _run(args, **overrides) -> dict:
    """ring_rank on two local ranks, with ``args`` and ``overrides`` (a new namespace: ``args`` stays as it is)."""
    work = argparse.Namespace(**{**vars(args), **overrides})
    return ranks.run_local(ranks.Setup(threads=work.threads, megatron=False, command=TAG,
                                       fresh=work.measure == "memory"), ring_rank, work)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coc_inject.bench.cases.flash",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--block-reps", type=int, default=15)
    parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/flash"))
    args = parser.parse_args(argv)
    common = dict(threads=1, batch=1, heads=8, kv_groups=8, head_dim=64, kernel="fused")
    results = {"block": block_kernels(args.block_reps), "ring_vs_sdpa": [], "memory": []}
    block = results["block"]
    sys.stderr.write("\n")
    print(f"block fwd+bwd {list(BLOCK)} causal fp32, 1 thread: cpu-flash {block['ms']['cpu-flash']:.1f} ms, "
          f"reference {block['ms']['reference']:.1f} ms ({block['speedup']:.2f}x), reference untiled "
          f"{block['ms'][UNTILED]:.1f} ms ({block['speedup_vs_untiled']:.2f}x) (target >= "
          f"{TARGETS['block_speedup']}x)", flush=True)
    for dtype in args.dtypes:
        for seq in args.seqs:
            row = {"seq": seq, "dtype": dtype, **_run(argparse.Namespace(reps=args.reps, measure="time"), seq=seq,
                                                       dtype=dtype, **common)}
            results["ring_vs_sdpa"].append(row)
            print(f"ring CP=2 vs sdpa 1 process, seq {seq} {dtype}: ring {row['ring_ms']:.0f} ms, sdpa "
                  f"{row['sdpa_ms']:.0f} ms: {row['ratio']:.3f}x (target <= {TARGETS[dtype]}x)", flush=True)
    for seq in args.seqs:
        row = {"seq": seq, **_run(argparse.Namespace(reps=0, measure="memory"), seq=seq, dtype="float32", **common)}
        results["memory"].append(row)
        print(f"peak memory of one fwd+bwd, seq {seq} fp32: ring per rank "
              f"{[round(b / 2**20, 1) for b in row['ring_peak_bytes']]} MiB, sdpa {row['sdpa_peak_bytes'] / 2**20:.1f} "
              "MiB", flush=True)
    if len(results["memory"]) == 2:
        small, large = results["memory"]
        growth = max(b / a for a, b in zip(small["ring_peak_bytes"], large["ring_peak_bytes"]))
        results["memory_growth"] = growth
        print(f"peak memory growth seq {small['seq']} -> {large['seq']}: ring {growth:.2f}x per rank (target <= "
              f"{TARGETS['memory_growth']}x), sdpa {large['sdpa_peak_bytes'] / small['sdpa_peak_bytes']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "flash.json").write_text(json.dumps({"argv": sys.argv, "targets": TARGETS, **results}, indent=1))
    print(f"wrote {args.out / 'flash.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
