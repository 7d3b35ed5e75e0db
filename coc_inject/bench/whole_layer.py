"""A whole Transformer layer forward + backward, TP over the local ranks with sequence parallelism:
Megatron as it is, CoC's chunked linears, multi-copy parallel, and both -- and how much of the
communication each leaves exposed.

Exposed communication = a variant's time minus the compute-only time (the same layer with every
collective replaced by a no-op that zero-fills its output: what the layer would take on an
infinitely fast network). Megatron's own time minus the compute-only time is the communication
a perfect overlap would hide; each variant's "hidden" share is measured against it. Variants
interleaved, rotating, medians of ``--reps`` (rank 0's view; a barrier before each run).

    python -m coc_inject.bench.whole_layer [--link 1gbit] [--reps 15] [--chunks auto] [--copies 2]
    coc-inject bench --cases layer [--link 1gbit]    (the same at these defaults)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

VARIANTS = ("megatron", "coc", "copies", "coc+copies", "compute-only")


class _Done:
    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


@contextmanager
def no_collectives(only=None):
    """Every collective (or those named in ``only``) a no-op that zero-fills its output (compute-only timing)."""
    import importlib

    import torch.distributed as dist

    from coc_inject.multi_copy.collectives import MEGATRON_ALIASES

    def output_zeroed(*args, async_op=False, **kwargs):  # (output, input, ...) or ([outputs], input, ...)
        output = args[0] if args else next(iter(kwargs.values()))
        for tensor in output if isinstance(output, list) else [output]:
            tensor.zero_()
        return _Done() if async_op else None

    def in_place(*args, async_op=False, **kwargs):  # all_reduce: the tensor already holds a result
        return _Done() if async_op else None

    names = ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
             "all_gather", "all_to_all_single")
    saved = [(dist, "all_reduce", dist.all_reduce)] + [(dist, name, getattr(dist, name)) for name in names]
    saved += [(module, alias, getattr(module, alias)) for module in map(importlib.import_module, MEGATRON_ALIASES)
              for alias in MEGATRON_ALIASES[module.__name__]]
    saved = [entry for entry in saved if only is None or entry[1] in only]
    for owner, name, _ in saved:
        setattr(owner, name, in_place if name == "all_reduce" else output_zeroed)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def build_block(args):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coc_inject.bench.cpu_layer_norm import CpuLayerNorm

    torch.manual_seed(1234)
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tp = torch.distributed.get_world_size()
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
        tensor_model_parallel_size=tp, sequence_parallel=True, params_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CpuLayerNorm
    block = TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[spec] * args.layers,
                                                                layer_norm=CpuLayerNorm))
    hidden = torch.randn(args.seq // tp, args.batch, args.hidden)
    mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1)
    return block, hidden, mask


def rank_work(args, device) -> dict | None:
    import tempfile

    import torch
    import torch.distributed as dist
    from megatron.core.transformer import transformer_block

    from coc_inject import job, patching
    from coc_inject.config import CocConfig
    from coc_inject.multi_copy import install as copies

    block, hidden, mask = build_block(args)

    def step():
        x = hidden.clone().requires_grad_(True)
        out = block(x, mask)
        out.backward(torch.ones_like(out))

    @contextmanager
    def variant(name):
        config = CocConfig(parallel_num=args.chunks if "coc" in name else 1, multi_copy=args.copies if "copies" in name else 1,
                           tune_cache=tune_cache)
        if config.enabled:
            patching.install(config)
        if config.multi_copy_armed:
            copies.install(config, transformer_block)
        try:
            with no_collectives() if name == "compute-only" else nullcontext():
                yield
        finally:
            job.uninstall()

    times = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as scratch:
        tune_cache = f"{scratch}/tune.json"
        for name in VARIANTS:  # warm-up: and CoC auto's trials, decided once, kept by the cache
            with variant(name):
                step()
        for rep in range(args.reps):
            shift = rep % len(VARIANTS)
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                with variant(name):
                    dist.barrier()
                    began = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - began)
    slowest = torch.tensor([times[name] for name in VARIANTS], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return None
    medians = {name: 1e3 * statistics.median(row) for name, row in zip(VARIANTS, slowest.tolist())}
    compute = medians["compute-only"]
    exposed_megatron = medians["megatron"] - compute
    rows = {}
    for name in VARIANTS[:-1]:
        exposed = medians[name] - compute
        rows[name] = {"ms": medians[name], "exposed_ms": exposed, "speedup": medians["megatron"] / medians[name],
                      "hidden_share": 1 - exposed / exposed_megatron if exposed_megatron > 0 else None}
    return {"compute_only_ms": compute, "rows": rows}


CASE = "layer"  # coc-inject bench --cases layer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link", metavar="RATE")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--chunks", default="auto", help="COC_PARALLEL_NUM of the CoC variants")
    parser.add_argument("--copies", type=int, default=2, help="COC_MULTI_COPY of the multi-copy variants")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write layer.json here")
    return parser


def measure(args) -> int:
    """Runs the ranks, prints the table, writes ``args.out/layer.json`` (with --out)."""
    from coc_inject.bench import ranks
    from coc_inject.config import AUTO

    args.chunks = AUTO if str(args.chunks) == "auto" else int(args.chunks)
    setup = ranks.Setup(world=2, link=args.link, threads=args.threads, command="coc-inject bench --cases layer")
    result = ranks.run(setup, rank_work, args)
    if result is None:
        return 0  # not rank 0 of a torchrun job
    title = (f"one TransformerBlock ({args.layers} layer, seq {args.seq}, batch {args.batch}, hidden {args.hidden}) "
             f"forward + backward, TP=2 SP, {ranks.describe_where(setup)}; {args.reps} interleaved repetitions; "
             f"compute only {result['compute_only_ms']:.1f} ms")
    print(title)
    for name, row in result["rows"].items():
        hidden = "" if row["hidden_share"] is None else f", {100 * row['hidden_share']:.0f}% of Megatron's exposed hidden"
        print(f"  {name:11s} {row['ms']:8.1f} ms  {row['speedup']:.3f}x  exposed communication "
              f"{row['exposed_ms']:.1f} ms{hidden}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "layer.json").write_text(json.dumps({"title": title, "argv": sys.argv, **result}, indent=1))
    return 0


def bench(bench_args) -> int:
    """``coc-inject bench --cases layer``: this bench at its own sizes, with bench's --link, --reps,
    --threads, --out and its CoC count (auto if listed in --chunks, else the largest)."""
    chunks = "auto" if "auto" in bench_args.chunks else max(bench_args.chunks)
    args = build_parser().parse_args(["--reps", str(bench_args.reps), "--threads", str(bench_args.threads),
                                      "--chunks", str(chunks), "--out", str(bench_args.out)]
                                     + (["--link", bench_args.link] if bench_args.link else []))
    return measure(args)


def main(argv=None) -> int:
    return measure(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
