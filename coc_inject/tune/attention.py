"""``coc-inject tune`` for attention shapes: ``COC_CP_ALGO=auto``'s decisions ahead of a job.

Each shape runs once, forward and backward, through Megatron's local ``DotProductAttention``
with coc-inject's context parallelism installed as ``COC_CP_ALGO=auto`` installs it (the job's
``COC_CP_WINDOW`` / ``COC_CP_ULYSSES_DEGREE`` / ``COC_CP_MASK_TYPE`` shape the candidates and
the mask, as in the job), so the engine's tuner makes the decision and caches it under the same
key and hardware identity (device or host, world size, CP size, backend) that the job's first
call looks up. Megatron's model parallel state is initialised with the job's TP and CP sizes.
With selective recompute of the core attention (``--recompute-activations``) a job's first call
runs without autograd (inside the checkpoint's forward): that forward-only key is decided too.
"""

from __future__ import annotations

from dataclasses import dataclass

from coc_inject.tuning.cache import TuneCache

SHAPE_ALLOWED = ("attention:SEQ,BATCH,HEADS,GROUPS,DIM with integers >= 1 (the whole sequence, micro-batch, the "
                 "model's attention heads and key/value groups, head dim); needs --cp >= 2")


@dataclass(frozen=True)
class AttentionTarget:
    """One core-attention shape of the model (heads and groups over all TP ranks)."""

    layer: str
    seq: int
    batch: int
    heads: int
    groups: int
    dim: int
    causal: bool = True

    def text(self) -> str:
        """As --shape gives it."""
        return f"attention:{self.seq},{self.batch},{self.heads},{self.groups},{self.dim}"


def model_target(args) -> AttentionTarget:
    """The GPT layer's core attention for the model dimensions (checked by tune.model_targets;
    head dim = hidden / heads, Megatron's default kv_channels; another head dim: --shape)."""
    return AttentionTarget("core_attention", args.seq, args.micro_batch, args.heads,
                           args.num_query_groups or args.heads, args.hidden // args.heads)


def check_shape(target: AttentionTarget, tp: int, cp: int, error) -> None:
    """A --shape fits Megatron at this TP and CP (parser error otherwise)."""
    where = f"--shape {target.text()} is invalid"
    if target.heads % target.groups:
        error(f"{where}: {target.groups} key/value groups do not divide {target.heads} heads")
    if target.heads % tp or target.groups % tp:
        error(f"{where}: heads ({target.heads}) and key/value groups ({target.groups}) must be multiples of --tp "
              f"({tp})")
    if target.seq % (2 * cp):
        error(f"{where}: the sequence {target.seq} is not a multiple of 2 x --cp ({2 * cp}): Megatron's layout "
              "cuts it into 2*CP equal chunks")


def tune_rank(targets, config, dtype, device, tp: int, cp: int, forward_only_too: bool) -> dict:
    """Every rank: each target once, fwd+bwd (and forward alone without autograd when
    ``forward_only_too``), through Megatron's attention with auto installed. Returns the
    decisions, the hardware identity and the candidates' settings."""
    import torch  # torch and Megatron only in the ranks: tune's argument errors come without them
    from megatron.core import parallel_state
    from megatron.core.transformer import dot_product_attention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coc_inject.context_parallel import auto, groups, install
    from coc_inject.tuning.online import hardware_identity

    groups.make_configured(config.cp_ulysses_degree, parallel_state)
    install.install(config, dot_product_attention)
    settings = {}
    try:
        for target in dict.fromkeys(targets):
            megatron_config = TransformerConfig(
                num_layers=1, hidden_size=target.heads * target.dim, num_attention_heads=target.heads,
                num_query_groups=target.groups, kv_channels=target.dim, tensor_model_parallel_size=tp,
                context_parallel_size=cp, attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype,
                bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
            layer = dot_product_attention.DotProductAttention(
                config=megatron_config, layer_number=1,
                attn_mask_type=AttnMaskType.causal if target.causal else AttnMaskType.no_mask, attention_type="self")
            settings.update({variant.describe(): variant.settings() for variant in layer._coc_cp.variants})
            rows = target.seq // cp
            q = torch.randn(rows, target.batch, target.heads // tp, target.dim, dtype=dtype, device=device)
            k, v = (torch.randn(rows, target.batch, target.groups // tp, target.dim, dtype=dtype, device=device)
                    for _ in range(2))
            if forward_only_too:
                with torch.no_grad():
                    layer(q, k, v, None)
            inputs = [t.requires_grad_(True) for t in (q, k, v)]
            out = layer(*inputs, None)
            out.backward(torch.ones_like(out))
        decisions = auto.decisions()
    finally:
        install.uninstall()
        groups.release()
    return {"decisions": decisions, "settings": settings,
            "identity": hardware_identity(device, parallel_state.get_context_parallel_group(), "CP")}


def rows_for(targets, measured: dict, entries: dict) -> list:
    """One row per decision key of each target (with backward, and forward-only where tuned): its
    decision, the candidates' times (trials, or as cached), what the cache holds for it."""
    rows = []
    for target in dict.fromkeys(targets):
        for key, decision in _decisions_of(target, measured["decisions"]):
            entry = entries.get(TuneCache.key(key, measured["identity"]))
            times = (dict(decision.times_ms) if decision.times_ms
                     else dict(entry.get("times_ms", {})) if isinstance(entry, dict) else {})
            rows.append({"layer": target.layer, "key": key.text(), "choice": decision.choice,
                         "source": decision.source, "times_ms": times,
                         "noise_ms": decision.noise_ms if decision.times_ms else None,
                         "cached": entry.get("choice") if isinstance(entry, dict) else None,
                         "settings": measured["settings"][decision.choice]})
    return rows


def _decisions_of(target, decisions: dict) -> list:
    """The (key, decision) pairs of ``target``'s dimensions (heads per TP rank), with backward first."""
    found = [(key, decision) for key, decision in decisions.items()
             if (key.seq, key.batch, key.heads * key.tp, key.groups * key.tp, key.dim)
             == (target.seq, target.batch, target.heads, target.groups, target.dim)]
    if not found:
        raise SystemExit(f"coc-inject tune: the engine made no decision for {target.text()}: the call went to "
                         "Megatron's own attention before tuning (COC_LOG_LEVEL=debug says why)")
    return sorted(found, key=lambda pair: not pair[0].backward)


def format_table(rows) -> str:
    table = [["layer", "decision key", "algorithm", "source", "ms per candidate", "noise ms"]]
    for row in rows:
        times = ", ".join(f"{name} {t:.3f}" for name, t in row["times_ms"].items()) or "-"
        table.append([row["layer"], row["key"], row["choice"], row["source"], times,
                      "-" if row["noise_ms"] is None else f"{row['noise_ms']:.3f}"])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table)


def fixed_settings(rows) -> dict | None:
    """The COC_CP_* settings of the one algorithm every row chose (None: the rows differ)."""
    chosen = {tuple(sorted(row["settings"].items())) for row in rows}
    return dict(chosen.pop()) if len(chosen) == 1 else None


def shell_lines(settings: dict) -> list:
    """``export``/``unset`` lines that set exactly ``settings`` (None: unset)."""
    exports = " ".join(f"{name}={value}" for name, value in settings.items() if value is not None)
    unset = " ".join(name for name, value in settings.items() if value is None)
    return [f"export {exports}"] + ([f"unset {unset}"] if unset else [])
