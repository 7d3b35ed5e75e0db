"""``coc-inject bench --cases layer``: a whole TransformerBlock forward + backward, TP over the local
ranks with sequence parallelism: Megatron as it is, CoC's chunked linears, multi-copy parallel, both,
and the compute-only twin -- C, M, the limit max(C, M) and the exposed communication each variant
hides (coc_inject.bench.report). Writes layer.json / layer.png into --out.

    python -m coc_inject.bench.cases.layer [--link 1gbit] [--reps 15] [--chunks auto] [--copies 2] [--recompute]

``--recompute``: every layer fully recomputed (Megatron's full recompute, uniform, one layer a chunk).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path

from coc_inject.bench import engine, report
from coc_inject.testbed import link, ranks
from coc_inject.timer import Timer

VARIANTS = ("megatron", "coc", "copies", "coc+copies", report.COMPUTE_ONLY)


def rank_work(args, device) -> dict | None:
    import torch
    from megatron.core.transformer import transformer_block

    from coc_inject import job
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig
    from coc_inject.multi_copy import install as copies
    from coc_inject.testbed.models import build_block

    block, hidden, mask = build_block(args)

    def step():
        out = block(hidden.clone().requires_grad_(True), mask)
        out.backward(torch.ones_like(out))

    def variant(name, tune_cache):
        @contextmanager
        def installed():
            config = CocConfig(parallel_num=args.chunks if "coc" in name else 1,
                               multi_copy=args.copies if "copies" in name else 1, tune_cache=tune_cache)
            if config.enabled:
                linears.install(config)
            if config.multi_copy_armed:
                copies.install(config, transformer_block)
            try:
                with link.no_collectives() if name == report.COMPUTE_ONLY else nullcontext():
                    yield
            finally:
                job.uninstall()
        return installed

    timer = Timer(device)
    with tempfile.TemporaryDirectory() as scratch:  # CoC auto's trials in the warm-up, kept by this cache
        runs = {name: engine.fwd_bwd(timer, step, variant(name, f"{scratch}/tune.json")) for name in VARIANTS}
        times, _ = engine.measure(runs, args.reps, device=device, tag="coc-inject bench layer")
    if torch.distributed.get_rank() != 0:
        return None
    sys.stderr.write("\n")
    return {**report.overlap({name: report.totals(times[name]) for name in VARIANTS}), "raw": times}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", metavar="RATE")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--chunks", default="auto", help="COC_PARALLEL_NUM of the CoC variants")
    parser.add_argument("--copies", type=int, default=2, help="COC_MULTI_COPY of the multi-copy variants")
    for option, default in (("--seq", 256), ("--batch", 16), ("--hidden", 512), ("--ffn", 512), ("--heads", 8),
                            ("--layers", 1), ("--threads", 1)):
        parser.add_argument(option, type=int, default=default)
    parser.add_argument("--recompute", action="store_true", help="full recompute of every layer (uniform, 1 a chunk)")
    parser.add_argument("--out", type=Path, help="write layer.json / layer.png here")
    return parser


def measure(args) -> int:
    """Runs the ranks, prints the table, writes ``args.out/layer.json`` and ``.png`` (with --out)."""
    from coc_inject.config import AUTO

    args.chunks = AUTO if str(args.chunks) == "auto" else int(args.chunks)
    setup = ranks.Setup(world=2, link=args.link, threads=args.threads, command="coc-inject bench --cases layer")
    result = ranks.run(setup, rank_work, args)
    if result is None:
        return 0  # not rank 0 of a torchrun job
    recompute = ", full recompute" if args.recompute else ""
    title = (f"one TransformerBlock ({args.layers} layer, seq {args.seq}, batch {args.batch}, hidden {args.hidden}, "
             f"ffn {args.ffn}) forward + backward{recompute}, TP=2 SP, {ranks.describe_where(setup)}; {args.reps} "
             "interleaved repetitions")
    print(title)
    print(report.format_overlap(result, "TransformerBlock"))
    if args.out is not None:
        report.write(args.out, "layer", {"title": title, "argv": sys.argv, **result},
                     [report.overlap_panel(result, "TransformerBlock, TP=2 SP")], title, size=(6, 4.2))
    return 0


def bench(bench_args) -> int:
    """This bench at its own sizes, with bench's --link, --reps, --threads, --out and its CoC count
    (auto if listed in --chunks, else the largest)."""
    chunks = "auto" if "auto" in bench_args.chunks else max(bench_args.chunks)
    args = build_parser().parse_args(["--reps", str(bench_args.reps), "--threads", str(bench_args.threads),
                                      "--chunks", str(chunks), "--out", str(bench_args.out)]
                                     + (["--link", bench_args.link] if bench_args.link else []))
    return measure(args)


if __name__ == "__main__":
    raise SystemExit(measure(build_parser().parse_args()))
