"""``COC_MOE_OVERLAP=auto``: per MoE layer shape, pieces (and how many chunks per local expert) or
Megatron's dispatcher, decided at the shape's first call and the same on every rank of the EP group.

The shape leaves out the rank's token count: the expert groups span data-parallel ranks, whose
micro-batches may hold other sequence lengths (variable-length fine-tuning), so a per-token-count key
would be new on one rank and known on another, and only the first would run the trials' collectives
(a hang on NCCL). Without it every rank of the group reaches the key's first call at the same call,
the layer's first (#41 item 8); the trials time each rank's own rows.

The tuner of every ``auto`` (coc_inject.tuning.online.Tuner.decide) runs the trials in the experts'
place of that first call: Megatron's dispatch / experts / combine (the baseline) and the pieces at
each chunk count, forward and backward on detached copies of the call's permuted rows, gradients
taken with ``torch.autograd.grad`` inside ``coc_inject.trial.isolated`` so that no parameter gradient
is touched; timings MAX-reduced
over the expert TP x EP group; pieces win only beyond the noise. Cached in ``COC_TUNE_CACHE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from coc_inject.moe import grouped

MEGATRON = "megatron"  # the baseline candidate: Megatron's dispatcher (a name: the cache keeps counts >= 1)
CHUNKS = (1, 2, 4, 8)  # chunks per local expert tried beside it
ANY_TOKENS = 0  # a key's token count: whatever each rank of the group holds (module docstring)


@dataclass(frozen=True)
class MoEKey:
    WARM_UPS: ClassVar[int] = 1

    tokens: int  # ANY_TOKENS in a job (module docstring); a tune target's tokens in coc-inject tune's rows
    hidden: int
    ffn: int
    topk: int
    experts: int
    ep: int
    dtype: str
    device: str
    backward: bool
    grouped: bool = False  # grouped experts (GroupedMLP): a piece is a chunk of every local expert's rows

    def text(self) -> str:
        tokens = "any tokens" if self.tokens == ANY_TOKENS else self.tokens
        return (f"MoE [{tokens}, {self.hidden}] ffn {self.ffn} top-{self.topk} of {self.experts} "
                f"{'grouped ' if self.grouped else ''}experts EP{self.ep} {self.dtype} {self.device}"
                + ("" if self.backward else " forward-only"))

    def cache_fields(self) -> list:
        fields = ["moe", self.tokens, self.hidden, self.ffn, self.topk, self.experts, self.ep, self.dtype,
                  self.device, self.backward]
        return fields + ["grouped"] if self.grouped else fields  # SequentialMLP's keys as before

    def name(self, choice) -> str:
        if choice == MEGATRON:
            return "Megatron's dispatcher"
        return f"pieces, {choice} chunk(s) of every expert's rows" if self.grouped else f"pieces, {choice} chunk(s) per expert"

    @staticmethod
    def candidate(choice) -> str:
        return "Megatron" if choice == MEGATRON else f"{choice} chunk(s)"


def key_of(layer, hidden_states: torch.Tensor) -> MoEKey:
    config = layer.config
    return MoEKey(ANY_TOKENS, hidden_states.shape[-1],
                  config.moe_ffn_hidden_size or config.ffn_hidden_size, config.moe_router_topk,
                  config.num_moe_experts, layer.token_dispatcher.ep_size,
                  str(hidden_states.dtype).replace("torch.", ""), hidden_states.device.type,
                  torch.is_grad_enabled(), grouped.is_grouped(layer.experts))


def choose(tuner, key: MoEKey, group, tokens, probs, run_megatron, run_pieces, experts):
    """The choice for ``key``: MEGATRON or a chunk count (trials at the key's first call).
    ``run_megatron(tokens, probs)`` / ``run_pieces(tokens, probs, chunks)``: the layer's middle,
    without accumulating parameter gradients; ``experts``: what the trials run (coc_inject.trial:
    fused accumulation off, gradients and RNG left as found)."""
    backward = key.backward

    def trial(choice) -> None:
        inputs = [t.detach().clone().requires_grad_(backward) for t in (tokens, probs)]
        with torch.enable_grad() if backward else torch.no_grad():
            out = run_megatron(*inputs) if choice == MEGATRON else run_pieces(*inputs, choice)
            if backward:
                torch.autograd.grad(out, inputs, torch.ones_like(out))

    return tuner.decide(key, group, tokens.device, [MEGATRON, *CHUNKS], MEGATRON, trial,
                        group_name="EP" if group.size() == key.ep else "expert TPxEP", touches=(experts,))
