"""``COC_MULTI_COPY=auto``: no copies, 2 or 4, per block call shape, decided at its first call and
the same on every rank of the block's tensor- and context-parallel group. With a fixed copy count
and ``COC_PARALLEL_NUM=auto``, the same kind of trials decide whether the copies' tuned linears
chunk or run Megatron's path: where the copies already overlap a linear's collective with the
other copy's compute, CoC's chunks inside them may only add smaller collectives and hand-overs;
which is faster depends on the shape and the network, so it is timed.

The tuner of ``COC_PARALLEL_NUM=auto`` (coc_inject.tuning.online.Tuner.decide) runs the trials: the block
without copies (the baseline: Megatron's forward) and with the candidate copies, forward and
backward on a detached copy of this call's input, gradients taken with ``torch.autograd.grad`` inside
``coc_inject.trial.isolated(block)`` so that no parameter gradient, ``main_grad`` (fused accumulation
is off for the trials) or DDP hook is touched and the RNG is left as found; timings MAX-reduced over
the group; copies win
only beyond the noise, so auto is never slower than off by more than the noise. Megatron's
recompute cannot run under ``autograd.grad``: with recompute on, the trials time the forward only
(the decision says so). Decisions are cached in ``COC_TUNE_CACHE`` with the hardware identity.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from coc_inject.multi_copy import block as copies_block, moe as copies_moe
from coc_inject.routes import AS_SET, Inner, copies_of, inner_of, inside


@dataclass(frozen=True)
class CopiesKey:
    # Two warm-up rounds: a copy count's first runs are slower for a while (its threads' allocator
    # arenas still growing); one such run among the timed ones can hide a real gain in the noise.
    WARM_UPS: ClassVar[int] = 2

    seq: int  # this rank's rows of the hidden states (after SP / CP); 0: any (an MoE block, key_for)
    batch: int
    hidden: int
    layers: int
    dtype: str
    tp: int
    cp: int
    sequence_parallel: bool
    device: str
    backward: bool
    split: str  # what the copies split, "batch" or "sequence": a decision for one is never used for the other
    candidates: tuple  # what the trials choose among (a cached choice is only valid for the same)

    def text(self) -> str:
        return (f"block [{self.seq or 'any'}, {self.batch}, {self.hidden}] x {self.layers} layers {self.dtype} TP{self.tp}"
                + (f" CP{self.cp}" if self.cp > 1 else "") + (" SP" if self.sequence_parallel else "")
                + f" {self.device} {self.split} split" + ("" if self.backward else " forward-only"))

    def cache_fields(self) -> list:
        return ["multi-copy", self.seq, self.batch, self.hidden, self.layers, self.dtype, self.tp, self.cp,
                self.sequence_parallel, self.device, self.backward, self.split, list(self.candidates)]

    def name(self, choice) -> str:
        return "no copies (Megatron's block)" if choice == 1 else self.candidate(choice)

    @staticmethod
    def candidate(choice) -> str:
        return "no copies" if choice == 1 else f"{choice} copies" if isinstance(choice, int) else choice


# COC_MULTI_COPY=auto's copy counts (those that divide the micro-batch): finer turns hide more
# where the network is slow (benchmarks/RESULTS.md, "COC_MULTI_COPY=auto").
AUTO_COPIES = (2, 4)
# Above this many candidates (baseline included) a winner is confirmed in a second round (Tuner.decide): the
# fastest of many noisy trials is flattered by its draw (every wing auto over loopback: 2 copies with
# Megatron's linears won its trials by 3.6% and ran the MoE step 0.92x as fast; benchmarks/RESULTS.md).
CONFIRMED_ABOVE = 3


def candidates(copies: int, copies_auto: bool, linears_auto: bool, rows: int, most: int | None = None,
               experts_auto: bool = False) -> list:
    """What the trials compare, the baseline first. COC_MULTI_COPY=auto: no copies (every other wing as
    set), then 2 and 4 copies (those dividing ``rows``, at ``most`` copies where the split has a limit);
    a fixed count: that count. Each count with every tuned wing inside as it chose, and also with
    Megatron's path instead of each tuned wing (COC_PARALLEL_NUM=auto's linears, COC_MOE_OVERLAP=auto's
    pieces: ``experts_auto``, for a block with MoE layers) and of both: so that with every wing on auto
    the block runs the best of the wings alone and together, never the sum of their costs (#44 item 4)."""
    inners = [AS_SET]
    if linears_auto:
        inners.append(Inner(linears=False))
    if experts_auto:
        inners.append(Inner(experts=False))
    if linears_auto and experts_auto:
        inners.append(Inner(linears=False, experts=False))
    counts = ([n for n in AUTO_COPIES if rows % n == 0 and (most is None or n <= most)] if copies_auto
              else [copies])
    return ([1] if copies_auto else []) + [inside(n, inner) for n in counts for inner in inners]


def split_for(choice, split):
    """The Split a choice runs (None: no copies)."""
    if choice == 1:
        return None
    return replace(split, copies=copies_of(choice), inner=inner_of(choice))


def group_of(block):
    """The group whose collectives the block runs: tensor x context parallel."""
    from megatron.core import parallel_state

    getter = getattr(parallel_state, "get_tensor_and_context_parallel_group", None)
    if getter is not None:
        return getter()
    return parallel_state.get_tensor_model_parallel_group()


def key_for(block, hidden, split, choices: list) -> CopiesKey:
    """What ``block``'s decision for this call is made once for and cached by: its input's shape, the
    block, the group, whether the trials run the backward, the split (batch or sequence) and ``choices``."""
    config = block.config
    recompute = getattr(config, "recompute_granularity", None) is not None
    backward = torch.is_grad_enabled() and hidden.requires_grad and not recompute
    # An MoE block's trials agree over data-parallel ranks too (trial_group), whose micro-batches may
    # hold other sequence lengths: its key leaves the sequence out, so that every rank of the group
    # meets the key's first call at the same call (moe/auto.py's docstring; #41 item 8).
    seq = 0 if copies_moe.moe_layers(block) else hidden.shape[0]
    return CopiesKey(seq, hidden.shape[1], hidden.shape[2], len(block.layers),
                     str(hidden.dtype).replace("torch.", ""), config.tensor_model_parallel_size,
                     getattr(config, "context_parallel_size", 1), bool(config.sequence_parallel),
                     hidden.device.type, backward, split.kind, tuple(choices))


def choose(tuner, block, original, arguments: dict, split, choices: list):
    """This call's Split among ``choices`` (:func:`candidates`), or None for no copies
    (``arguments``: from block.bind; trials at the first call of its shape and split)."""
    hidden = arguments["hidden_states"] if block.pre_process else block.input_tensor
    key = key_for(block, hidden, split, choices)
    backward = key.backward

    def trial(choice):
        params = [p for p in block.parameters() if p.requires_grad]  # in a trial only: not per call
        probe = hidden.detach().clone().requires_grad_(backward)
        trial_arguments = dict(arguments, hidden_states=probe) if block.pre_process else arguments
        held = getattr(block, "input_tensor", None)
        with torch.enable_grad() if backward else torch.no_grad():
            if choice == 1:
                if not block.pre_process:
                    block.input_tensor = probe
                out = original(block, **trial_arguments)
                block.input_tensor = held
            else:
                out = copies_block.run_copies(block, original, trial_arguments, split_for(choice, split),
                                              params_for_grad=True)
            if backward:
                torch.autograd.grad(out, [probe] + params, torch.ones_like(out), allow_unused=True)

    moe_group = copies_moe.trial_group(block)  # an MoE block's all-to-alls reach beyond TP x CP
    with copies_moe.routers_as_found(block):
        # More than two candidates beside the baseline (every wing on auto: each wing inside or Megatron's
        # path): the winner is timed again against the baseline before the block runs it (the winner's curse).
        choice = tuner.decide(key, moe_group or group_of(block), hidden.device, choices, choices[0], trial,
                              group_name="TPxCP" if moe_group is None else "TPxDPxCP", touches=(block,),
                              confirm=len(choices) > CONFIRMED_ABOVE)
    return split_for(choice, split)

