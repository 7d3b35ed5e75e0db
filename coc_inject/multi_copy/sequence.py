"""Sequence copies: a block call whose micro-batch the copies cannot split (micro-batch 1, or one the
copy count does not divide) splits the sequence instead.

Copy ``c`` of ``n`` holds the global positions ``[c * S / n, (c + 1) * S / n)``: copy 0 the first part.
Everything in a layer but the attention is token-wise and needs nothing but the split; in the
attention a later copy's queries attend to the earlier copies' keys and values (causal), which the
earlier copies computed in an earlier turn (meeting.py). Copy 0 never waits for a later copy, so
the copies take their turns exactly as batch copies do.

Without sequence parallelism every tensor-parallel rank holds the whole sequence: copy ``c`` is its
``c``-th slice. With it, rank ``r`` holds the rows ``[r * S / T, (r + 1) * S / T)``, so copy 0's
positions sit on the first ranks only; one all-to-all over the TP group (:class:`Layout`) hands
each rank the ``r``-th slice of every copy (units of ``S / (n T)`` rows: copy ``c`` on rank ``r`` is
unit ``c T + r``), so that the column linears' all-gather gives each copy its contiguous positions.
The copies' outputs go back the same way at the block's end (and the gradients, both ways, in the
backward): issued by the block's node outside the copies, in one order on every rank.

:func:`reason` says why a block call cannot run as sequence copies exactly.
"""

from __future__ import annotations

import torch

SEQUENCE, BATCH = "sequence", "batch"
# The block's arguments sequence copies take: the hidden states (cut), the mask (each copy's attention
# reads its rows, meeting.py), the rotary embeddings (each copy's positions).
TAKEN = ("hidden_states", "attention_mask", "rotary_pos_emb")

_checked_masks: dict = {}  # id(mask) -> (weakref, version, kind): checked once per mask tensor


def reason(block, batch: int, rows: int, copies: int, arguments: dict, seq: int) -> str | None:
    """Why this call cannot run as ``copies`` sequence copies (``rows``: this rank's rows of the
    hidden states, ``seq``: the whole sequence), or None."""
    config = block.config
    why = f"micro-batch {batch} is not divisible by {copies} copies, and sequence copies cannot run: "
    cp = getattr(config, "context_parallel_size", 1) > 1
    if getattr(config, "recompute_granularity", None) is not None:
        return why + (f"{config.recompute_granularity} recompute (the recomputed attention would not reach the "
                      "earlier copies' keys)")
    if rows % copies:
        return why + f"{rows} rows of the sequence on this rank do not divide by {copies}"
    for layer in block.layers:
        core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
        if type(getattr(layer, "self_attention", None)).__name__ != "SelfAttention" \
                or type(core).__name__ != "DotProductAttention":
            return why + ("a layer whose attention is not Megatron's SelfAttention with the local "
                          f"DotProductAttention ({type(core).__name__})")
        if type(getattr(layer, "cross_attention", None)).__name__ != "IdentityOp":
            return why + "cross-attention"
        for feature, present in (("a sliding window", getattr(config, "window_size", None) is not None),
                                 ("softmax_type " + str(getattr(config, "softmax_type", "vanilla")),
                                  getattr(config, "softmax_type", "vanilla") != "vanilla")):
            if present:
                return why + feature
        if arguments.get("attention_mask") is None and getattr(core.attn_mask_type, "name", "") != "causal":
            return why + (f"attention mask type {getattr(core.attn_mask_type, 'name', '?')} without a mask (a copy "
                          "would need a later copy's keys)")
    for name, value in arguments.items():
        if name in TAKEN or value is None or (name == "extract_layer_indices" and not value):
            continue
        if isinstance(value, torch.Tensor) or not isinstance(value, (bool, int, float, str)):
            return why + f"an argument sequence copies do not split ({name})"
    rotary = arguments.get("rotary_pos_emb")
    if rotary is not None and (not isinstance(rotary, torch.Tensor) or rotary.shape[0] != seq):
        return why + f"rotary embeddings not of one tensor of {seq} rows"
    mask = arguments.get("attention_mask")
    if cp:  # each copy's attention runs the layer's CP algorithm (meeting_cp.py), which checks the mask
        from coc_inject.multi_copy import meeting_cp

        found = meeting_cp.reason(block, copies, arguments, seq)
        return None if found is None else why + found
    if mask is not None:
        kind = mask_kind(mask, seq)
        if kind not in ("causal", "general"):
            return why + kind
    return None


def mask_kind(mask: torch.Tensor, seq: int) -> str:
    """"causal" (exactly Megatron's causal mask), "general" (it hides every later position and more:
    padding), else why not. Reads the mask (a host sync) once per mask tensor."""
    import weakref

    found = _checked_masks.get(id(mask))
    if found is not None and found[0]() is mask and found[1] == mask._version:
        return found[2]
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (seq, seq):
        kind = f"an attention mask of shape {list(mask.shape)} (expected [b|1, 1, {seq}, {seq}])"
    else:
        hidden = mask.bool()
        later = torch.ones(seq, seq, dtype=torch.bool, device=mask.device).triu(1)
        if bool((hidden == later).all()):
            kind = "causal"
        elif bool(hidden[..., later].all()):
            kind = "general"
        else:
            kind = "an attention mask that lets a position see a later one (a copy would need a later copy's keys)"
    if len(_checked_masks) > 64:
        _checked_masks.clear()
    _checked_masks[id(mask)] = (weakref.ref(mask), mask._version, kind)
    return kind


class Layout:
    """Where each copy's rows are: Megatron's layout (this rank's rows of the sequence) to the copies'
    (copy after copy along the sequence dim, each its slice of this rank's part) and back."""

    def __init__(self, copies: int, group=None):
        self.copies, self.group = copies, group  # group: the TP group with sequence parallelism, else None

    def to_copies(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self._exchange(x, *self._units(x, to_copies=True))

    def from_copies(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self._exchange(x, *self._units(x, to_copies=False))

    def _units(self, x, to_copies: bool):
        n, size = self.copies, self.group.size()
        megatron = [[r * n + i for i in range(n)] for r in range(size)]  # rank r's units, in its order
        copies = [[c * size + r for c in range(n)] for r in range(size)]
        return (megatron, copies) if to_copies else (copies, megatron)

    def _exchange(self, x, before: list, after: list):
        import torch.distributed as dist

        rank, size, n = self.group.rank(), self.group.size(), self.copies
        unit = x.shape[0] // n
        owner_before = {g: r for r, units in enumerate(before) for g in units}
        owner_after = {g: r for r, units in enumerate(after) for g in units}
        send = sorted(before[rank], key=lambda g: (owner_after[g], g))
        received = sorted(after[rank], key=lambda g: (owner_before[g], g))
        pieces = [x.narrow(0, before[rank].index(g) * unit, unit) for g in send]
        out = torch.empty_like(x)
        dist.all_to_all_single(out, torch.cat(pieces).contiguous(),
                               [unit * sum(owner_before[g] == r for g in after[rank]) for r in range(size)],
                               [unit * sum(owner_after[g] == r for g in before[rank]) for r in range(size)],
                               group=self.group)
        return torch.cat([out.narrow(0, received.index(g) * unit, unit) for g in after[rank]])


def copy_arguments(arguments: dict, index: int, copies: int) -> dict:
    """Copy ``index``'s rotary embeddings: its positions' rows."""
    rotary = arguments.get("rotary_pos_emb")
    if rotary is None:
        return arguments
    part = rotary.shape[0] // copies
    return dict(arguments, rotary_pos_emb=rotary.narrow(0, index * part, part))
