"""What the coverage says: the first-step summary line, its warnings and the COC_REPORT schema.

Pure text and data from a :class:`~coc_inject.coverage.Coverage`'s counts, model view and
decisions; when it is said or written is :mod:`coc_inject.coverage.ending`'s business.
"""

from __future__ import annotations

import os

from coc_inject import log, megatron_version, mindspeed, patches
from coc_inject.routes import (AUTO_CHOSE_MEGATRON, COPIES_CHOSE_DISPATCHER, COPIES_CHOSE_MEGATRON, AttentionRoute, Chunked, CopiesRoute, Fused,
                               MegatronPath, MoERoute, copies_of, inner_of)

REPORT_VERSION = 1


def _attention_kind(route: AttentionRoute) -> str:
    if route.megatron_instead:
        return f"{route.algorithm} for: {route.reason}"
    return (f"{route.algorithm}, CP={route.cp_size}, " if route.cp_size > 1 else "") + f"kernel {route.kernel}"


def attention_summary(coverage) -> str | None:
    """"context parallelism on 2 attention layers (ring, CP=2, kernel cpu-flash): 4 calls" and/or
    "fused attention on 2 layers (kernel cpu-flash): 4 calls" (COC_FLASH_ATTN), None without such calls."""
    parts = []
    for title, at_cp1 in (("context parallelism on {} attention layers", False), ("fused attention on {} layers",
                                                                                  True)):
        layers, calls, kinds = 0, 0, set()
        for record in coverage.all_records():
            mine = {route: n for route, n in record.routes.items()
                    if isinstance(route, AttentionRoute) and (route.cp_size == 1) == at_cp1}
            layers += bool(mine)
            calls += sum(mine.values())
            kinds.update(_attention_kind(route) for route in mine)
        if layers:
            parts.append(f"{title.format(layers)} ({'; '.join(sorted(kinds))}): {calls} calls")
    return "; ".join(parts) or None


def copies_summary(coverage) -> str | None:
    """"multi-copy 2 on 4 layers (2 blocks): 6 calls", and the calls without copies with why;
    None without block calls."""
    routes = coverage.routes_of(CopiesRoute)
    if not routes:
        return None
    blocks: dict = {}
    for record in coverage.all_records():
        for route in record.routes:
            if isinstance(route, CopiesRoute) and route.copies > 1:
                blocks[record.layer] = route.layers
    copied = sorted({route.copies for route in routes if route.copies > 1})
    parts = []
    if copied:
        calls = sum(n for route, n in routes.items() if route.copies > 1)
        splits: dict = {}
        for route, n in routes.items():
            if route.copies > 1:
                splits[route.split or "batch"] = splits.get(route.split or "batch", 0) + n
        parts.append(f"multi-copy {'/'.join(map(str, copied))} on {sum(blocks.values())} layers "
                     f"({len(blocks)} block{'s' if len(blocks) != 1 else ''}): {calls} calls ("
                     + ", ".join(f"{kind} split {n}" for kind, n in sorted(splits.items())) + ")")
    in_turn: dict = {}
    for route, n in routes.items():
        if route.backward_in_turn is not None:
            in_turn[route.backward_in_turn] = in_turn.get(route.backward_in_turn, 0) + n
    if in_turn:
        parts.append("backward in turn for: " + "; ".join(f"{why} ({n} calls)" for why, n in in_turn.items()))
    without = {route.reason: n for route, n in routes.items() if route.copies == 1}
    if without:
        parts.append("no copies for: " + "; ".join(f"{why} ({n} calls)" for why, n in without.items()))
    return "; ".join(parts)


def moe_summary(coverage) -> str | None:
    """"MoE pieces on 2 layers (4 pieces): 6 calls", and the calls on Megatron's dispatcher with why;
    None without MoE calls."""
    routes = coverage.routes_of(MoERoute)
    if not routes:
        return None
    parts = []
    pieced = {route: n for route, n in routes.items() if route.pieces}
    if pieced:
        layers = sum(1 for record in coverage.all_records() if any(isinstance(r, MoERoute) and r.pieces
                                                                    for r in record.routes))
        counts = "/".join(map(str, sorted({route.pieces for route in pieced})))
        parts.append(f"MoE all-to-alls in pieces on {layers} layers ({counts} pieces): {sum(pieced.values())} calls")
    without = {route.reason: n for route, n in routes.items() if not route.pieces}
    if without:
        parts.append("Megatron's MoE dispatcher for: " + "; ".join(f"{why} ({n} calls)" for why, n in without.items()))
    return "; ".join(parts)


def summary_line(coverage) -> str:
    totals = coverage.calls_by_route()
    model = coverage.model
    tp_layers = model.local_layers + sum(model.foreign_layers.values())
    chunked, fused, megatron = totals[Chunked.name], totals[Fused.name], totals[MegatronPath.name]
    routes = [f"{chunked} chunked ({_chunk_counts(coverage)})" if chunked else None,
              f"{fused} fused" if fused else None,
              f"{megatron} Megatron's own" if megatron else None]
    others = "; ".join(part for part in (attention_summary(coverage), copies_summary(coverage), moe_summary(coverage))
                       if part)
    if coverage.config.enabled:
        text = (f"first step: CoC on {coverage.coc_layers()} of {tp_layers} TP linear layers; layer calls: "
                + (", ".join(r for r in routes if r) or "none")) + (f"; {others}" if others else "")
    else:
        idle = ("no attention call ran with context parallelism" if coverage.config.cp_algorithm is not None
                else "no wing patched a layer (measuring only)")
        text = f"first step: {others or idle} (TP linears: CoC off)"
    reasons = coverage.megatron_reasons()
    if reasons:
        text += "; Megatron's path because: " + "; ".join(f"{why} ({n} calls)" for why, n in reasons.items())
    trials = {kind: n for kind, n in coverage.trial_calls_by_route().items() if n}
    if trials:
        text += "; apart from these, auto's trials: " + ", ".join(f"{n} {kind}" for kind, n in trials.items())
    # What each wing left to MindSpeed (its layers run MindSpeed's code), unless a counted call said it already.
    aside = [line for lines in mindspeed.said.values() for line in lines if line.split(": ", 1)[1] not in text]
    if aside:
        text += "; beside MindSpeed: " + "; ".join(aside)
    return text


def beside_mindspeed() -> dict:
    """{wing: the lines it said stepping aside for MindSpeed's replacements} (coc_inject.mindspeed)."""
    return {wing: list(lines) for wing, lines in mindspeed.said.items()}


def _why_idle(wing: str, otherwise: str) -> str:
    """The parenthesis of a "no call ran through the wing" warning: MindSpeed's replacement where the wing
    stepped aside for one (the likely reason), else ``otherwise``."""
    lines = mindspeed.said.get(wing)
    return f" (beside MindSpeed: {'; '.join(line.split(': ', 1)[1] for line in lines)})" if lines else otherwise


def warnings(coverage) -> list:
    config, model = coverage.config, coverage.model
    lines = []
    if model.foreign_layers:
        counts = ", ".join(f"{n} {name}" for name, n in sorted(model.foreign_layers.items()))
        lines.append(f"the model has tensor-parallel linears of Transformer Engine classes ({counts}) that "
                     "CoC does not see: CoC covers Megatron's local layers (--transformer-impl local); "
                     "Transformer Engine has its own overlap (--tp-comm-overlap)")
    totals = coverage.calls_by_route()
    reasons = coverage.megatron_reasons()
    auto_stepped_aside = bool(reasons) and all(reason.startswith(AUTO_CHOSE_MEGATRON) or reason == COPIES_CHOSE_MEGATRON
                                               for reason in reasons)
    if config.cp_algo is not None and not totals[AttentionRoute.name]:
        lines.append(f"COC_CP_ALGO={config.cp_algo} but no attention call ran with context parallelism "
                     "during the first step" + _why_idle(mindspeed.ATTENTION, " (context_parallel_size 1, or no "
                                                                             "local DotProductAttention)"))
    fused_at_cp1 = any(route.fused_at_cp1 for route in coverage.routes_of(AttentionRoute))
    # sequence copies run their attention over parts through the fused kernel themselves (meeting.py)
    sequence_copies = any(route.split == "sequence" for route in coverage.routes_of(CopiesRoute))
    if config.flash_attn and not config.disabled and not fused_at_cp1 and not sequence_copies:
        lines.append("COC_FLASH_ATTN=1 but no attention call ran the fused kernel at CP = 1 during the first step"
                     + _why_idle(mindspeed.ATTENTION, " (no local DotProductAttention built with CP = 1, or "
                                                      "Megatron's path for every call: see the warnings above)"))
    copies = coverage.routes_of(CopiesRoute)
    if config.multi_copy_armed and not any(route.copies > 1 or route.reason.startswith("auto:") for route in copies):
        lines.append(f"COC_MULTI_COPY={config.describe()['multi_copy']} but no TransformerBlock call ran as copies "
                     "during the first step" + _why_idle(mindspeed.MULTI_COPY, " (see the reasons above)" if copies
                                                         else " (no TransformerBlock was called)"))
    moe = coverage.routes_of(MoERoute)
    stepped_aside = ("auto:", COPIES_CHOSE_DISPATCHER)  # on purpose, by a trial
    if config.moe_armed and not any(route.pieces or route.reason.startswith(stepped_aside) for route in moe):
        lines.append(f"COC_MOE_OVERLAP={config.moe_overlap} but no MoE layer call ran its all-to-alls in pieces "
                     "during the first step" + _why_idle(mindspeed.MOE, " (see the reasons above)" if moe
                                                         else " (no MoELayer was called)"))
    if config.enabled and totals[Chunked.name] + totals[Fused.name] == 0 and not auto_stepped_aside:
        lines.append("CoC is on but no layer call went through it during the first step"
                     + _why_idle(mindspeed.LINEARS, " (see the reasons above)" if totals[MegatronPath.name]
                                 else " (no patched layer was called)"))
    for name, origin in sorted(model.replaced.items()):
        lines.append(f"{name}.forward was replaced after coc-inject patched it (now: {origin}): CoC is NOT "
                     f"active for {name}")
    for attribute, row in taken_over(coverage).items():
        if not row["ours_still_runs"]:
            lines.append(f"{attribute} was replaced after coc-inject patched it (now: {row['now']}"
                         + (f", {row['mindspeed']}" if row["mindspeed"] else "") + "): what coc-inject put there "
                         "does NOT run")
    return lines


def taken_over(coverage) -> dict:
    """{"TransformerBlock.forward": {now, ours_still_runs, mindspeed}} of every attribute another patcher set
    after coc-inject's (the linears' forwards are the model view's ``replaced``, said by class above)."""
    rows = {}
    for owner, name, now, still_runs in coverage.taken_over():
        if name == "forward" and owner in coverage.model.patched_forwards:
            continue
        rows[patches.attribute_name(owner, name)] = {
            "now": patches.object_name(now), "ours_still_runs": still_runs,
            "mindspeed": mindspeed.feature_of(now) if mindspeed.is_mindspeed(now) else None}
    return dict(sorted(rows.items()))


def _layer_entry(record, route, calls: int) -> dict:
    """One row of the report's "layers" (or "trials"): a layer and one of its routes."""
    shape = record.shape_for(route)  # the route's first call: the shape its reason names
    if isinstance(route, CopiesRoute):
        return {"name": record.name or record.cls, "class": record.cls, "shape": shape, "route": route.name,
                "copies": route.copies, "layers": route.layers, "chunks": None, "backend": None,
                "reason": route.reason, "backward_in_turn": route.backward_in_turn, "split": route.split,
                "calls": calls}
    if isinstance(route, MoERoute):
        return {"name": record.name or record.cls, "class": record.cls, "shape": shape, "route": route.name,
                "pieces": route.pieces, "chunks": route.chunks or None, "backend": None, "reason": route.reason,
                "calls": calls}
    if isinstance(route, AttentionRoute):
        return {"name": record.name or record.cls, "class": record.cls, "shape": shape,
                "route": route.name, "algorithm": route.algorithm, "cp_size": route.cp_size, "chunks": None,
                "backend": None, "kernel": route.kernel, "reason": route.reason, "calls": calls}
    return {
        "name": record.name or f"{record.cls}[{record.shape[1]}x{record.shape[2]}]",
        "class": record.cls, "shape": shape, "route": route.name,
        "chunks": route.chunks if isinstance(route, Chunked) else None,
        "backend": route.backend if isinstance(route, Fused) else None,
        "reason": route.reason if isinstance(route, MegatronPath) else None, "calls": calls,
    }


def report(coverage) -> dict:
    """The COC_REPORT file's content (version REPORT_VERSION)."""
    model, ending = coverage.model, coverage.ending
    return {
        "version": REPORT_VERSION,
        "rank": log.global_rank(),
        "world_size": log.world_size(),
        "pid": os.getpid(),
        "megatron_core": megatron_version.imported().version,
        "config": coverage.config.describe(),
        "first_step_summarized": ending.summarized,
        "ended_by": ending.ended_by,
        "calls": coverage.calls_by_route(),
        "layers": [_layer_entry(record, route, calls)
                   for record in coverage.all_records() for route, calls in record.routes.items()],
        # auto's trials: candidates run on the job's layers at a shape's first call, not the job's calls
        "trial_calls": coverage.trial_calls_by_route(),
        "trials": [_layer_entry(record, route, calls)
                   for record in coverage.trials.all_records() for route, calls in record.routes.items()],
        "local_layers": model.local_layers,
        "foreign_layers": dict(sorted(model.foreign_layers.items())),
        "replaced_forwards": dict(sorted(model.replaced.items())),
        "half_built_modules": dict(sorted(model.half_built.items())),
        "beside_mindspeed": beside_mindspeed(),  # wing -> the lines it said stepping aside for MindSpeed
        "taken_over": taken_over(coverage),  # attributes another patcher set after coc-inject's patch
        "auto_decisions": [
            {"key": key.text(), "case": key.case, "shape": [key.m, key.k, key.n], "dtype": key.dtype,
             "chunks": decision.chunks, "source": decision.source,
             "times_ms": {str(c): round(t, 4) for c, t in decision.times_ms.items()}}
            for key, decision in coverage.decisions().items()],
        "attention_decisions": [
            {"key": key.text(), "algorithm": decision.choice, "source": decision.source,
             "times_ms": {str(c): round(t, 4) for c, t in decision.times_ms.items()}}
            for key, decision in coverage.attention_decisions().items()],
        "multi_copy_decisions": [
            {"key": key.text(), "copies": copies_of(decision.choice), "linears_chunked": inner_of(decision.choice).linears,
             "experts_in_pieces": inner_of(decision.choice).experts,
             "split": key.split, "source": decision.source,
             "times_ms": {str(c): round(t, 4) for c, t in decision.times_ms.items()},
             # the winner timed again against the baseline, the first candidate (multi_copy/auto.CONFIRMED_ABOVE)
             "confirmation_ms": {str(c): round(t, 4) for c, t in (decision.confirmation_ms or {}).items()}}
            for key, decision in coverage.copies_decisions().items()],
        "moe_decisions": [
            {"key": key.text(), "choice": key.name(decision.choice), "chunks": decision.choice,
             "source": decision.source, "times_ms": {key.candidate(c): round(t, 4) for c, t in decision.times_ms.items()}}
            for key, decision in coverage.moe_decisions().items()],
        # COC_MEASURE: exposed communication per wing, collective and layer (coc_inject.measure), else None
        "communication": coverage.communication(),
    }


def _chunk_counts(coverage) -> str:
    counts = sorted({route.chunks for route in coverage.routes_of(Chunked)})
    return "N=" + "/".join(map(str, counts))
