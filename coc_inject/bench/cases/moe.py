"""``coc-inject bench --cases moe``: one MoE layer forward + backward at expert parallelism EP
(alltoall dispatcher, SequentialMLP experts, or with ``--grouped`` the legacy GroupedMLP, top-k):
Megatron's dispatcher, the pieces at each chunk count per local expert (grouped: each piece a chunk of
every local expert's rows, one grouped GEMM) that auto tries, auto, and the compute-only twin (the tokens' all-to-alls no-ops) -- C, M, the limit max(C, M), each variant's
share of it and of M hidden (coc_inject.bench.report), auto against the best fixed count. On CPU
ranks, Megatron's MoE code needs the CPU shims of coc_inject.testbed.cpu (never applied in a user's job).

    coc-inject bench --cases moe [--link 1gbit] [--ep 2] [--local-experts 1 2 4] [--reps 5] [--grouped]

``--grouped`` needs a megatron-core with the legacy GroupedMLP (0.12 to 0.16); on CPU ranks its
grouped_gemm kernel is the test bed's stand-in (coc_inject.testbed.grouped_gemm).
"""

from __future__ import annotations

import contextlib
import sys

from coc_inject.bench import engine, report
from coc_inject.testbed import link, ranks
from coc_inject.timer import Timer
from coc_inject.moe.auto import CHUNKS


def variants() -> tuple:
    return ("megatron", *(f"pieces c={c}" for c in CHUNKS), "auto", report.COMPUTE_ONLY)


def rank_work(args, device) -> list | None:
    import tempfile

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_layer

    from coc_inject import job
    from coc_inject.config import CocConfig
    from coc_inject.moe import install
    from coc_inject.testbed.cpu import cpu_moe_shims
    from coc_inject.testbed.models import build_moe_layer

    if device.type == "cpu":
        cpu_moe_shims()
        if args.grouped:
            from coc_inject.testbed import grouped_gemm

            grouped_gemm.install()
    ep = dist.get_world_size()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    timer, results = Timer(device), []
    with tempfile.TemporaryDirectory() as scratch:
        for local in args.local_experts:
            torch.manual_seed(1234 + dist.get_rank())
            layer = build_moe_layer(args.moe_hidden, args.moe_ffn, local * ep, args.moe_topk, ep,
                                    grouped=args.grouped).to(device)
            x = torch.randn(args.moe_tokens, 1, args.moe_hidden, device=device)
            auto_choice = [None]

            def step():
                out, _ = layer(x.clone().requires_grad_(True))
                out.backward(torch.ones_like(out))

            def variant(name):
                @contextlib.contextmanager
                def installed():
                    job.uninstall()
                    if name.startswith("pieces") or name == "auto":
                        config = CocConfig(moe_overlap="auto" if name == "auto" else "1",
                                           tune_cache=f"{scratch}/tune-{local}.json")
                        install.install(config, moe_layer, None if name == "auto" else int(name.split("=")[1]))
                    try:  # C: the tokens' all-to-alls only; the dispatcher's small count gathers must still run
                        with (link.no_collectives(("all_to_all_single",)) if name == report.COMPUTE_ONLY
                              else contextlib.nullcontext()):
                            yield
                    finally:
                        if name == "auto":
                            auto_choice[0] = next(iter(job.current().decisions(job.MOE).values()), None)
                        job.uninstall()
                return installed

            # the warm-up makes auto's trials, decided once, kept by the cache
            runs = {name: engine.fwd_bwd(timer, step, variant(name)) for name in variants()}
            times, _ = engine.measure(runs, args.reps, device=device, tag="coc-inject bench moe",
                                      label=f"{local} local: ")
            decision = auto_choice[0]
            results.append(summarize(local, ep, args.moe_topk, {n: report.totals(t) for n, t in times.items()},
                                     None if decision is None else decision.choice, type(layer.experts).__name__))
    if dist.get_rank() != 0:
        return None
    sys.stderr.write("\n")
    return results


def summarize(local: int, ep: int, topk: int, samples: dict, auto_chunks, experts: str = "SequentialMLP") -> dict:
    """The report's overlap figures of one case, and auto against the best fixed count."""
    case = report.overlap(samples)
    rows = case["rows"]
    best = max((n for n in rows if n.startswith("pieces")), key=lambda n: rows[n]["vs_megatron"])
    kind = "" if experts == "SequentialMLP" else f" ({experts})"
    return {"label": f"EP{ep}, {local} local expert{'s' if local > 1 else ''}{kind}, top-{topk}", "local_experts": local,
            "experts": experts,
            **case, "best_fixed": best, "auto_chunks": auto_chunks,
            "auto_vs_best": rows["auto"]["ms"] and rows[best]["ms"] / rows["auto"]["ms"]}


def format_table(results: list) -> str:
    def auto(case):
        chose = "Megatron's dispatcher" if case["auto_chunks"] in (None, "megatron") else f"c={case['auto_chunks']}"
        return f"; auto chose {chose} ({case['auto_vs_best']:.3f}x the best fixed, {case['best_fixed']})"
    return "\n".join(report.format_overlap(case, case["label"], auto(case)) for case in results)


def add_options(parser) -> None:
    group = parser.add_argument_group("MoE case (--cases moe)")
    group.add_argument("--ep", type=int, default=2, help="EP (default 2): moe, a local rank each; layer --moe: 1 or 2")
    group.add_argument("--local-experts", nargs="+", type=int, default=[1, 2, 4],
                       help="local experts per rank, one case each (default 1 2 4)")
    group.add_argument("--moe-tokens", type=int, default=4096, help="tokens per rank into the layer")
    group.add_argument("--moe-hidden", type=int, default=1024)
    group.add_argument("--moe-ffn", type=int, default=768, help="expert FFN size (default 768: the experts' compute "
                       "and their all-to-alls of the same order over the emulated 1 gbit link, one thread per rank)")
    group.add_argument("--moe-topk", type=int, default=2)
    group.add_argument("--grouped", action="store_true",
                       help="the legacy GroupedMLP experts (megatron-core 0.12 to 0.16; CPU ranks: the test bed's "
                       "grouped_gemm stand-in): a piece is a chunk of every local expert's rows, one grouped GEMM")


def bench(args) -> int:
    """Prints the table, writes ``moe.json`` and ``moe.png`` into --out."""
    setup = ranks.Setup(world=args.ep, link=args.link, threads=args.threads, megatron=False,
                        command="coc-inject bench --cases moe")
    results = ranks.run(setup, rank_work, args)
    if results is None:
        return 0  # not rank 0 of a torchrun job
    title = (f"one MoE layer forward + backward{' (GroupedMLP experts)' if args.grouped else ''}, "
             f"{args.moe_tokens} tokens per rank, hidden {args.moe_hidden}, "
             f"ffn {args.moe_ffn}, top-{args.moe_topk}; {ranks.describe_where(setup)}; {args.reps} interleaved "
             "repetitions")
    print(title)
    print(format_table(results))
    report.write(args.out, "moe", {"title": title, "argv": sys.argv, "cases": results},
                 [report.overlap_panel(case, case["label"]) for case in results], title)
    return 0
