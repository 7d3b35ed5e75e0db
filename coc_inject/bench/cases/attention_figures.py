"""The attention case's figures (coc_inject.bench.cases.attention): the bench report's medians and
ratios, against allgather; the ring's step-wise pipelining ideal and overlap efficiency, memory kept
for backward, the SDPA yardstick; table, targets, PNG panels.

Pipelining ideal of a plain ring (window 1) of n steps, per pass, from the per-step medians of
the compute-only run (c_k: kernel of step k) and of the communication-only run (m_k: transfer k,
start to done), plus the compute outside the steps (layout permutes, accumulators):

    ideal = (C - sum c_k) + sum_{k<n} max(c_k, m_k) + sum_{k>=n} m_k

Transfer k runs beside step k; forward has n-1 transfers (the last step computes alone), backward
n+1 (the last hop brings the gradients home with nothing left to compute). That is the schedule's
own dependency chain with every step perfectly overlapped -- tighter than the generic
``max(C, M) + min(C, M)/n`` (also given, as ``simple_ideal_ms``), which is used for Double-Ring,
whose outer hops span several inner steps. Overlap efficiency = (serial - achieved) / (serial -
ideal), serial = C + M (M: time some transfer was in flight in the communication-only run).
"""

from __future__ import annotations

import math
import statistics

from coc_inject.bench.report import median_ms as _ms, median_ratio as _median_ratio, totals as _totals

PASSES = ("forward", "backward")
TARGET_SPEEDUP, TARGET_EFFICIENCY = 1.25, 0.80
AUTO_SLACK = 0.05  # COC_CP_ALGO=auto: within 5% of the best fixed algorithm


def steps(trace) -> dict:
    """Per pass of one traced call: each kernel step's duration, each transfer's (start to done), and
    the time some transfer was in flight (union of those intervals: Double-Ring's overlap counted once)."""
    figures = {}
    for phase in PASSES:
        compute = [t1 - t0 for p, t0, t1 in trace.of("compute") if p == phase]
        spans = sorted((t0, t1) for p, t0, _, t1 in trace.of("transfer") if p == phase)  # in start order
        union, reach = 0.0, -math.inf
        for t0, t1 in spans:
            union += max(0.0, t1 - max(t0, reach))
            reach = max(reach, t1)
        figures[phase] = {"compute_steps": compute, "transfers": [t1 - t0 for t0, t1 in spans], "in_flight": union}
    return figures


def _per_step_medians(runs, phase, key):
    """Median over repetitions of each step's figure (steps beyond a run's count are 0)."""
    count = max(len(run[phase][key]) for run in runs)
    return [statistics.median(run[phase][key][k] if k < len(run[phase][key]) else 0.0 for run in runs)
            for k in range(count)]


def ring_analysis(result: dict, variant: dict) -> dict:
    name, n = variant["name"], result["ring_sizes"][variant["name"]]
    times, compute_only = result["times"][name], result["times"][f"{name}:C"]
    comm_runs, compute_runs = result["steps"][f"{name}:M"], result["steps"][f"{name}:C"]
    figures = {}
    for phase in PASSES:
        c, m = _ms(compute_only[phase]), _ms([run[phase]["in_flight"] for run in comm_runs])
        c_steps = [1e3 * t for t in _per_step_medians(compute_runs, phase, "compute_steps")]
        m_steps = [1e3 * t for t in _per_step_medians(comm_runs, phase, "transfers")]
        simple = max(c, m) + min(c, m) / n
        if variant["window"] == 1:
            overlapped = sum(max(ck, m_steps[k] if k < len(m_steps) else 0.0) for k, ck in enumerate(c_steps))
            ideal, formula = (c - sum(c_steps)) + overlapped + sum(m_steps[len(c_steps):]), "step-wise"
        else:
            ideal, formula = simple, "max(C,M)+min(C,M)/n"
        figures[phase] = {"C_ms": c, "M_ms": m, "C_steps_ms": c_steps, "M_steps_ms": m_steps,
                          "ideal_ms": ideal, "simple_ideal_ms": simple, "ideal_formula": formula,
                          "achieved_ms": _ms(times[phase])}
    both = {"C_ms": _ms(_totals(compute_only)),
            "M_ms": _ms([run["forward"]["in_flight"] + run["backward"]["in_flight"] for run in comm_runs]),
            "ideal_ms": sum(figures[p]["ideal_ms"] for p in PASSES),
            "simple_ideal_ms": sum(figures[p]["simple_ideal_ms"] for p in PASSES),
            "ideal_formula": figures["forward"]["ideal_formula"], "achieved_ms": _ms(_totals(times))}
    figures["fwd_bwd"] = both
    for row in figures.values():
        row["serial_ms"] = row["C_ms"] + row["M_ms"]
        row["efficiency"] = _efficiency(row["serial_ms"], row["achieved_ms"], row["ideal_ms"])
        row["simple_efficiency"] = _efficiency(row["serial_ms"], row["achieved_ms"], row["simple_ideal_ms"])
    return {"steps": n, "window": variant["window"], **figures}


def _efficiency(serial, achieved, ideal):
    return (serial - achieved) / (serial - ideal) if serial - ideal > 0 else None


def summarize_case(result: dict) -> dict:
    """One CP size: per variant medians, medians of per-repetition allgather/variant ratios
    (> 1: faster than allgather), memory kept for backward (largest rank), ring analyses."""
    times = result["times"]
    reference = times["allgather"]
    variants = {}
    for variant in result["variants"]:
        name, samples = variant["name"], times[variant["name"]]
        memory = result["memory_bytes"][name]
        variants[name] = {
            "algorithm": variant["algorithm"], "window": variant["window"], "ulysses": variant["ulysses"],
            **({"chosen": variant["chosen"]} if "chosen" in variant else {}),
            "forward_ms": _ms(samples["forward"]), "backward_ms": _ms(samples["backward"]),
            "fwd_bwd_ms": _ms(_totals(samples)),
            "forward_x": _median_ratio(reference["forward"], samples["forward"]),
            "backward_x": _median_ratio(reference["backward"], samples["backward"]),
            "fwd_bwd_x": _median_ratio(_totals(reference), _totals(samples)),
            "memory_bytes": max(memory), "memory_bytes_per_rank": memory,
            "max_abs_diff_vs_allgather": result["max_abs_diff_vs_allgather"][name]}
    rings = {v["name"]: ring_analysis(result, v) for v in result["variants"]
             if v["algorithm"] == "ring" and not v.get("kernel")}
    sdpa = times["sdpa"]
    yardstick = {"fwd_bwd_ms": _ms(_totals(sdpa)),
                 # per repetition ring / sdpa (< 1: CP=n ranks faster than one process on the whole sequence)
                 "ring_over_sdpa": statistics.median(r / y for r, y in zip(_totals(times["ring"]), _totals(sdpa)))}
    return {"cp": result["cp"], "kernel": result.get("kernel"), "variants": variants, "rings": rings,
            "sdpa": yardstick}


def summarize(results: list) -> dict:
    return {f"CP={result['cp']}": summarize_case(result) for result in results}


def targets(summary: dict, linked: bool) -> list:
    """Issue #15's attention targets (CP=2, fwd+bwd); meant for the emulated 1 gbit link."""
    case = summary.get("CP=2")
    if case is None:
        return []
    ring, analysis = case["variants"]["ring"], case["rings"]["ring"]["fwd_bwd"]
    where = "emulated link" if linked else "loopback (the targets are set for the emulated 1 gbit link)"
    efficiency = analysis["efficiency"]
    rows = [_auto_target(name, case) for name, case in summary.items() if "auto" in case["variants"]]
    return rows + [
        {"target": f"ring fwd+bwd >= {TARGET_SPEEDUP}x of allgather at CP=2", "where": where,
         "measured": ring["fwd_bwd_x"], "met": ring["fwd_bwd_x"] >= TARGET_SPEEDUP},
        {"target": f"ring overlap efficiency (fwd+bwd) >= {TARGET_EFFICIENCY:.0%} of the step-wise ideal at CP=2",
         "where": where, "measured": efficiency, "met": efficiency is not None and efficiency >= TARGET_EFFICIENCY,
         "C_ms": analysis["C_ms"], "M_ms": analysis["M_ms"]},
    ]


def _auto_target(name: str, case: dict) -> dict:
    """auto (fwd+bwd median) within 5% of the best fixed algorithm's median."""
    fixed = {n: v["fwd_bwd_ms"] for n, v in case["variants"].items() if n != "auto"}
    best = min(fixed, key=fixed.get)
    ratio = case["variants"]["auto"]["fwd_bwd_ms"] / fixed[best]
    return {"target": f"auto fwd+bwd within {AUTO_SLACK:.0%} of the best fixed algorithm at {name} (ratio auto/best)",
            "where": f"best {best}, auto chose {case['variants']['auto']['chosen']}", "measured": ratio,
            "met": ratio <= 1 + AUTO_SLACK}


def format_targets(rows: list) -> str:
    lines = []
    for row in rows:
        value = "n/a" if row["measured"] is None else (f"{row['measured']:.0%}" if "efficiency" in row["target"]
                                                        else f"{row['measured']:.3f}x")
        lines.append(f"target: {row['target']} ({row['where']}): {value} -> {'met' if row['met'] else 'MISSED'}")
    return "\n".join(lines)


def format_table(summary: dict) -> str:
    lines = [f"{'case':<6} {'variant':<22} {'fwd ms':>8} {'fwd x':>6} {'bwd ms':>8} {'bwd x':>6} "
             f"{'f+b ms':>8} {'f+b x':>6} {'kept KiB':>9} {'max|d|':>8}"]
    for label, case in summary.items():
        for name, row in case["variants"].items():
            name = f"auto ({row['chosen']})" if "chosen" in row else name
            lines.append(f"{label:<6} {name:<22} {row['forward_ms']:8.1f} {row['forward_x']:6.2f} "
                         f"{row['backward_ms']:8.1f} {row['backward_x']:6.2f} {row['fwd_bwd_ms']:8.1f} "
                         f"{row['fwd_bwd_x']:6.2f} {row['memory_bytes'] / 1024:9.0f} "
                         f"{row['max_abs_diff_vs_allgather']:8.1e}")
        for name, ring in case["rings"].items():
            for phase in (*PASSES, "fwd_bwd"):
                row = ring[phase]
                eff = "-" if row["efficiency"] is None else f"{row['efficiency']:.0%}"
                simple = "-" if row["simple_efficiency"] is None else f"{row['simple_efficiency']:.0%}"
                lines.append(f"{label:<6} {name + ' ' + phase:<24} C {row['C_ms']:7.1f}  M {row['M_ms']:7.1f}  "
                             f"serial {row['serial_ms']:7.1f}  ideal {row['ideal_ms']:7.1f} ({row['ideal_formula']})"
                             f"  achieved {row['achieved_ms']:7.1f}  eff {eff} (vs simple ideal "
                             f"{row['simple_ideal_ms']:.1f}: {simple})")
        sdpa = case["sdpa"]
        lines.append(f"{label:<6} {'sdpa, 1 process':<22} {'':>8} {'':>6} {'':>8} {'':>6} {sdpa['fwd_bwd_ms']:8.1f}   "
                     f"ring / sdpa {sdpa['ring_over_sdpa']:.3f} (scaled_dot_product_attention on the whole sequence, "
                     "one process)")
    lines.append("x: median over repetitions of allgather time / variant time (> 1: faster). kept: bytes one call "
                 "keeps for backward (largest rank). max|d|: output vs allgather. C: compute only (transfers "
                 "replaced by local copies), M: the ring's transfers only (kernel skipped), serial = C + M, "
                 "eff = (serial - achieved) / (serial - ideal).")
    return "\n".join(lines)


def panels(summary: dict, results: list) -> list:
    """Time vs algorithm per CP size (forward + backward stacked; C+M and the ideal for rings), and the
    timeline of one ring call at the smallest CP."""
    def algorithms(label, case):
        def draw(ax):
            names = list(case["variants"])
            xs = range(len(names))
            forward = [case["variants"][n]["forward_ms"] for n in names]
            backward = [case["variants"][n]["backward_ms"] for n in names]
            ax.bar(xs, forward, color="C0", label="forward")
            ax.bar(xs, backward, bottom=forward, color="C1", label="backward")
            for x, name in enumerate(names):
                ring = case["rings"].get(name)
                if ring is not None:
                    ax.plot([x - 0.4, x + 0.4], [ring["fwd_bwd"]["serial_ms"]] * 2, "k--", linewidth=1)
                    ax.plot([x - 0.4, x + 0.4], [ring["fwd_bwd"]["ideal_ms"]] * 2, "g-", linewidth=2)
                ax.text(x, forward[x] + backward[x], f"{case['variants'][name]['fwd_bwd_x']:.2f}x", ha="center",
                        va="bottom", fontsize=8)
            ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
            ax.set_ylabel("median ms (fwd + bwd stacked)")
            ax.set_title(f"{label}: time per algorithm (label: fwd+bwd vs allgather)\n"
                         "rings: dashed = serial C+M, green = pipelining ideal", fontsize=9)
            ax.legend(fontsize=8)
        return draw

    return [*(algorithms(label, case) for label, case in summary.items()), lambda ax: _timeline(ax, results[0])]


def _timeline(ax, result: dict) -> None:
    line = result["timeline"]
    steps = {"forward": 0, "backward": 0}
    for event in sorted(line["events"], key=lambda e: e["start"]):
        if event["kind"] == "compute":
            index = steps[event["pass"]]
            steps[event["pass"]] += 1
            ax.broken_barh([(event["start"], event["end"] - event["start"])], (0.65, 0.7),
                           color="C0" if event["pass"] == "forward" else "C1")
            ax.text((event["start"] + event["end"]) / 2, 1, str(index), ha="center", va="center", fontsize=7)
        else:
            ax.broken_barh([(event["start"], event["wait"] - event["start"])], (-0.35, 0.7), color="C2", alpha=0.6)
            ax.broken_barh([(event["wait"], event["end"] - event["wait"])], (-0.35, 0.7), color="C3")
    ax.axvline(line["backward_began"], color="grey", linestyle=":")
    ax.set_yticks([0, 1], ["transfer", "kernel step"])
    ax.set_xlabel("ms since the forward began (host clock, rank 0); dotted: backward begins")
    ax.set_title(f"one ring call at CP={result['cp']}: kernel steps (blue fwd, orange bwd)\n"
                 "transfers: green = in flight while the kernel ran, red = waited for", fontsize=9)
