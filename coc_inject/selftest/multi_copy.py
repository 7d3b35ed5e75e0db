"""Multi-copy: one real megatron-core TransformerBlock (2 layers, TP = the world, sequence parallel)
forward + backward with 2 copies against Megatron's block as it is on the same two halves of the
micro-batch one after another (gradients summed in fp32 as Megatron's DDP keeps main_grad): output,
input gradient and parameter gradients (fixed output gradient), that the block ran as copies, that
every rank issued the same collectives (name, shapes, copy) in the same order; the time of both
(Megatron's on the whole micro-batch). The halves are the truth as a parameter gradient sums over the
batch: in bf16 / fp16 two rounded halves differ from one rounded whole by up to the dtype's bound,
whoever computes them; against the halves the copies are exact in every dtype.

Sequence copies: the same block at micro-batch 1 (the copies split the sequence, copy 0 the first positions;
the copies meet in the attention) against Megatron's block on the whole micro-batch (a sequence cannot run
in halves one after another), the same errors, and that the copies ran a sequence split.

MoE copies: the same block with MoE MLPs (testbed.models.moe_settings: alltoall dispatcher, EP = the world, expert
TP 1, Megatron's default batch ``aux_loss``, which the copies combine exactly) at micro-batch 2 against Megatron's
block on the whole micro-batch (the batch aux loss of two halves is not the whole's), the same errors (the router's
gradient carries the aux loss's), and that the copies ran a batch split through every MoE layer.

First, on one rank or many: this torch's autograd runs the copies' backward as it assumes
(multi_copy/autograd_check.py, the check install makes; where it fails, every block runs Megatron's)."""

from __future__ import annotations

from coc_inject.selftest import common
from coc_inject.selftest.megatron_cases import against_megatron, main_grads, run_case

WING = "multi-copy"
COPIES, LAYERS, BATCH = 2, 2, 2  # the batch splits into the copies


AUTOGRAD_CASE = "autograd runs the copies' backward"
SEQUENCE = "micro-batch 1"  # the sequence copies' backend ends so
MOE = "MoE aux_loss"  # the MoE block's backend ends so


def run(ctx) -> list[dict]:
    block = f"TransformerBlock x{LAYERS} TP={ctx.world} SP"
    rows = [_autograd(ctx)]
    for backend in (f"{COPIES} copies", f"{COPIES} copies, {SEQUENCE}"):
        rows += run_case(ctx, WING, block, backend, "no tensor-parallel collectives to overlap", _case,
                         tensor_model_parallel_size=ctx.world)
    rows += run_case(ctx, WING, f"MoE block x{LAYERS} TP={ctx.world} SP EP={ctx.world}", f"{COPIES} copies, {MOE}",
                     "no expert parallelism to overlap", _case, tensor_model_parallel_size=ctx.world,
                     expert_model_parallel_size=ctx.world, expert_tensor_parallel_size=1)
    return rows


def _autograd(ctx) -> dict:
    """The install's check of torch's autograd (node renumbering, the ready queue's order, the running
    node): 0 when it behaves as the copies' backward assumes on every rank, else 1 and the reason."""
    import torch

    from coc_inject.multi_copy import autograd_check

    ctx.progress(WING, AUTOGRAD_CASE)
    why = autograd_check.reason()
    failed = common.max_over_ranks(float(why is not None), ctx.group, ctx.device)
    return common.row(WING, AUTOGRAD_CASE, f"torch {torch.__version__}", {"autograd order": failed}, ctx.dtype,
                      bound=0.0, **({} if why is None else {"why_not_copies": why}))


def _case(ctx, case, backend) -> dict:
    import types

    import torch
    from megatron.core.transformer import transformer_block

    from coc_inject.testbed.models import build_block
    from coc_inject.config import CocConfig
    from coc_inject.multi_copy import forward as copies_forward, install as copies, moe as copies_moe

    dtype = ctx.torch_dtype()
    heads = 2 * ctx.world  # TP = the world divides the heads, the hidden and the FFN sizes
    sizes = types.SimpleNamespace(layers=LAYERS, batch=BATCH, seq=32 * ctx.world, heads=heads, hidden=16 * heads,
                                  ffn=32 * heads)
    sequence, sizes.moe = backend.endswith(SEQUENCE), backend.endswith(MOE)
    sizes.moe_aux_coeff = 1.0  # the aux loss's share of the router's gradient large: a copy's own loss shows
    # build_block also seeds torch and Megatron's RNG tracker
    block, hidden, mask = build_block(sizes, micro_batch=1 if sequence else BATCH, shims=ctx.device.type == "cpu")
    block.to(device=ctx.device, dtype=dtype)
    hidden, mask = hidden.to(ctx.device, dtype), mask.to(ctx.device)
    grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(7 + ctx.rank)).to(ctx.device, dtype)

    grads = main_grads(block)
    # Sequence copies hand each rank other rows of the sequence (the copies' layout), so a parameter that
    # sequence parallelism replicates over TP (norms, row-parallel biases) gets another share of its gradient
    # on each rank: compared as Megatron's finalize_model_grads forms it, summed over the TP group.
    summed = sorted(name for name, p in block.named_parameters() if sequence and getattr(p, "sequence_parallel", 0))

    def step(cut=1):  # cut: the micro-batch's parts through the block one after another
        grads.clear()
        parts = []
        for part, part_grad in zip(hidden.chunk(cut, dim=1), grad.chunk(cut, dim=1)):
            x = part.clone().requires_grad_(True)
            out = block(x, mask)
            out.backward(part_grad)
            parts.append((out.detach(), x.grad))
        for name in summed:
            torch.distributed.all_reduce(grads[name], group=ctx.group)
        return torch.cat([out for out, _ in parts], 1), torch.cat([g for _, g in parts], 1), dict(grads)

    config = CocConfig(multi_copy=COPIES)
    errors, times, calls, route = against_megatron(ctx, step, lambda: copies.install(config, transformer_block),
                                                   lambda: copies_forward.last_route(block),
                                                   truth_step=None if sequence or sizes.moe else lambda: step(COPIES),
                                                   order=_routed_rows_apart)
    ran = route is not None and route.copies == COPIES and route.split == ("sequence" if sequence else "batch")
    ran = ran and len(copies_moe.moe_layers(block)) == (LAYERS if sizes.moe else 0)
    errors["copies ran"] = common.max_over_ranks(float(not ran), ctx.group, ctx.device)
    return common.row(WING, case, backend, errors, ctx.dtype, *times, collectives=len(calls),
                      **({} if ran else {"why_not_copies": getattr(route, "reason", "no block call counted")}))


def _routed_rows_apart(calls: list) -> list:
    """The calls compared over the ranks with an all-to-all's shapes left out (its rows are the routing's,
    different per rank by design)."""
    return [(name, None if name == "all_to_all_single" else shapes, copy) for name, shapes, copy in calls]
