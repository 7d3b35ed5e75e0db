"""`make demo`'s exposed communication: every link run measures itself (``COC_MEASURE=1``, off too), and the
demo ends with one table per link part: each variant's step time, the communication its rank 0 issued and
waited for per step (from its COC_REPORT, the steps after the warm-up), the share of it hidden per wing, and
its share of the pipelining limit max(C, M) of the whole GPT step: C from the script's compute-only twin
(examples/compute_only.py, run once beside the part's runs), M = off's exposed communication as the meter
saw it, beside M = off's step - C (the two agree when the meter misses nothing).
"""

import json
import statistics
from pathlib import Path

from demo_runs import first_steady, steady
from launch import ROOT, clean_env, torchrun

TWIN = ROOT / "examples" / "compute_only.py"
_PARTS: list = []  # (title, {variant: [the meter's figures per run]}, {variant: median step ms}, C ms or None)


def measuring(workdir, link, steps, script_args):
    """demo_runs.variant_runs' ``measured``: the part's results kept, and its compute-only twin run once."""

    def measured(title, results):
        given = {name: [r for r in runs if "report" in r] for name, runs in results.items()}
        record(title, given, twin(workdir, link, steps, script_args, f"twin-{id(given)}"), steps)

    return measured


def twin(workdir, link, steps, script_args, name) -> dict:
    """The compute-only twin's run (its step times: C)."""
    print("== compute-only twin: the same command, every floating-point collective a no-op", flush=True)
    out = Path(workdir) / f"{name}.json"
    proc = torchrun(TWIN, ["--steps", str(steps), "--json", str(out), *script_args], clean_env(), workdir, link)
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        raise SystemExit(f"demo: the compute-only twin failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def record(title: str, runs: dict, twin_result: dict | None, steps: int) -> None:
    """A link part's runs ({variant: [results, each with its rank 0 "report"]}) for the closing tables: the
    meter's figures are read now (the reports live in the part's temporary directory)."""
    runs = {name: results for name, results in runs.items() if results}
    figures = {name: [per_step(r["report"], steps) for r in results] for name, results in runs.items()}
    medians = {name: 1e3 * statistics.median(steady(r) for r in results) for name, results in runs.items()}
    _PARTS.append((title, figures, medians, twin_result and 1e3 * steady(twin_result)))


def per_step(report_path: Path, steps: int) -> dict:
    """The meter's figures per step after the warm-up (rank 0): total and per wing, in ms."""
    communication = json.loads(Path(report_path).read_text())["communication"]
    rows = [row for row in communication["per_step"] if row["step"] >= first_steady(steps)]
    if not rows:
        raise SystemExit(f"demo: {report_path} has no measured step after the warm-up")

    def mean(pick):
        return 1e3 * statistics.mean(pick(row) for row in rows)

    wings = {wing for row in rows for wing in row["wings"]}
    return {"exposed": mean(lambda r: r["total"]["exposed_s"]), "issued": mean(lambda r: r["total"]["communication_s"]),
            "peers": mean(lambda r: r["total"].get("peers_s", 0.0)),  # waiting for slower ranks (not exposed)
            "wings": {wing: (mean(lambda r: r["wings"].get(wing, {}).get("exposed_s", 0.0)),
                             mean(lambda r: r["wings"].get(wing, {}).get("communication_s", 0.0))) for wing in wings}}


def _hidden(exposed: float, issued: float) -> str:
    return f"{100 * max(0.0, issued - exposed) / issued:3.0f}%" if issued > 0 else "  - "


def print_tables() -> None:
    """The tables of the parts recorded since the last call."""
    parts = list(_PARTS)
    _PARTS.clear()
    if not parts:
        return
    print("\n### Exposed communication per wing, the link runs (COC_MEASURE=1 on rank 0, per step after the warm-up)")
    for title, figures, medians, c in parts:
        print(f"\n{title}")
        summary = {name: {key: statistics.median(f[key] for f in fs) for key in ("exposed", "issued", "peers")}
                   for name, fs in figures.items()}
        limit = None
        if c is not None and "off" in medians:
            # off - C holds every wait, the wait for slower ranks too: the meter's exposed time plus that wait
            m_meter, peers, m_step = summary["off"]["exposed"], summary["off"]["peers"], medians["off"] - c
            limit = max(c, m_meter)
            agree = (m_meter + peers) / m_step if m_step > 0 else float("nan")
            print(f"  C (compute-only twin) {c:.1f} ms; M = off's exposed communication {m_meter:.1f} ms (meter; "
                  f"+ {peers:.1f} ms waiting for slower ranks) / {m_step:.1f} ms (off - C): (meter + wait) / (off - C) "
                  f"= {agree:.3f}; limit max(C, M) {limit:.1f} ms")
        print(f"  {'variant':<44} {'step ms':>8} {'issued':>8} {'exposed':>8} {'hidden':>6}"
              + (f" {'of limit':>8}" if limit else "") + "  per wing: exposed of issued ms (hidden)")
        for name, fs in figures.items():
            wings = {}
            for f in fs:
                for wing, (exposed, issued) in f["wings"].items():
                    wings.setdefault(wing, []).append((exposed, issued))
            parts = ", ".join(f"{wing} {statistics.median(e for e, _ in v):.1f} of {statistics.median(i for _, i in v):.1f}"
                              f" ({_hidden(statistics.median(e for e, _ in v), statistics.median(i for _, i in v)).strip()})"
                              for wing, v in sorted(wings.items(), key=lambda kv: -max(i for _, i in kv[1])))
            row = summary[name]
            print(f"  {name:<44} {medians[name]:8.1f} {row['issued']:8.1f} {row['exposed']:8.1f} "
                  f"{_hidden(row['exposed'], row['issued']):>6}" + (f" {100 * limit / medians[name]:7.1f}%" if limit else "")
                  + f"  {parts}")
