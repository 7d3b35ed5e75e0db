"""``coc-inject bench``: unpatched Megatron vs CoC through the real layers, in one run.

Where it runs:
* default: 2 local CPU ranks (gloo) over plain loopback;
* ``--link 1gbit``: the 2 ranks in two network namespaces joined by a rate-limited veth pair,
  each pinned to its own core (root; see coc_inject.bench.link);
* under ``torchrun`` (RANK/WORLD_SIZE set): every rank of the job on its device (CUDA/NPU,
  NCCL/HCCL), timed with device events.

Variants: unpatched Megatron, each ``--chunks`` count, and ``auto`` (``COC_PARALLEL_NUM=auto``
with a fresh temporary tune cache: its trials run once before the timed repetitions, which
then measure the N it chose; see coc_inject.bench.layers).

Writes a table to stdout, ``bench.json`` (raw per-repetition times and the figures) and
``bench.png`` (speedup vs N per case, timeline of one call) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from coc_inject.bench import attention, layers, moe, ranks, report, startup, whole_layer
from coc_inject.bench.link import EmulatedLink, LinkError
from coc_inject.bench.ranks import Setup

TARGETS = ("speedup >= 1.35 at the best N and >= 90% of the ideal saving (Row AR, emulated 1 gbit); "
           ">= 90% of the ideal saving (SP cases); host overhead <= 15 us per chunk")


CHUNKS_ALLOWED = "an integer >= 1 (a fixed chunk count; 1 = Megatron's path behind the wrapper) or auto"


def chunk_variant(text: str):
    """A ``--chunks`` word: an int >= 1 or "auto"."""
    word = text.strip().lower()
    if word == "auto":
        return word
    if word.isascii() and word.isdigit() and int(word) >= 1:
        return int(word)
    raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected {CHUNKS_ALLOWED}")  # argparse names --chunks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coc-inject bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", metavar="RATE", help="emulate a link of this rate between the 2 ranks, "
                        "e.g. 1gbit (root only)")
    parser.add_argument("--cases", nargs="+", default=list(layers.DEFAULT_CASES),
                        choices=[*layers.CASES, *attention.CASES, whole_layer.CASE, moe.CASE],
                        help="linear layer cases, and/or attention: context-parallel core attention, every "
                             "algorithm (coc_inject.bench.attention; writes attention.json / attention.png), "
                             "and/or layer: a whole TransformerBlock forward + backward, Megatron vs CoC vs "
                             "multi-copy vs both, with the exposed communication (coc_inject.bench.whole_layer), "
                             "and/or moe: one MoE layer, Megatron's alltoall dispatcher vs the pieces vs auto, with "
                             "the pipelining limit (coc_inject.bench.moe; writes moe.json / moe.png)")
    parser.add_argument("--chunks", nargs="+", type=chunk_variant, default=[1, 2, 4, 8, "auto"],
                        help="fixed chunk counts and/or auto (COC_PARALLEL_NUM=auto, fresh tune cache; "
                             "default: 1 2 4 8 auto)")
    parser.add_argument("--shape", nargs=3, type=int, default=[4096, 1024, 1024], metavar=("M", "K", "N"),
                        help="per-rank forward matmul [M, K] x [K, N] (M: all rows of the sequence)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--startup-reps", type=int, default=40,
                        help="repetitions of the bootstrap start-up measurement (0: skip)")
    attention_options = parser.add_argument_group("attention case (--cases attention)")
    attention_options.add_argument("--cp", nargs="+", type=int, help="context-parallel sizes, one local rank each "
                                   "(default: 2 4 on loopback, 2 with --link)")
    attention_options.add_argument("--seq", type=int, default=2048,
                                   help="whole sequence length (default 2048: compute and transfers of the same order "
                                        "over the emulated 1 gbit link, one thread per rank)")
    attention_options.add_argument("--batch", type=int, default=1)
    attention_options.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    attention_options.add_argument("--kv-groups", type=int, default=8, help="key/value groups (default 8: no GQA)")
    attention_options.add_argument("--head-dim", type=int, default=64)
    attention_options.add_argument("--kernel", default="fused", choices=["fused", "reference", "both"],
                                   help="the block kernel (default fused: the device's flash kernel); both: every "
                                        "algorithm also on the reference kernel, as extra rows")
    moe_options = parser.add_argument_group("MoE case (--cases moe)")
    moe_options.add_argument("--ep", type=int, default=2, help="expert-parallel size, one local rank each (default 2)")
    moe_options.add_argument("--local-experts", nargs="+", type=int, default=[1, 2, 4],
                             help="local experts per rank, one case each (default 1 2 4)")
    moe_options.add_argument("--moe-tokens", type=int, default=4096, help="tokens per rank into the layer")
    moe_options.add_argument("--moe-hidden", type=int, default=1024)
    moe_options.add_argument("--moe-ffn", type=int, default=768,
                             help="expert FFN size (default 768: the experts' compute and their all-to-alls of the "
                                  "same order over the emulated 1 gbit link, one thread per rank)")
    moe_options.add_argument("--moe-topk", type=int, default=2)
    return parser


@dataclass(frozen=True)
class LinearRun:
    """What every rank measures of the linear cases (``--cases`` without attention)."""

    cases: tuple
    shape: tuple  # the per-rank forward matmul's M, K, N
    dtype: str
    chunks: tuple  # chunk counts and/or "auto"
    reps: int


def run_rank(run: LinearRun, device) -> dict | None:
    """Everything one rank measures; rank 0 returns the results."""
    dtype = getattr(torch, run.dtype)
    m, k, n = run.shape
    with tempfile.TemporaryDirectory(prefix="coc-bench-tune-") as scratch:  # auto: a fresh cache per run
        results = [layers.measure_case(layers.CASES[name], m=m, k=k, n=n, dtype=dtype, device=device,
                                       chunks=list(run.chunks), reps=run.reps,
                                       tune_cache=os.path.join(scratch, "tune.json")) for name in run.cases]
    layers.progress("host overhead per chunk (tiny shapes)")
    overhead = layers.host_overhead_per_chunk(device, dtype)
    if dist.get_rank() != 0:
        return None
    sys.stderr.write("\n")
    return {"results": results, "host_overhead": overhead}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.link and not ranks.under_torchrun():
        try:
            EmulatedLink.check_available()
        except LinkError as error:
            print(f"coc-inject bench: {error}", file=sys.stderr)
            return 2
    linear_cases = [case for case in args.cases if case in layers.CASES]
    if any(case in attention.CASES for case in args.cases):
        code = attention.bench(args)
        if code or not linear_cases and whole_layer.CASE not in args.cases:
            return code
    if whole_layer.CASE in args.cases:
        code = whole_layer.bench(args)
        if code or not linear_cases and moe.CASE not in args.cases:
            return code
    if moe.CASE in args.cases:
        code = moe.bench(args)
        if code or not linear_cases:
            return code
    started = time.time()
    setup = Setup(link=args.link, threads=args.threads)
    measured = ranks.run(setup, run_rank, LinearRun(tuple(linear_cases), tuple(args.shape), args.dtype,
                                                    tuple(args.chunks), args.reps))
    if measured is None:
        return 0  # not rank 0 of a torchrun job
    summary = report.summarize(measured["results"])
    m, k, n = args.shape
    title = (f"coc-inject bench: {ranks.describe_where(setup)}; [M,K]x[K,N] = [{m},{k}]x[{k},{n}] {args.dtype}, "
             f"{args.reps} interleaved repetitions")
    print(title)
    print(report.format_table(summary))
    overhead = measured["host_overhead"]
    print(f"host overhead per chunk (tiny shapes): coc-inject pipeline {overhead['pipeline_us']:.1f} us + "
          f"backend collective launch {overhead['collective_launch_us']:.1f} us = {overhead['total_us']:.1f} us")
    start_up = None
    if args.startup_reps and not ranks.under_torchrun():
        wall, cpu = startup.measure(sys.executable, args.startup_reps)
        start_up = startup.summarize(wall, cpu, sys.executable)
        print(f"bootstrap start-up cost (python -c pass, {args.startup_reps} reps): "
              f"off {start_up['median_delta_vs_bare_ms']['off']:+.2f} ms, on {start_up['median_delta_vs_bare_ms']['on']:+.2f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"title": title, "argv": sys.argv, "targets": TARGETS, "seconds": time.time() - started,
               "summary": summary, "host_overhead": overhead, "startup": start_up,
               "raw": measured["results"]}
    report.write_json(args.out / "bench.json", payload)
    problem = report.write_png(args.out / "bench.png", summary, measured["results"], title)
    print(f"wrote {args.out / 'bench.json'}" + (f"; {problem}" if problem else f" and {args.out / 'bench.png'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
