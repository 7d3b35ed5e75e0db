"""Cases for test_wing_agreement.py on 2 gloo ranks (tests/dist_harness.py): a rank's copies or MoE pieces
settings beside another's, at the wing's first call (a TransformerBlock of real megatron-core layers, TP 2;
Megatron's MoE layer, EP 2). Each case returns what the wing said (None: nothing) and how long the call took."""

from __future__ import annotations

import datetime
import time
import types

import torch
import torch.distributed as dist

from coc_inject import job
from coc_inject.config import AUTO, CocConfig
from coc_inject.pipeline import agreement
from tests.context_parallel import cp_gpt_cases
from tests.moe import moe_cases

_state = None  # which of the two modules' parallel states is in place ("block" or "moe")


def _parallel_state(kind: str) -> None:
    """Megatron's parallel state for ``kind``, made afresh when the other kind's is in place (each module
    remembers only its own)."""
    global _state
    if _state != kind:
        cp_gpt_cases._parallel_state_key = moe_cases._state_key = None
    if kind == "block":
        cp_gpt_cases.setup(dist.get_world_size(), 1)
    else:
        moe_cases.setup(2)
    _state = kind


def _checked(call, prefix: str, timeout_s: float, megatron_after, calls: int = 1) -> dict:
    """``call()`` under a short agreement timeout and store keys of ``prefix``'s own (a rank that never
    joined leaves its peers' rounds ahead: no later case may meet them). Where it raised the settings
    error: ``megatron_after()`` (the wing uninstalled) pairs this rank's Megatron collectives with a peer
    that ran Megatron's path. ``calls``: how many calls (the store exchanges made are counted)."""
    held = agreement.AGREEMENT_TIMEOUT, agreement.KEY_PREFIX, agreement._exchange
    exchanges = []
    agreement._exchange = lambda *args: exchanges.append(args[1]) or held[2](*args)
    agreement.AGREEMENT_TIMEOUT = datetime.timedelta(seconds=timeout_s)
    agreement.KEY_PREFIX = f"coc-inject/agreement-test/{prefix}"
    said, begin = None, time.monotonic()
    try:
        try:
            with torch.no_grad():
                for _ in range(calls):
                    call()
        except agreement.ConfigMismatchError as error:
            said = str(error)
        seconds = time.monotonic() - begin
        if said is not None and megatron_after:
            job.uninstall()
            with torch.no_grad():
                call()
    finally:
        agreement.AGREEMENT_TIMEOUT, agreement.KEY_PREFIX, agreement._exchange = held
        job.uninstall()
        agreement.forget()
    return {"said": said, "seconds": seconds, "exchanges": exchanges}


def copies(prefix: str, copies=1, parallel_num: int | None = None, timeout_s: float = 20.0,
           megatron_after: bool = False, calls: int = 1) -> dict:
    """One forward of a TransformerBlock (TP = the world, SP; 4 sequences) with ``copies`` (1: the copies
    not installed; "auto") and ``parallel_num`` (None: the linears not installed)."""
    from megatron.core.transformer import transformer_block

    from coc_inject.linears import install as linears
    from coc_inject.multi_copy import install as copies_install
    from coc_inject.testbed.models import build_block

    _parallel_state("block")
    world = dist.get_world_size()
    sizes = types.SimpleNamespace(layers=1, batch=4, seq=8 * world, heads=world, hidden=8 * world, ffn=16 * world)
    block, hidden, mask = build_block(sizes)
    fields = {"multi_copy": AUTO if copies == "auto" else copies}
    if parallel_num is not None:
        fields["parallel_num"] = parallel_num
    config = CocConfig(**fields)
    if parallel_num is not None:
        linears.install(config)
    if copies != 1:
        copies_install.install(config, transformer_block)
    return _checked(lambda: block(hidden, mask), prefix, timeout_s, megatron_after, calls)


def pieces(prefix: str, moe_overlap: str = "0", timeout_s: float = 20.0, megatron_after: bool = False) -> dict:
    """One forward of Megatron's MoE layer (EP 2, 4 experts top-2) with COC_MOE_OVERLAP=``moe_overlap``
    ("0": the MoE wing not installed)."""
    _parallel_state("moe")
    layer = moe_cases.build_layer()
    x = moe_cases.layer_input("random", 24, 16)
    if moe_overlap != "0":
        moe_cases.setup(2, coc={"moe_overlap": moe_overlap})
    return _checked(lambda: layer(x), prefix, timeout_s, megatron_after)
