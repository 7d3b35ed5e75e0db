"""Bench figures from raw per-repetition times: medians, ratios, ideal, efficiency; table, JSON, PNG."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def _median_ms(samples):
    return 1e3 * statistics.median(samples)


def _median_ratio(reference, samples):
    return statistics.median(r / t for r, t in zip(reference, samples))


def chunks_of(name: str, result: dict) -> int:
    """The chunk count a variant ran: ``N=c`` -> c; ``auto`` -> the N it decided."""
    return result["auto"]["chunks"] if name == "auto" else int(name.split("=")[1])


def summarize_case(result: dict) -> dict:
    """Figures for one case. Ratios are medians of per-repetition Megatron/variant ratios.

    Pipelining ideal for N chunks with compute C and communication M (forward, measured alone):
    ``max(C, M) + min(C, M)/N``; the ideal *saving* against Megatron's measured time is
    ``min(C, M) * (1 - 1/N)``, and overlap efficiency is the fraction of it achieved:
    ``(t_megatron - t_N) / ideal saving``. The ``auto`` variant is figured with the N it chose
    (its row adds ``chunks`` and ``decision``: source, trial times, noise).
    """
    times = result["times"]
    compute = _median_ms(times["compute-only"]["forward"])
    comm = _median_ms(times["comm-only"]["forward"])
    megatron = times["megatron"]
    megatron_total = [f + b for f, b in zip(megatron["forward"], megatron["backward"])]
    megatron_fwd_ms = _median_ms(megatron["forward"])
    variants = {}
    for name, samples in times.items():
        if name in ("compute-only", "comm-only"):
            continue
        total = [f + b for f, b in zip(samples["forward"], samples["backward"])]
        row = {"forward_ms": _median_ms(samples["forward"]), "backward_ms": _median_ms(samples["backward"]),
               "fwd_bwd_ms": _median_ms(total)}
        if name != "megatron":
            chunks = chunks_of(name, result)
            if name == "auto":
                row["chunks"] = chunks
                row["decision"] = result["auto"]
            row["forward_speedup"] = _median_ratio(megatron["forward"], samples["forward"])
            row["backward_speedup"] = _median_ratio(megatron["backward"], samples["backward"])
            row["fwd_bwd_speedup"] = _median_ratio(megatron_total, total)
            saving = min(compute, comm) * (1 - 1 / chunks)
            row["ideal_ms"] = max(compute, comm) + min(compute, comm) / chunks
            row["ideal_speedup"] = megatron_fwd_ms / (megatron_fwd_ms - saving) if saving else 1.0
            row["efficiency"] = (megatron_fwd_ms - row["forward_ms"]) / saving if saving > 0 else None
        variants[name] = row
    return {"label": result["label"], "compute_ms": compute, "comm_ms": comm, "variants": variants}


def summarize(results: list) -> dict:
    return {result["case"]: summarize_case(result) for result in results}


def format_table(summary: dict) -> str:
    lines = [f"{'case':<22} {'variant':<9} {'fwd ms':>8} {'fwd x':>6} {'ideal ms':>9} {'eff':>5} "
             f"{'bwd ms':>8} {'bwd x':>6} {'fwd+bwd ms':>10} {'f+b x':>6}"]
    for case in summary.values():
        lines.append(f"{case['label']:<22} compute-only {case['compute_ms']:.1f} ms, comm-only {case['comm_ms']:.1f} ms")
        for name, row in case["variants"].items():
            def fmt(key, spec):
                value = row.get(key)
                return "-" if value is None else format(value, spec)
            shown = f"auto N={row['chunks']}" if name == "auto" else name
            lines.append(f"{'':<22} {shown:<9} {row['forward_ms']:8.1f} {fmt('forward_speedup', '.2f'):>6} "
                         f"{fmt('ideal_ms', '.1f'):>9} {fmt('efficiency', '.0%'):>5} "
                         f"{row['backward_ms']:8.1f} {fmt('backward_speedup', '.2f'):>6} "
                         f"{row['fwd_bwd_ms']:10.1f} {fmt('fwd_bwd_speedup', '.2f'):>6}")
        if "auto" in case["variants"]:
            lines.append(f"{'':<22} {describe_decision(case['variants']['auto']['decision'])}")
    lines.append("x: median over repetitions of Megatron time / variant time (> 1: faster). ideal: "
                 "max(C,M)+min(C,M)/N. eff: achieved / ideal saving.")
    if any("auto" in case["variants"] for case in summary.values()):
        lines.append("auto N=c: COC_PARALLEL_NUM=auto (fresh tune cache), its trials (fwd+bwd, median, max "
                     "over ranks) run before the repetitions; timed: the N it chose (N=1: Megatron's path).")
    return "\n".join(lines)


def describe_decision(decision: dict) -> str:
    """``auto chose N=4 (trials: N=1 2.10 ms, N=2 1.50 ms, ...; noise 0.06 ms)``."""
    text = f"auto chose N={decision['chunks']} ({decision['source']}"
    if decision.get("times_ms"):
        text += ": " + ", ".join(f"N={c} {t:.2f} ms" for c, t in decision["times_ms"].items())
        text += f"; noise {decision['noise_ms']:.2f} ms"
    return text + ")"


def write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=1) + "\n")


def write_png(path: Path, summary: dict, results: list, title: str) -> str | None:
    """Speedup vs N per case, and a timeline of one CoC call. Returns why not, if it can't."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'coc-inject[bench]'): no PNG written"
    figure, (speed, lanes) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, case in summary.items():
        points = sorted((int(v.split("=")[1]), row) for v, row in case["variants"].items()
                        if v not in ("megatron", "auto"))
        xs = [n for n, _ in points]
        line, = speed.plot(xs, [row["forward_speedup"] for _, row in points], "o-", label=f"{case['label']} fwd")
        speed.plot(xs, [row["fwd_bwd_speedup"] for _, row in points], "s--", color=line.get_color(),
                   label=f"{case['label']} fwd+bwd")
        speed.plot(xs, [row["ideal_speedup"] for _, row in points], ":", color=line.get_color(), alpha=0.6)
        auto = case["variants"].get("auto")
        if auto is not None:  # at the N it chose: filled star fwd, hollow star fwd+bwd
            speed.plot([auto["chunks"]], [auto["forward_speedup"]], "*", markersize=13, color=line.get_color(),
                       label=f"{case['label']} auto (chose N={auto['chunks']})")
            speed.plot([auto["chunks"]], [auto["fwd_bwd_speedup"]], "*", markersize=13, markerfacecolor="none",
                       color=line.get_color())
    speed.axhline(1.0, color="grey", linewidth=0.8)
    speed.set_xscale("log", base=2)
    speed.set_xlabel("chunks N")
    speed.set_ylabel("speedup vs unpatched Megatron (median of ratios)")
    speed.set_title("speedup (dotted: pipelining ideal; stars: auto at its N)")
    speed.legend(fontsize=7)
    first = results[0]
    events = first["timeline"]
    starts = sorted({start for _, start, _, _ in events})
    for kind, start, t0, t1 in events:
        lane = 1 if kind == "compute" else 0
        lanes.broken_barh([(t0, max(t1 - t0, 0.05))], (lane - 0.35, 0.7),
                          color=f"C{starts.index(start) % 10}", alpha=0.85)
        lanes.text((t0 + t1) / 2, lane, str(starts.index(start)), ha="center", va="center", fontsize=7)
    lanes.set_yticks([0, 1], ["communication", "matmul"])
    lanes.set_xlabel("ms since the call began (host clock, rank 0)")
    lanes.set_title(f"one {first['label']} forward, {len(starts)} chunks")
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None
