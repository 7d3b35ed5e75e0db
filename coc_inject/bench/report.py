"""Bench figures from raw per-repetition times, for every case: medians, per-repetition ratios to the
first variant, C (the compute-only twin), M (communication), the pipelining limit max(C, M) and the
share of it reached, exposed communication hidden; a table, JSON and a PNG.

Ratios are medians of per-repetition ratios (reference / variant, > 1: faster), never ratios of
medians: the variants of one repetition ran side by side, so a slow moment of the machine cancels.
Pipelining can at best hide the smaller of C and M: a variant's "of limit" is max(C, M) / its time;
"hidden" is the share of M (the reference's time minus C: its exposed communication) it no longer shows.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

COMPUTE_ONLY = "compute-only"
NO_MATPLOTLIB = "matplotlib is not installed (pip install 'coc-inject[bench]'): no PNG written"


def median_ms(samples) -> float:
    return 1e3 * statistics.median(samples)


def median_ratio(reference, samples) -> float:
    return statistics.median(r / t for r, t in zip(reference, samples))


def totals(times: dict) -> list:
    """Per repetition forward + backward of ``{pass: [seconds]}`` (or its one fwd_bwd pass)."""
    if "fwd_bwd" in times:
        return times["fwd_bwd"]
    return [f + b for f, b in zip(times["forward"], times["backward"])]


def overlap(samples: dict) -> dict:
    """``samples``: ``{variant: [seconds per repetition]}``, the reference first (Megatron as it is),
    the compute-only twin under COMPUTE_ONLY. C, M, the limit and per variant: ms, vs the reference,
    share of the limit reached, exposed communication and the share of M hidden."""
    medians = {name: median_ms(row) for name, row in samples.items()}
    compute = medians.pop(COMPUTE_ONLY)
    reference = next(iter(medians))
    comm = max(medians[reference] - compute, 0.0)
    limit = max(compute, comm)
    rows = {name: {"ms": ms, "vs_megatron": median_ratio(samples[reference], samples[name]), "of_limit": limit / ms,
                   "exposed_ms": ms - compute, "hidden": 1 - (ms - compute) / comm if comm > 0 else None}
            for name, ms in medians.items()}
    return {"compute_ms": compute, "comm_ms": comm, "limit_ms": limit, "rows": rows}


def format_overlap(case: dict, title: str, note: str = "") -> str:
    lines = [f"{title}: C {case['compute_ms']:.1f} ms, M {case['comm_ms']:.1f} ms, limit max(C, M) "
             f"{case['limit_ms']:.1f} ms{note}"]
    for name, row in case["rows"].items():
        hidden = "" if row["hidden"] is None else f"  hides {100 * row['hidden']:.0f}% of M"
        lines.append(f"  {name:13s} {row['ms']:9.1f} ms  {row['vs_megatron']:.3f}x  {100 * row['of_limit']:5.1f}% of "
                     f"limit  exposed {row['exposed_ms']:.1f} ms{hidden}")
    return "\n".join(lines)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def write_png(path: Path, panels: list, title: str, size=(4.5, 4.2), widths=None) -> str | None:
    """One figure of ``len(panels)`` side-by-side axes, ``panels[i](axis)`` drawing each. Returns why
    not, if it can't (matplotlib is an extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return NO_MATPLOTLIB
    figure, axes = plt.subplots(1, len(panels), figsize=(size[0] * len(panels), size[1]), squeeze=False,
                                gridspec_kw={"width_ratios": widths} if widths else None)
    for axis, draw in zip(axes[0], panels):
        draw(axis)
    figure.suptitle(title, fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def overlap_panel(case: dict, title: str):
    """A panel of :func:`write_png`: each variant's time, the limit max(C, M) and C."""
    def draw(axis):
        names = list(case["rows"])
        axis.bar(range(len(names)), [case["rows"][n]["ms"] for n in names], color=[f"C{i}" for i in range(len(names))])
        axis.axhline(case["limit_ms"], color="black", linestyle=":", label="limit max(C, M)")
        axis.axhline(case["compute_ms"], color="grey", linestyle="--", label="compute only C")
        axis.set_xticks(range(len(names)), names, rotation=30, fontsize=7)
        axis.set_ylabel("ms, forward + backward")
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7)
    return draw


def write(out: Path, name: str, payload: dict, panels: list, title: str, **figure) -> None:
    """``name``.json and ``name``.png into ``out``, and the line saying so."""
    write_json(out / f"{name}.json", payload)
    problem = write_png(out / f"{name}.png", panels, title, **figure)
    print(f"wrote {out / f'{name}.json'}" + (f"; {problem}" if problem else f" and {out / f'{name}.png'}"))
