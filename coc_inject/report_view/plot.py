"""``coc-inject report --plot PNG``: one step's timeline per rank from COC_TRACE traces, one column
per run (off and on side by side), drawn with matplotlib (an extra: without it, why not).

A run is the trace files of one directory (COC_TRACE writes every rank of a job into one): rows are
ranks, each panel the tracks of that rank's trace (compute and its waits, each group's collectives
in flight), all panels on one time axis, so that the runs' steps compare at a glance.
"""

from __future__ import annotations

import os

from coc_inject.report_view import load

NO_MATPLOTLIB = "matplotlib is not installed (pip install 'coc-inject[bench]'): no PNG written"
COLOURS = {"coc_compute": "#9e9e9e", "coc_wait": "#d62728", "coc_step": None}


def runs(files: list) -> dict:
    """Trace files grouped by directory: {directory: {rank: {step: path}}}."""
    out: dict = {}
    for path in files:
        match = load.TRACE_FILE.search(os.path.basename(path))
        trace = load.trace(path) if match is None else None
        rank, step = (int(match.group(1)), int(match.group(2))) if match else (trace["rank"], trace["step"])
        directory = os.path.dirname(os.path.abspath(path))
        if load.STEP_FOLDER.fullmatch(os.path.basename(directory)):  # a run is the COC_TRACE directory above
            directory = os.path.dirname(directory)
        out.setdefault(directory, {}).setdefault(rank, {})[step] = path
    return out


def chosen(grouped: dict, step) -> list:
    """[(directory, step, {rank: trace})] with ``step`` (or each run's first traced step)."""
    out = []
    for directory, ranks in grouped.items():
        steps = sorted({s for by_step in ranks.values() for s in by_step})
        at = steps[0] if step is None else step
        if at not in steps:
            load.fail(f"--plot: no trace of step {at} in {directory} (traced steps: {', '.join(map(str, steps))})")
        out.append((directory, at, {rank: load.trace(by_step[at]) for rank, by_step in sorted(ranks.items())
                                    if at in by_step}))
    return out


def _draw(axis, trace: dict, longest: float, group_colours: dict) -> None:
    names = list(trace["tracks"])
    for row, name in enumerate(names):
        for begin, end, label, cat in trace["tracks"][name]:
            if cat == "coc_step":
                continue
            colour = COLOURS.get(cat) or group_colours.setdefault(name.split(" #")[0],
                                                                  f"C{len(group_colours) % 10}")
            axis.broken_barh([(begin, max(end - begin, longest * 1e-4))], (row - 0.4, 0.8), color=colour,
                             edgecolor="black" if cat == "coc_collective" else "none", linewidth=0.3)
    axis.set_yticks(range(len(names)), names, fontsize=6)
    axis.set_ylim(len(names) - 0.5, -0.5)
    axis.set_xlim(0, longest * 1.02 or 1.0)
    axis.tick_params(axis="x", labelsize=6)


def write(path: str, files: list, step=None) -> tuple:
    """Draws the traces into ``path``; (what was drawn, why not or None)."""
    columns = chosen(runs(files), step)
    ranks = sorted({rank for _, _, traces in columns for rank in traces})
    drawn = f"{len(columns)} run{'s' if len(columns) != 1 else ''} x {len(ranks)} rank{'s' if len(ranks) != 1 else ''}"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return drawn, NO_MATPLOTLIB
    longest = max(trace["step_ms"] for _, _, traces in columns for trace in traces.values())
    height = max(2.0, sum(1.0 + 0.25 * max((len(t[2][r]["tracks"]) for t in columns if r in t[2]), default=1)
                          for r in ranks))
    figure, axes = plt.subplots(len(ranks), len(columns), figsize=(6.0 * len(columns), height), squeeze=False)
    group_colours: dict = {}
    for column, (directory, at, traces) in enumerate(columns):
        for row, rank in enumerate(ranks):
            axis = axes[row][column]
            if rank not in traces:
                axis.text(0.5, 0.5, f"no trace of rank {rank}", ha="center", va="center", transform=axis.transAxes)
                axis.set_axis_off()
                continue
            trace = traces[rank]
            _draw(axis, trace, longest, group_colours)
            axis.set_title(f"{os.path.basename(directory) or directory}: rank {rank}, step {at}, "
                           f"{trace['step_ms']:.1f} ms", fontsize=7)
            if row == len(ranks) - 1:
                axis.set_xlabel("ms from the step's begin (grey: compute, red: waits; bars: collectives in flight)",
                                fontsize=6)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=120)
    except OSError as error:  # a missing directory, no permission: one line, not matplotlib's traceback
        load.fail(f"--plot {path}: cannot write the PNG there ({error.strerror or error})")
    finally:
        plt.close(figure)
    return drawn, None
