"""Attention masks as Megatron's local attention applies them, for the attention wing and the
sequence copies alike.

Megatron's ``FusedScaleMaskSoftmax`` on a layer of mask type causal takes its fused kernel where it
can (fp16/bf16 with ``masked_softmax_fusion``, ``16 < sk <= 4096``, ...) and that kernel ignores the
mask tensor given: the call is causal whatever the mask says. Elsewhere it applies the given mask.
So :func:`megatron_ignores_mask` decides from shapes and settings alone (no read of the mask), and
only where Megatron applies the mask does :func:`classify` read it: once per mask tensor, one
device-to-host read, cached by the tensor's identity and version -- never its address (Megatron-LM
makes a fresh mask each micro-batch and the allocator hands the same address to the next one).
"""

from __future__ import annotations

import weakref

import torch

from coc_inject.context_parallel import layout

CAUSAL, NONE, GENERAL = "causal", "none", "general"  # GENERAL: hides every later position and more
SEES_LATER = "an attention mask that lets a position see a later one"

_verdicts: dict = {}  # id(mask) -> (weakref, version, {(q_ids, chunk_len, seq): kind})


def megatron_ignores_mask(core, batch: int, seq: int) -> bool:
    """Whether Megatron's softmax, on this layer's scores for the whole sequence (``[batch, heads
    of this TP rank, seq, seq]``), takes its fused causal kernel, which ignores the mask tensor."""
    softmax = getattr(core, "scale_mask_softmax", None)
    if getattr(getattr(softmax, "attn_mask_type", None), "name", "") != "causal" \
            or getattr(softmax, "window_size", None) is not None:
        return False
    heads = getattr(core, "num_attention_heads_per_partition", None)
    try:
        return heads is not None and bool(softmax.is_kernel_available(None, batch, heads, seq, seq))
    except ImportError:  # no fused softmax extension: Megatron's own call would fail alike
        return False


def classify(mask: torch.Tensor, q_ids, chunk_len: int, seq: int) -> str:
    """CAUSAL (exactly the causal mask), NONE (hides nothing), GENERAL (hides every later position
    and more: padding, documents) or SEES_LATER, for a
    ``[b|1, 1, rows, seq]`` mask whose rows are the positions of the chunks ``q_ids`` (Megatron's
    layout, ``chunk_len`` rows each). Read once per mask tensor and version."""
    key = (tuple(q_ids), chunk_len, seq)
    found = _verdicts.get(id(mask))
    if found is not None and found[0]() is mask and found[1] == mask._version and key in found[2]:
        return found[2][key]
    hidden = mask.bool()
    q_pos = torch.tensor(layout.global_positions(q_ids, chunk_len), device=mask.device)[:, None]
    k_pos = torch.arange(seq, device=mask.device)[None, :]
    later = (k_pos > q_pos).expand_as(hidden)
    flags = torch.stack([(hidden == later).all(), ~hidden.any(), (~hidden & later).any()])
    causal, nothing, sees_later = _read(flags)
    kind = CAUSAL if causal else NONE if nothing else SEES_LATER if sees_later else GENERAL
    if found is None or found[0]() is not mask or found[1] != mask._version:
        if len(_verdicts) > 64:
            _verdicts.clear()
        ident = id(mask)
        found = _verdicts[ident] = (weakref.ref(mask, lambda _, ident=ident: _verdicts.pop(ident, None)),
                                    mask._version, {})
    found[2][key] = kind
    return kind


def _read(flags: torch.Tensor) -> list:
    """The one device-to-host read of a mask's classification (tests count these)."""
    return flags.tolist()
