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

from coc_inject.allowlist import check

SEQUENCE, BATCH = "sequence", "batch"
# The block's arguments sequence copies take: the hidden states (cut), the mask (each copy's attention
# reads its rows, meeting.py), the rotary embeddings (each copy's positions).
TAKEN = ("hidden_states", "attention_mask", "rotary_pos_emb")


def reason(block, batch: int, rows: int, copies: int, arguments: dict, seq: int) -> str | None:
    """Why this call cannot run as ``copies`` sequence copies (``rows``: this rank's rows of the
    hidden states, ``seq``: the whole sequence), or None."""
    config = block.config
    why = f"micro-batch {batch} is not divisible by {copies} copies, and sequence copies cannot run: "
    cp = getattr(config, "context_parallel_size", 1) > 1
    refused = check.refusal(config, check.SEQUENCE_COPIES, training=block.training)  # coc_inject/allowlist
    if refused is not None:
        return why + refused
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
    why_kernel = _kernel_reason(arguments.get("hidden_states"), config)
    if why_kernel is not None:
        return why + why_kernel
    if mask is not None:
        kind = mask_kind(block, mask, batch, seq)
        if kind != "causal":
            return why + kind
    return None


def mask_kind(block, mask: torch.Tensor, batch: int, seq: int) -> str:
    """"causal" where the copies' causal attention over parts is exactly Megatron's, else why not.

    Where Megatron's softmax ignores the mask tensor (its fused causal kernel runs for the whole
    sequence's scores) the mask is not read: causal, as Megatron runs it. Elsewhere Megatron applies
    it, and masks.classify reads it once per mask tensor. Only exactly causal runs as copies: any
    other mask would need the copies' attention with that mask applied (a padding or document mask),
    which no kernel over parts here runs exactly, or a later copy's keys."""
    from coc_inject.context_parallel import masks

    cores = [layer.self_attention.core_attention for layer in block.layers]
    if all(masks.megatron_ignores_mask(core, batch, seq) for core in cores):
        return "causal"
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (seq, seq):
        return f"an attention mask of shape {list(mask.shape)} (expected [b|1, 1, {seq}, {seq}])"
    kind = masks.classify(mask, (0,), seq, seq)
    if kind == masks.CAUSAL:
        return "causal"
    if kind == masks.GENERAL:
        return ("a padding or document mask Megatron's softmax applies here (the copies' attention over parts "
                "runs causal blocks only; a non-square score matrix for Megatron's softmax is never an option)")
    if kind == masks.NONE:
        return "an attention mask that hides nothing (a copy would need a later copy's keys)"
    return kind + " (a copy would need a later copy's keys)"


def _kernel_reason(hidden, config) -> str | None:
    """Why the copies' attention has no kernel for this call (COC_ATTN_KERNEL=fused without a fused
    kernel for the device, dtype and head dim), or None: decided before the block runs."""
    from coc_inject import attention_kernels, job

    preference = getattr(getattr(job.current(), "config", None), "attn_kernel", None) or attention_kernels.AUTO
    if hidden is None or preference != attention_kernels.FUSED:
        return None
    head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
    try:
        attention_kernels.choose(preference, hidden.device.type, hidden.dtype, head_dim)
    except attention_kernels.KernelUnavailable as exc:
        return str(exc)
    return None


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
