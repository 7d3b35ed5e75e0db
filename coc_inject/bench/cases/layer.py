"""``coc-inject bench --cases layer``: a whole TransformerBlock forward + backward, TP over the local
ranks with sequence parallelism: Megatron as it is, CoC's chunked linears, multi-copy parallel, both,
and the compute-only twin -- C, M, the limit max(C, M) and the exposed communication each variant
hides (coc_inject.bench.report). Writes layer.json / layer.png into --out.

    python -m coc_inject.bench.cases.layer [--link 1gbit] [--reps 15] [--chunks auto] [--copies 2] [--micro-batch 16]
                                           [--recompute] [--moe [--ep 2]]

``--micro-batch 1``: sequence copies; the title and layer.json's ``copies`` say which split ran ("2 copies,
sequence split", or "no copies: why"). ``--recompute``: every layer fully recomputed (uniform, one a chunk).
``--moe``: MoE MLPs (testbed.models.moe_settings) at EP ``--ep`` (default the world), expert TP 1; the CoC
variants also run the all-to-alls in pieces (COC_MOE_OVERLAP=auto).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from coc_inject.bench import engine, report
from coc_inject.testbed import ranks
from coc_inject.timer import Timer

VARIANTS = ("megatron", "coc", "copies", "coc+copies", report.COMPUTE_ONLY)


def rank_work(args, device) -> dict | None:
    import torch

    from coc_inject.testbed.models import block_step, block_variant, build_block, variant_config

    block, hidden, mask = build_block(args, micro_batch=args.micro_batch)
    ran, step = {}, block_step(block, hidden, mask)  # ran: how the copies variants' block ran (split, or why not)

    def variant(name, tune_cache):
        config = variant_config(args, "coc" in name, "copies" in name, tune_cache)
        return lambda: block_variant(block, config, name == report.COMPUTE_ONLY, ran)

    timer = Timer(device)
    with tempfile.TemporaryDirectory() as scratch:  # CoC auto's trials in the warm-up, kept by this cache
        runs = {name: engine.fwd_bwd(timer, step, variant(name, f"{scratch}/tune.json")) for name in VARIANTS}
        times, _ = engine.measure(runs, args.reps, device=device, tag="coc-inject bench layer")
    if torch.distributed.get_rank() != 0:
        return None
    sys.stderr.write("\n")
    return {**report.overlap({name: report.totals(times[name]) for name in VARIANTS}), "raw": times, **ran}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", metavar="RATE")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--chunks", default="auto", help="COC_PARALLEL_NUM of the CoC variants")
    parser.add_argument("--copies", type=int, default=2, help="COC_MULTI_COPY of the multi-copy variants")
    for option, default in (("--seq", 256), ("--micro-batch", 16), ("--hidden", 512), ("--ffn", 512),
                            ("--heads", 8), ("--layers", 1), ("--threads", 1)):
        parser.add_argument(option, type=int, default=default)
    parser.add_argument("--recompute", action="store_true", help="full recompute of every layer (uniform, 1 a chunk)")
    parser.add_argument("--moe", action="store_true", help="MoE MLPs (alltoall, EP --ep, default the world)")
    parser.add_argument("--ep", type=int, choices=(1, 2), help="the MoE block's expert-parallel size")
    parser.add_argument("--out", type=Path, help="write layer.json / layer.png here")
    return parser


def measure(args) -> int:
    """Runs the ranks, prints the table, writes ``args.out/layer.json`` and ``.png`` (with --out)."""
    from coc_inject.config import AUTO

    args.chunks = AUTO if str(args.chunks) == "auto" else int(args.chunks)
    ep = (args.ep or 2) if args.moe else 1
    setup = ranks.Setup(world=2, link=args.link, threads=args.threads, ep=ep, etp=1 if args.moe else None,
                        command="coc-inject bench --cases layer")
    result = ranks.run(setup, rank_work, args)
    if result is None:
        return 0  # not rank 0 of a torchrun job
    kind = f"MoE ({ep * 2} experts top-2 aux_loss, EP={ep}) " if args.moe else ""
    title = (f"one {kind}TransformerBlock ({args.layers} layer, seq {args.seq}, micro-batch {args.micro_batch}, "
             f"hidden {args.hidden}, ffn {args.ffn}) forward + backward{', full recompute' * args.recompute}, TP=2 SP, "
             f"{ranks.describe_where(setup)}; "
             f"{args.reps} interleaved repetitions; copies: {result['copies']}")
    print(title)
    print(report.format_overlap(result, "TransformerBlock"))
    if args.out is not None:
        report.write(args.out, "layer", {"title": title, "argv": sys.argv, **result},
                     [report.overlap_panel(result, "TransformerBlock, TP=2 SP")], title, size=(6, 4.2))
    return 0


def add_options(parser) -> None:
    group = parser.add_argument_group("layer case (--cases layer)")
    group.add_argument("--micro-batch", type=int, default=16, help="default 16: batch copies; 1: sequence copies")
    group.add_argument("--moe", action="store_true", help="MoE MLPs at EP --ep (1 or 2), the CoC variants with "
                       "COC_MOE_OVERLAP=auto")


def bench(bench_args) -> int:
    """This bench at its own sizes, with bench's --link, --reps, --threads, --out and its CoC count
    (auto if listed in --chunks, else the largest)."""
    chunks = "auto" if "auto" in bench_args.chunks else max(bench_args.chunks)
    args = build_parser().parse_args(["--reps", str(bench_args.reps), "--threads", str(bench_args.threads),
                                      "--chunks", str(chunks), "--out", str(bench_args.out),
                                      "--micro-batch", str(bench_args.micro_batch)]
                                     + (["--link", bench_args.link] if bench_args.link else [])
                                     + (["--moe", "--ep", str(bench_args.ep)] if bench_args.moe else []))
    return measure(args)


if __name__ == "__main__":
    raise SystemExit(measure(build_parser().parse_args()))
