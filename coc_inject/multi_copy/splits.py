"""Which TransformerBlock calls run as copies, and how one is cut: :func:`plan` (a :class:`Split`,
or why not); the call runs as copies in block.py.

A block call splits its micro-batch along the batch dimension (hidden states ``[s, b, h]`` on dim 1,
with or without sequence parallelism; the mask's and every per-sample input's batch rows with them;
rotary embeddings shared). A micro-batch the copies do not divide (micro-batch 1 above all) splits
the sequence instead (sequence.py: copy 0 the first positions; the copies meet in the attention,
meeting.py). A block or a call that copies cannot run exactly runs Megatron's block with a reason
(:func:`block_reason`, :func:`plan`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from coc_inject.allowlist import check
from coc_inject.multi_copy import recompute, sequence
from coc_inject.multi_copy.sequence import BATCH, SEQUENCE
from coc_inject.routes import AS_SET, Inner

# Per-sample arguments of TransformerBlock.forward and their batch dimension; others are
# shared by every copy when they hold no batch (rotary embeddings) or refused (plan()).
BATCH_DIMS = {"hidden_states": 1, "context": 1, "attention_mask": 0, "context_mask": 0, "padding_mask": 0,
              "attention_bias": 0}
SHARED = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")
# Arguments copies cannot take: inference state and packed sequences (Megatron's path, with the reason).
REFUSED = {"inference_context": "inference", "inference_params": "inference", "sequence_len_offset": "inference",
           "packed_seq_params": "packed sequences (THD)", "extract_layer_indices": "extract_layer_indices",
           "dynamic_inference_decode_only": "inference"}

# What runs Megatron's block instead, in short (coc-inject status; each reason in full: block_reason, plan).
WITHOUT_COPIES = ("a micro-batch not divisible by the copies whose sequence cannot split either (context "
                  "parallelism with COC_CP_ALGO=auto or more than 2 copies, recompute, a mask that lets a position "
                  "see a later one, another attention)",
                  "dropout > 0",
                  "MoE layers with global_aux_loss, a capacity factor, sinkhorn routing, the batch aux_loss under "
                  "Megatron's MoE recompute or a block recompute the copies have not read, or a padding mask",
                  "packed sequences",
                  "selective recompute of mlp, layernorm, moe_act, mla_up_proj",
                  "inference", "fp8 / fp4", "CPU offloading", "CUDA graphs",
                  "a setting the allow-list refuses or does not classify (docs/settings-allowlist.md)",
                  "a torch whose autograd the copies' backward cannot rely on (checked at install)")


@dataclass(frozen=True)
class Split:
    """How one call is cut: along the batch (``kind`` BATCH: which arguments are cut along their batch
    dimension) or the sequence (SEQUENCE: sequence.py), and the copies' sizes along it."""

    copies: int
    rows: int  # this rank's rows along the split: the micro-batch, or the sequence (SP: this rank's part)
    cut: tuple  # BATCH: names of the arguments cut along their batch dimension
    inner: Inner = AS_SET  # what the tuned wings inside the copies run (routes.Inner)
    kind: str = BATCH
    mask: str | None = None  # SEQUENCE: the mask tensor's kind (sequence.mask_kind), None without one
    group: object = field(default=None, compare=False)  # SEQUENCE with SP: the TP group the rows cross
    most: int | None = None  # the most copies this split can run (SEQUENCE with CP > 1: 2), None: any

    @property
    def sizes(self) -> list:
        return [self.rows // self.copies] * self.copies

    @property
    def dim(self) -> int:
        """The hidden states' dim the copies split: the sequence (0) or the batch (1)."""
        return 0 if self.kind == SEQUENCE else 1


def block_reason(block, copies: int) -> str | None:
    """Why ``block`` cannot run as copies at all (whatever the call), or None: its config against
    multi-copy's allow-list (coc_inject/allowlist/multi_copy.py)."""
    return (check.refusal(block.config, check.MULTI_COPY, training=block.training)
            or recompute.reason(block))  # MoE layers: multi_copy/moe.py's block_reason


def plan(block, copies: int, arguments: dict) -> Split | str:
    """The split of one call (``arguments``: forward's arguments by name), or why not."""
    for name, why in REFUSED.items():
        value = arguments.get(name)
        if value is not None and not (name == "extract_layer_indices" and not value):
            return f"{why} ({name} given)"
    hidden = arguments.get("hidden_states")
    if not block.pre_process:
        hidden = block.input_tensor
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        return "the hidden states are not one [s, b, h] tensor"
    batch = hidden.shape[1]
    if batch % copies:
        return _sequence_split(block, copies, arguments, hidden)
    cut = []
    for name, value in arguments.items():
        if name in ("self", "hidden_states") or value is None:
            continue
        dim = BATCH_DIMS.get(name)
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return f"{name} requires grad (its gradient would not reach it through the copies)"
            rows = value.shape[dim] if dim is not None and value.dim() > dim else None
            if rows == batch:
                cut.append(name)
            elif rows not in (None, 1):
                return f"{name} has {rows} rows for micro-batch {batch}"
            elif dim is None and name not in SHARED:
                return f"an argument coc-inject does not know how to split ({name})"
        elif name not in BATCH_DIMS and name not in SHARED and name not in REFUSED and not _plain(value):
            return f"an argument coc-inject does not know how to split ({name})"
    return Split(copies, batch, tuple(cut))


def _sequence_split(block, copies: int, arguments: dict, hidden) -> Split | str:
    """The call's sequence split (sequence.py), or why not."""
    config = block.config
    rows = hidden.shape[0]
    tp = config.tensor_model_parallel_size
    shuffled = bool(config.sequence_parallel) and tp > 1
    seq = rows * tp if shuffled else rows
    why = sequence.reason(block, hidden.shape[1], rows, copies, arguments, seq)
    if why is not None:
        return why
    group = None
    if shuffled:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    mask = arguments.get("attention_mask")
    cp = getattr(config, "context_parallel_size", 1) > 1  # CP: 2 copies at most (meeting_cp.reason)
    # sequence.reason passed the mask: causal as Megatron runs it (read once per mask, or not at all)
    return Split(copies, rows, (), kind=SEQUENCE, group=group, most=2 if cp else None,
                 mask=None if mask is None else "causal")


def _plain(value) -> bool:
    return isinstance(value, (bool, int, float, str, type(None)))


_signatures: dict = {}  # Megatron's block forward -> its signature (a function of Megatron's, not a verdict)


def bind(original, block, args, kwargs) -> dict:
    """forward's arguments by name (``self`` left out), defaults included."""
    signature = _signatures.get(original)
    if signature is None:  # once per forward: inspect.signature is not a per-call cost
        signature = _signatures[original] = inspect.signature(original)
    bound = signature.bind(block, *args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    extra = arguments.pop("kwargs", None)
    if extra:
        arguments.update(extra)
    return arguments
