"""One MoE layer forward + backward at expert parallelism EP (alltoall dispatcher, SequentialMLP
experts, top-k): Megatron's dispatcher, the pieces at 1, 2 and 4 chunks per local expert, auto, and
the compute-only twin (every collective a no-op) -- with the pipelining limit.

C = the compute-only time (the tokens' all-to-alls no-ops); M = Megatron's time minus C (its exposed communication). Pipelining can
at best hide the smaller of the two: the limit is max(C, M), and each variant's "of limit" is
limit / its time; "hidden" is the share of M it no longer shows. Variants interleaved, rotating,
medians of ``--reps`` of the MAX over ranks (a barrier before each run). On CPU ranks, Megatron's MoE
code needs the CPU shims of :func:`cpu_moe_shims` (never applied in a user's job).

    coc-inject bench --cases moe [--link 1gbit] [--ep 2] [--local-experts 1 2 4] [--reps 5]
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

CASE = "moe"  # coc-inject bench --cases moe
CHUNKS = (1, 2, 4)


def cpu_moe_shims() -> None:
    """Megatron's alltoall dispatcher on CPU ranks: its side stream for the split counts' device-to-
    host copies made inert, and the split sizes (tensors there, without the copy) handed to gloo as
    lists."""
    import torch
    import torch.distributed as dist

    class _Event:
        def synchronize(self):
            pass

    class _Stream:
        def __init__(self, *args, **kwargs):
            pass

        def record_event(self, *args, **kwargs):
            return _Event()

        def wait_stream(self, *args, **kwargs):
            pass

    torch.cuda.Stream = _Stream
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    if getattr(dist.all_to_all_single, "_splits_as_lists", False):
        return
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        as_list = lambda sizes: sizes.tolist() if hasattr(sizes, "tolist") else sizes  # noqa: E731
        return original(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)

    all_to_all_single._splits_as_lists = True
    dist.all_to_all_single = all_to_all_single


def variants() -> tuple:
    return ("megatron", *(f"pieces c={c}" for c in CHUNKS), "auto", "compute-only")


def _layer(args, local_experts: int, ep: int):
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=args.moe_hidden, num_attention_heads=8, ffn_hidden_size=args.moe_ffn,
        num_moe_experts=local_experts * ep, moe_router_topk=args.moe_topk, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, moe_aux_loss_coeff=0.0, add_bias_linear=False, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, params_dtype=torch.float32,
        moe_router_pre_softmax=args.moe_topk == 1)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False).submodules.mlp
    return spec(config=config) if callable(spec) else build_module(spec, config=config)


def rank_work(args, device) -> dict | None:
    import tempfile

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_layer

    from coc_inject import job
    from coc_inject.bench.whole_layer import no_collectives
    from coc_inject.config import CocConfig
    from coc_inject.moe import install
    from coc_inject.tuning.online import schedule

    if device.type == "cpu":
        cpu_moe_shims()
    ep = dist.get_world_size()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    names, results = variants(), []
    with tempfile.TemporaryDirectory() as scratch:
        for local in args.local_experts:
            torch.manual_seed(1234 + dist.get_rank())
            layer = _layer(args, local, ep).to(device)
            x = torch.randn(args.moe_tokens, 1, args.moe_hidden, device=device)

            def step():
                out, _ = layer(x.clone().requires_grad_(True))
                out.backward(torch.ones_like(out))

            @contextlib.contextmanager
            def variant(name):
                job.uninstall()
                if name.startswith("pieces") or name == "auto":
                    config = CocConfig(moe_overlap="auto" if name == "auto" else "1",
                                       tune_cache=f"{scratch}/tune-{local}.json")
                    install.install(config, moe_layer, None if name == "auto" else int(name.split("=")[1]))
                try:
                    # the data's all-to-alls only: the dispatcher's small count gathers must still run
                    with no_collectives(("all_to_all_single",)) if name == "compute-only" else contextlib.nullcontext():
                        yield
                finally:
                    if name == "auto":
                        decided = job.current().decisions(install.MOE)
                        auto_choice[0] = next(iter(decided.values()), None)
                    job.uninstall()

            auto_choice = [None]
            warm_up, timed = schedule(list(names), rounds=args.reps)
            times = {name: [] for name in names}
            for name in warm_up:  # and auto's trials, decided once, kept by the cache
                with variant(name):
                    step()
            for name in timed:
                with variant(name):
                    dist.barrier()
                    began = time.perf_counter()
                    step()
                    times[name].append(time.perf_counter() - began)
            slowest = torch.tensor([times[name] for name in names], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            decision = auto_choice[0]
            results.append(summarize(local, ep, args.moe_topk, dict(zip(names, slowest.tolist())),
                                     None if decision is None else decision.choice))
    return results if dist.get_rank() == 0 else None


def summarize(local: int, ep: int, topk: int, samples: dict, auto_chunks) -> dict:
    """Medians (ms), per-repetition ratios to Megatron, C, M, the limit and each variant's share of it."""
    medians = {name: 1e3 * statistics.median(row) for name, row in samples.items()}
    compute = medians.pop("compute-only")
    comm = max(medians["megatron"] - compute, 0.0)
    limit = max(compute, comm)
    rows = {}
    for name, ms in medians.items():
        ratio = statistics.median(m / t for m, t in zip(samples["megatron"], samples[name]))
        rows[name] = {"ms": ms, "vs_megatron": ratio, "of_limit": limit / ms,
                      "hidden": 1 - (ms - compute) / comm if comm > 0 else None}
    best = max((n for n in rows if n.startswith("pieces")), key=lambda n: rows[n]["vs_megatron"])
    return {"label": f"EP{ep}, {local} local expert{'s' if local > 1 else ''}, top-{topk}", "local_experts": local,
            "compute_ms": compute, "comm_ms": comm, "limit_ms": limit, "rows": rows, "best_fixed": best,
            "auto_chunks": auto_chunks, "auto_vs_best": rows["auto"]["ms"] and rows[best]["ms"] / rows["auto"]["ms"]}


def format_table(results: list) -> str:
    lines = []
    for case in results:
        lines.append(f"{case['label']}: C {case['compute_ms']:.1f} ms, M {case['comm_ms']:.1f} ms, limit max(C, M) "
                     f"{case['limit_ms']:.1f} ms; auto chose "
                     + ("Megatron's dispatcher" if not case["auto_chunks"] else f"c={case['auto_chunks']}")
                     + f" ({case['auto_vs_best']:.3f}x the best fixed, {case['best_fixed']})")
        for name, row in case["rows"].items():
            hidden = "" if row["hidden"] is None else f"  hides {100 * row['hidden']:.0f}% of M"
            lines.append(f"  {name:13s} {row['ms']:9.1f} ms  {row['vs_megatron']:.3f}x  "
                         f"{100 * row['of_limit']:5.1f}% of limit{hidden}")
    return "\n".join(lines)


def write_png(path: Path, results: list, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'coc-inject[bench]'): no PNG written"
    figure, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4.2), squeeze=False)
    for axis, case in zip(axes[0], results):
        names = list(case["rows"])
        axis.bar(range(len(names)), [case["rows"][n]["ms"] for n in names], color=[f"C{i}" for i in range(len(names))])
        axis.axhline(case["limit_ms"], color="black", linestyle=":", label="limit max(C, M)")
        axis.axhline(case["compute_ms"], color="grey", linestyle="--", label="compute only C")
        axis.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
        axis.set_ylabel("ms, forward + backward")
        axis.set_title(case["label"], fontsize=9)
        axis.legend(fontsize=7)
    figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def bench(args) -> int:
    """``coc-inject bench --cases moe``: prints the table, writes ``moe.json`` and ``moe.png`` into --out."""
    from coc_inject.bench import ranks

    setup = ranks.Setup(world=args.ep, link=args.link, threads=args.threads, megatron=False,
                        command="coc-inject bench --cases moe")
    results = ranks.run(setup, rank_work, args)
    if results is None:
        return 0  # not rank 0 of a torchrun job
    title = (f"one MoE layer forward + backward, {args.moe_tokens} tokens per rank, hidden {args.moe_hidden}, ffn {args.moe_ffn}, "
             f"top-{args.moe_topk}; {ranks.describe_where(setup)}; {args.reps} interleaved repetitions")
    print(title)
    print(format_table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe.json").write_text(json.dumps({"title": title, "argv": sys.argv, "cases": results}, indent=1))
    problem = write_png(args.out / "moe.png", results, title)
    print(f"wrote {args.out / 'moe.json'}" + (f"; {problem}" if problem else f" and {args.out / 'moe.png'}"))
    return 0
