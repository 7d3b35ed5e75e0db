"""What ``coc-inject tune`` reports: one result (the decisions per shape with the candidates' times,
what the tune cache holds, warnings, the equivalent fixed settings), printed as tables and lines
for a person, or as JSON with ``--json`` for a program. The text is made from the result, so the
two never say different things."""

from __future__ import annotations

import json
import os
import shlex

from coc_inject.tune import attention as tune_attention, moe as tune_moe
from coc_inject.config import _shape_text
from coc_inject.tuning.cache import TuneCache


def describe_where(plan, threads: int) -> str:
    sizes = f"TP {plan.tp}" + (f", CP {plan.cp}" if plan.cp > 1 else "") + (f", EP {plan.ep}" if plan.ep > 1 else "")
    if "RANK" in os.environ:
        return f"torchrun, {os.environ.get('WORLD_SIZE')} ranks, {sizes}"
    return f"{plan.world} local CPU ranks (gloo), {sizes}, {threads} thread(s)/rank"


def rows_for(targets, decisions: dict, entries: dict, identity: str) -> list:
    """One row per target: its decision (chunks, source), the candidates' times (trials, or as
    cached) and what the cache holds for it."""
    by_shape = {(key.case, key.m, key.k, key.n): (key, decision) for key, decision in decisions.items()}
    rows = []
    for target in targets:
        found = by_shape.get((target.case, *target.shape))
        if found is None:
            raise SystemExit(f"coc-inject tune: the engine made no decision for {target.layer} {target.case} "
                             f"{list(target.shape)}: the call went to Megatron's own forward before tuning "
                             "(COC_LOG_LEVEL=debug says why)")
        key, decision = found
        entry = entries.get(TuneCache.key(key, identity))
        times = ({str(c): t for c, t in decision.times_ms.items()} if decision.times_ms
                 else dict(entry.get("times_ms", {})) if isinstance(entry, dict) else {})
        rows.append({"layer": target.layer, "case": target.case, "shape": list(target.shape),
                     "chunks": decision.chunks, "source": decision.source, "times_ms": times,
                     "noise_ms": decision.noise_ms if decision.times_ms else None,
                     "cached": entry.get("chunks") if isinstance(entry, dict) else None})
    return rows


def customized(rows) -> tuple[dict, dict]:
    """``{"[m, k, n]": N}`` of the rows, and the conflicts: COC_CUSTOMIZED keys have no case, so a
    shape that two cases (e.g. a Column fc1 and a Row fc2 with ffn = TP x hidden) decided
    differently gets "auto" there, {shape: [(case, N), ...]}."""
    decided: dict = {}
    for row in rows:
        decided.setdefault(_shape_text(row["shape"]), {})[row["case"]] = row["chunks"]
    conflicts = {text: sorted(cases.items()) for text, cases in decided.items() if len(set(cases.values())) > 1}
    return ({text: "auto" if text in conflicts else next(iter(cases.values())) for text, cases in decided.items()},
            conflicts)


def format_table(rows, candidates) -> str:
    counts = [1, *candidates]
    header = ["layer", "case", "[m, k, n]", "N", "source", *[f"N={c} ms" for c in counts], "noise ms"]
    table = [header]
    for row in rows:
        times = [row["times_ms"].get(str(c)) for c in counts]
        table.append([row["layer"], row["case"], json.dumps(row["shape"]), str(row["chunks"]), row["source"],
                      *["-" if t is None else f"{t:.3f}" for t in times],
                      "-" if row["noise_ms"] is None else f"{row['noise_ms']:.3f}"])
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    left = 5  # text columns left-aligned, numbers right-aligned
    return "\n".join("  ".join(cell.ljust(w) if i < left and i != 3 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in table)


def _entries(cache) -> dict:
    return TuneCache(cache).entries() if cache is not None else {}


def linears_result(plan, measured: dict) -> dict:
    """The linears' part of the result: rows, cache warnings and COC_CUSTOMIZED."""
    cache = plan.config.tune_cache
    rows = rows_for(plan.targets, measured["decisions"], _entries(cache), measured["identity"])
    warnings = [f"{row['case']} {json.dumps(row['shape'])}: the cache holds "
                f"{'nothing' if row['cached'] is None else 'N=' + str(row['cached'])} for it, not N={row['chunks']} "
                "(another TP group's decision, written last, or the cache could not be written)"
                for row in rows if cache is not None and row["cached"] != row["chunks"]]
    chosen, conflicts = customized(rows)
    warnings += [f"{text} is {' and '.join(f'{case} (N={n})' for case, n in cases)}; a COC_CUSTOMIZED key has no "
                 "case, so it says \"auto\" for this shape: tuned per case at run time (from the tune cache when the "
                 "identity matches)" for text, cases in conflicts.items()]
    return {"candidates": list(plan.config.tune_candidates), "rows": rows, "warnings": warnings, "cache": cache,
            "identity": measured["identity"], "customized": chosen, "conflicts": conflicts,
            "export": f"export COC_CUSTOMIZED={shlex.quote(json.dumps(chosen))}"}


def attention_result(plan, measured: dict) -> dict:
    """The attention's part of the result: rows, cache warnings and the fixed choice (None: the
    shapes chose differently) with its shell lines."""
    cache = plan.config.tune_cache
    rows = tune_attention.rows_for(plan.attention, measured, _entries(cache))
    warnings = [f"{row['key']}: the cache holds {row['cached'] or 'nothing'} for it, not {row['choice']} "
                "(another CP group's decision, written last, or the cache could not be written)"
                for row in rows if cache is not None and row["cached"] != row["choice"]]
    fixed = tune_attention.fixed_settings(rows)
    return {"candidates": list(measured["settings"]), "rows": rows, "warnings": warnings, "cache": cache,
            "identity": measured["identity"], "fixed": fixed,
            "shell": None if fixed is None else tune_attention.shell_lines(fixed)}


def result(plan, measured: dict, where: str) -> dict:
    """Everything tune reports (JSON-able); a part not tuned is None."""
    return {"where": where, "dtype": plan.dtype,
            "linears": linears_result(plan, measured["linears"]) if measured["linears"] is not None else None,
            "attention": attention_result(plan, measured["attention"]) if measured["attention"] is not None else None,
            "moe": (tune_moe.result(plan, measured["moe"], _entries(plan.config.tune_cache))
                    if measured.get("moe") is not None else None),
            "notes": list(plan.notes)}


def _cache_line(part: dict, what: str) -> str:
    if part["cache"] is None:
        return "cache: off (--cache off / COC_TUNE_CACHE=off): nothing was kept"
    return (f"cache: {part['cache']}; identity {part['identity']}: a {what} job with this identity, dtype and these "
            "shapes takes these decisions without trials")


def text(report: dict) -> str:
    """The result as the tables and lines a person reads."""
    lines = []
    where, dtype = report["where"], report["dtype"]
    linears, attention = report["linears"], report["attention"]
    if linears is not None:
        lines += [f"coc-inject tune: {where}, {dtype}; candidates N=1 (Megatron's path), "
                  f"{', '.join(f'N={c}' for c in linears['candidates'])}; ms: fwd+bwd median of the trials, max over "
                  "ranks (source cache: the times cached with the decision)",
                  format_table(linears["rows"], linears["candidates"]),
                  *(f"warning: {warning}" for warning in linears["warnings"]),
                  _cache_line(linears, "COC_PARALLEL_NUM=auto"),
                  "COC_CUSTOMIZED, the same choices for a job without auto ([m, k, n] as the engine keys them):",
                  linears["export"]]
    if attention is not None:
        lines += [f"coc-inject tune, attention (COC_CP_ALGO=auto): {where}, {dtype}; candidates "
                  f"{', '.join(attention['candidates'])} (ring: the baseline); ms: median of the trials (fwd+bwd; "
                  "forward-only keys: fwd), max over the CP group (source cache: the times cached with the decision)",
                  tune_attention.format_table(attention["rows"]),
                  *(f"warning: {warning}" for warning in attention["warnings"]),
                  _cache_line(attention, "COC_CP_ALGO=auto")]
        if attention["fixed"] is None:
            lines.append("the attention shapes chose different algorithms: keep COC_CP_ALGO=auto to run each"
                         + (" (its tune cache holds these decisions)" if attention["cache"] is not None else ""))
        else:
            lines += ["the same choice for a job without auto:", *attention["shell"]]
    moe = report.get("moe")
    if moe is not None:
        lines += [f"coc-inject tune, MoE (COC_MOE_OVERLAP=auto): {where}, {dtype}; candidates Megatron's dispatcher "
                  "(the baseline), 1, 2, 4, 8 chunks per local expert; ms: fwd+bwd median of the trials, max over the EP "
                  "group (source cache: the times cached with the decision)",
                  tune_moe.format_table(moe["rows"]),
                  *(f"warning: {warning}" for warning in moe["warnings"]),
                  _cache_line(moe, "COC_MOE_OVERLAP=auto")]
    lines += [f"note: {note}" for note in report["notes"]]
    return "\n".join(lines)
