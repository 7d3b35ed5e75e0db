"""The linear cases' figures (coc_inject.bench.cases.linears): per variant the bench report's medians
and ratios to Megatron per pass, the pipelining ideal of its N chunks and the overlap efficiency."""

from __future__ import annotations

from coc_inject.bench.report import median_ms, median_ratio, totals

TARGETS = ("speedup >= 1.35 at the best N and >= 90% of the ideal saving (Row AR, emulated 1 gbit); "
           ">= 90% of the ideal saving (SP cases); host overhead <= 15 us per chunk")
ALONE = ("compute-only", "comm-only")


def chunks_of(name: str, result: dict) -> int:
    """The chunk count a variant ran: ``N=c`` -> c; ``auto`` -> the N it decided."""
    return result["auto"]["chunks"] if name == "auto" else int(name.split("=")[1])


def summarize_case(result: dict) -> dict:
    """Figures for one case. With compute C and communication M (forward, each measured alone), N
    chunks: ideal ``max(C, M) + min(C, M)/N``, ideal saving ``min(C, M) * (1 - 1/N)``, efficiency
    ``(t_megatron - t_N) / ideal saving``. ``auto`` is figured with the N it chose (its row adds
    ``chunks`` and ``decision``: source, trial times, noise)."""
    times = result["times"]
    compute, comm = median_ms(times["compute-only"]["forward"]), median_ms(times["comm-only"]["forward"])
    megatron = times["megatron"]
    megatron_fwd_ms = median_ms(megatron["forward"])
    variants = {}
    for name, samples in times.items():
        if name in ALONE:
            continue
        row = {"forward_ms": median_ms(samples["forward"]), "backward_ms": median_ms(samples["backward"]),
               "fwd_bwd_ms": median_ms(totals(samples))}
        if name != "megatron":
            chunks = chunks_of(name, result)
            if name == "auto":
                row["chunks"], row["decision"] = chunks, result["auto"]
            for phase in ("forward", "backward"):
                row[f"{phase}_speedup"] = median_ratio(megatron[phase], samples[phase])
            row["fwd_bwd_speedup"] = median_ratio(totals(megatron), totals(samples))
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
                return "-" if row.get(key) is None else format(row[key], spec)
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


def panels(summary: dict, results: list) -> list:
    """Speedup vs N per case (dotted: the ideal; stars: auto at its N), and one CoC call's timeline."""
    def speedups(axis):
        for case in summary.values():
            points = sorted((int(v.split("=")[1]), row) for v, row in case["variants"].items()
                            if v not in ("megatron", "auto"))
            xs = [n for n, _ in points]
            line, = axis.plot(xs, [row["forward_speedup"] for _, row in points], "o-", label=f"{case['label']} fwd")
            color = line.get_color()
            axis.plot(xs, [row["fwd_bwd_speedup"] for _, row in points], "s--", color=color,
                      label=f"{case['label']} fwd+bwd")
            axis.plot(xs, [row["ideal_speedup"] for _, row in points], ":", color=color, alpha=0.6)
            auto = case["variants"].get("auto")
            if auto is not None:  # at the N it chose: filled star fwd, hollow star fwd+bwd
                axis.plot([auto["chunks"]], [auto["forward_speedup"]], "*", markersize=13, color=color,
                          label=f"{case['label']} auto (chose N={auto['chunks']})")
                axis.plot([auto["chunks"]], [auto["fwd_bwd_speedup"]], "*", markersize=13, markerfacecolor="none",
                          color=color)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("chunks N")
        axis.set_ylabel("speedup vs unpatched Megatron (median of ratios)")
        axis.set_title("speedup (dotted: pipelining ideal; stars: auto at its N)")
        axis.legend(fontsize=7)

    def lanes(axis):
        first = results[0]
        starts = sorted({start for _, start, _, _ in first["timeline"]})
        for kind, start, t0, t1 in first["timeline"]:
            lane = 1 if kind == "compute" else 0
            axis.broken_barh([(t0, max(t1 - t0, 0.05))], (lane - 0.35, 0.7), color=f"C{starts.index(start) % 10}",
                             alpha=0.85)
            axis.text((t0 + t1) / 2, lane, str(starts.index(start)), ha="center", va="center", fontsize=7)
        axis.set_yticks([0, 1], ["communication", "matmul"])
        axis.set_xlabel("ms since the call began (host clock, rank 0)")
        axis.set_title(f"one {first['label']} forward, {len(starts)} chunks")

    return [speedups, lanes]
