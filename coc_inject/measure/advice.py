"""What the meter says: one line per measured span of steps, and the warnings of the first one.

A wing that is on and hides less than COC_MEASURE_WARN percent of its communication is warned
about, with what the meter saw that explains it where it can tell: a device whose
``CUDA_DEVICE_MAX_CONNECTIONS`` lets the chunks' collectives start out of order behind compute, a
link so fast that its communication is a sliver of the step, a wing with no communication at all.
"""

from __future__ import annotations

import os

OUR_WINGS = ("linears", "context_parallel", "multi_copy", "moe")
_ON = {"linears": lambda c: c.enabled, "context_parallel": lambda c: c.cp_algo is not None,
       "multi_copy": lambda c: c.multi_copy != 1, "moe": lambda c: c.moe_overlap != "0"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _part(name: str, row: dict) -> str:
    return (f"{name} {_ms(row['exposed_s'])} of {_ms(row['communication_s'])} ms exposed "
            f"({row['hidden_pct']:.0f}% hidden, {row['collectives']} collectives)")


def line(what: str, summary: dict) -> str:
    """``step 1: communication 12.3 of 40.1 ms exposed (69% hidden) in a 210.0 ms step; linears ...``."""
    step = f" in {_ms(summary['step_s'])} ms of steps" if summary.get("step_s") else ""
    wings = sorted(summary["wings"].items(), key=lambda item: -item[1]["communication_s"])
    parts = "; ".join(_part(name, row) for name, row in wings) or "no collective"
    peers = summary["total"].get("peers_s") or 0.0
    waited = f"; {_ms(peers)} ms waiting for slower ranks (not charged to any wing)" if peers >= 5e-4 else ""
    return f"{what}: {_part('communication', summary['total'])}{step}{waited}; {parts}"


def wings_on(config) -> list:
    return [wing for wing in OUR_WINGS if not config.disabled and _ON[wing](config)]


def warnings(config, summary: dict, step) -> list:
    """The wings on that hid less than COC_MEASURE_WARN of their communication in ``summary``;
    ``step``: its step number, or a label of the steps it sums ("steady steps 2-8")."""
    where = f"step {step}" if isinstance(step, int) else step
    threshold = config.measure_warn
    if not threshold:
        return []
    out = []
    step_s = summary.get("step_s") or 0.0
    for wing in wings_on(config):
        row = summary["wings"].get(wing)
        if row is None or row["communication_s"] <= 0:
            out.append(f"COC_MEASURE: {wing} is on but issued no communication of its own in {where} "
                       "(every call went to Megatron's path, or none ran: see the first-step summary)")
            continue
        if row["hidden_pct"] >= threshold:
            continue
        why = []
        connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
        if wing == "linears" and _on_cuda() and connections != "1":
            why.append(f"CUDA_DEVICE_MAX_CONNECTIONS is {connections or 'unset'}: the chunked pipeline needs 1, or a "
                       "chunk's collective may queue behind the next chunk's matmul")
        if step_s and row["communication_s"] < 0.01 * step_s:
            why.append(f"its communication is {100 * row['communication_s'] / step_s:.1f}% of the step: a link this "
                       "fast leaves little to hide")
        out.append(f"COC_MEASURE: {wing} hid {row['hidden_pct']:.0f}% of its communication in {where} "
                   f"({_ms(row['exposed_s'])} of {_ms(row['communication_s'])} ms exposed; COC_MEASURE_WARN="
                   f"{threshold})" + (": " + "; ".join(why) if why else ""))
    return out


def _on_cuda() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
