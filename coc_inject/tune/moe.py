"""``coc-inject tune`` for MoE layer shapes: ``COC_MOE_OVERLAP=auto``'s decisions ahead of a job.

Each shape runs once, forward and backward, through a megatron-core MoE layer (alltoall dispatcher,
SequentialMLP experts) with the MoE wing installed as ``COC_MOE_OVERLAP=auto`` installs it, so the
wing's tuner makes the decision (Megatron's dispatcher or 1, 2, 4, 8 chunks per local expert, MAX over
the EP group) and caches it under the key and hardware identity the job's first call looks up.
Megatron's parallel state gets expert parallelism ``--ep`` (TP 1): an MoE tune runs on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from coc_inject.tuning.cache import TuneCache

SHAPE_ALLOWED = ("moe:TOKENS,HIDDEN,FFN,EXPERTS,TOPK with integers >= 1 (a rank's tokens into the layer, hidden "
                 "size, expert FFN size, all experts, top-k); needs --ep >= 2 dividing EXPERTS")


@dataclass(frozen=True)
class MoETarget:
    """One MoE layer shape of the model."""

    layer: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    topk: int

    def text(self) -> str:
        """As --shape gives it."""
        return f"moe:{self.tokens},{self.hidden},{self.ffn},{self.experts},{self.topk}"


def check_shape(target: MoETarget, ep: int, error) -> None:
    """A --shape fits Megatron at this EP (parser error otherwise)."""
    where = f"--shape {target.text()} is invalid"
    if target.experts % ep:
        error(f"{where}: --ep ({ep}) must divide the experts ({target.experts})")
    if target.topk > target.experts:
        error(f"{where}: top-k {target.topk} is more than the experts ({target.experts})")


def tune_rank(targets, config, dtype, device, ep: int) -> dict:
    """Every rank: each target once, fwd+bwd, through an MoE layer with auto installed. Returns the
    decisions and the hardware identity."""
    import torch  # torch and Megatron only in the ranks: tune's argument errors come without them
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_layer

    from coc_inject import job
    from coc_inject.testbed.cpu import cpu_moe_shims
    from coc_inject.testbed.models import build_moe_layer
    from coc_inject.moe import install
    from coc_inject.tuning.online import hardware_identity

    if device.type == "cpu":
        cpu_moe_shims()
    install.install(config, moe_layer)
    try:
        for target in dict.fromkeys(targets):
            layer = build_moe_layer(target.hidden, target.ffn, target.experts, target.topk, ep, dtype).to(device)
            x = torch.randn(target.tokens, 1, target.hidden, dtype=dtype, device=device, requires_grad=True)
            out, _ = layer(x)
            out.backward(torch.ones_like(out))
        decisions = dict(job.current().decisions(job.MOE))
    finally:
        job.uninstall()
    return {"decisions": decisions,
            "identity": hardware_identity(device, parallel_state.get_expert_model_parallel_group(), "EP")}


def result(plan, measured: dict, entries: dict) -> dict:
    """The MoE part of tune's result: one row per shape, cache warnings."""
    rows = []
    for target in dict.fromkeys(plan.moe):
        found = [(key, d) for key, d in measured["decisions"].items()
                 if (key.hidden, key.ffn, key.experts, key.topk)  # a job's key holds any token count
                 == (target.hidden, target.ffn, target.experts, target.topk) and key.backward]
        if not found:
            raise SystemExit(f"coc-inject tune: the MoE wing made no decision for {target.text()}: the layer ran "
                             "Megatron's dispatcher before tuning (COC_LOG_LEVEL=debug says why)")
        key, decision = found[0]
        entry = entries.get(TuneCache.key(key, measured["identity"]))
        cached_times = entry.get("times_ms", {}) if isinstance(entry, dict) else {}
        times = ({key.candidate(c): t for c, t in decision.times_ms.items()} if decision.times_ms
                 else {key.candidate(int(c) if c.isdigit() else c): t for c, t in cached_times.items()})
        rows.append({"layer": target.layer, "key": key.text(), "chunks": decision.choice,
                     "choice": key.name(decision.choice), "source": decision.source, "times_ms": times,
                     "cached": entry.get("chunks", entry.get("choice")) if isinstance(entry, dict) else None})
    warnings = [f"{row['key']}: the cache holds {row['cached']} for it, not {row['chunks']} (another EP group's "
                "decision, written last, or the cache could not be written)"
                for row in rows if plan.config.tune_cache is not None and row["cached"] != row["chunks"]]
    return {"rows": rows, "warnings": warnings, "cache": plan.config.tune_cache, "identity": measured["identity"]}


def format_table(rows) -> str:
    table = [["layer", "decision key", "choice", "source", "ms per candidate"]]
    for row in rows:
        times = ", ".join(f"{name} {t:.3f}" for name, t in row["times_ms"].items()) or "-"
        table.append([row["layer"], row["key"], row["choice"], row["source"], times])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table)
