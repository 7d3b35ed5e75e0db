"""``COC_CP_ALGO=auto``: each attention shape's algorithm, chosen at its first call, the same on every rank.

The tuner of ``COC_PARALLEL_NUM=auto`` (coc_inject.tuning.online.Tuner.decide) runs the trials: every
candidate of the layer (ring always; Double-Ring, Ulysses, hybrid and all-gather where the shape
and the configured sub-group sizes allow) forward and backward on detached copies of this call's
q, k, v (no parameter gradient is touched), timings MAX-reduced over the CP group, the noise rule
against the documented fixed choice ``ring`` (Megatron's default ``p2p``), decisions cached in
``COC_TUNE_CACHE`` with the hardware identity. ``COC_DETERMINISTIC=1``: cache only, else ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from coc_inject import job
from coc_inject.context_parallel import attention

BASELINE = "ring"


@dataclass(frozen=True)
class AttentionKey:
    WARM_UPS: ClassVar[int] = 1

    seq: int  # the whole sequence (all CP ranks)
    batch: int
    heads: int  # per tensor-parallel rank
    groups: int
    dim: int
    dtype: str
    causal: bool
    cp: int
    tp: int
    device: str
    backward: bool
    kernel: str  # the attention kernel the trials ran (coc_inject.attention_kernels)

    def text(self) -> str:
        return (f"attention seq {self.seq} batch {self.batch} heads {self.heads}/{self.groups} dim {self.dim} "
                f"{self.dtype} {'causal' if self.causal else 'no mask'} CP{self.cp} TP{self.tp} {self.device}"
                + ("" if self.backward else " forward-only") + f" {self.kernel}")

    def cache_fields(self) -> list:
        return ["attention", self.seq, self.batch, self.heads, self.groups, self.dim, self.dtype, self.causal,
                self.cp, self.tp, self.device, self.backward, self.kernel]

    def name(self, choice) -> str:
        return choice

    candidate = name


def choose(tuner, plan, query, key, value, causal: bool, tp: int, kernel):
    """The variant of ``plan`` for this call's shape (trials at the shape's first call, on ``kernel``)."""
    s, b, heads, d = query.shape
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    decision_key = AttentionKey(s * plan.cp_size, b, heads, key.shape[2], d, str(query.dtype).replace("torch.", ""),
                                causal, plan.cp_size, tp, query.device.type, backward,
                                kernel.name)
    by_name = {variant.describe(): variant for variant in plan.variants}

    def trial(name):
        inputs = [t.detach().clone().requires_grad_(backward) for t in (query, key, value)]
        with torch.enable_grad() if backward else torch.no_grad():
            out = attention.run(plan, by_name[name], *inputs, causal, kernel)
            if backward:
                torch.autograd.grad(out, inputs, torch.ones_like(out))

    name = tuner.decide(decision_key, plan.cp_group, query.device, list(by_name), BASELINE, trial, group_name="CP")
    return by_name[name]


def decisions() -> dict:
    """COC_CP_ALGO=auto's decisions of this process so far: {AttentionKey: Decision}."""
    installation = job.current()
    return dict(installation.decisions(job.ATTENTION)) if installation is not None else {}
