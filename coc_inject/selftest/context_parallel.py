"""Context parallelism: each algorithm at CP = the world size (ring, Ulysses, all-gather; Double-Ring
and hybrid where the size allows) in Megatron's CP layout, forward and backward, against one rank's
fused attention on the whole sequence (the kernel this device chooses, on the same inputs): the
output's and the gradients' error, the time of both, and every rank's peak memory (the device
allocator's on GPU / NPU; the process's resident peak on the CPU)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from coc_inject.selftest import staged_p2p
from coc_inject.selftest.common import max_over_ranks, relative_error, row, skipped, timed

WING = "context-parallel"
SHAPE = dict(seq=1024, batch=1, heads=8, kv_groups=4, head_dim=64)


def _whole(kernel, q, k, v, dout, scale):
    """The truth on this rank: the whole causal sequence through the kernel, forward and backward
    ([s, b, heads, d] in and out)."""
    q4, k4, v4, d4 = (t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v, dout))
    out, lse = kernel.forward(q4, k4, v4, scale, True)
    grads = kernel.backward(d4, q4, k4, v4, out, lse, scale, True)
    return [t.permute(2, 0, 1, 3) for t in (out, *grads)]


def run(ctx) -> list:
    import torch

    from coc_inject import attention_kernels
    from coc_inject.context_parallel import layout
    from coc_inject.context_parallel.function import ContextParallelAttention
    from coc_inject.testbed.attention import schedules, variants_for, whole_inputs
    from coc_inject.testbed.memory import peak_memory_mb, reset_peak_memory

    cp, args = ctx.world, SimpleNamespace(dtype=ctx.dtype, **SHAPE)
    if cp < 2:
        return [skipped(WING, "every algorithm", "-", "one rank: CP = 1 has nothing to parallelise")]
    choice = attention_kernels.choose(attention_kernels.AUTO, ctx.device.type, ctx.torch_dtype(), args.head_dim)
    kernel_name = choice.name if choice.fallback_reason is None else f"{choice.name} ({choice.fallback_reason})"
    variants = variants_for(cp, args.heads, args.kv_groups)
    by_name = schedules(cp, variants, args.head_dim)  # new_group is collective: every rank, in one order
    scale = 1 / math.sqrt(args.head_dim)
    whole = [t.to(ctx.device) for t in whole_inputs(args)]
    truth, reference_ms = timed(lambda: _whole(choice.kernel, *whole, scale), ctx.device, ctx.reps)
    rows_here = layout.global_positions(layout.rank_chunks(ctx.rank, cp), args.seq // (2 * cp))
    local = [t[rows_here].contiguous() for t in whole]
    truth = [t[rows_here] for t in truth]
    rows = []
    if args.heads % cp or args.kv_groups % cp:
        rows.append(skipped(WING, f"ulysses CP={cp}", kernel_name, f"heads {args.heads} / key-value groups "
                            f"{args.kv_groups} are not divisible by CP={cp}"))
    if cp < 4:
        rows.append(skipped(WING, f"double-ring, hybrid CP={cp}", kernel_name, "need CP >= 4 (an inner ring or a "
                            "Ulysses degree between 1 and CP)"))
    for variant in variants:
        case = f"{variant.name} CP={cp} seq {args.seq} causal"
        ctx.progress(WING, case)

        def call():
            leaves = [t.clone().requires_grad_(True) for t in local[:3]]
            out = ContextParallelAttention.apply(*leaves, by_name[variant.name], choice.kernel)
            out.backward(local[3])
            return [out, *(leaf.grad for leaf in leaves)]

        reset_peak_memory(ctx.device)
        actual, coc_ms = timed(call, ctx.device, ctx.reps)
        peak = torch.tensor([peak_memory_mb(ctx.device)], dtype=torch.float32, device=ctx.device)
        peaks = [torch.zeros_like(peak) for _ in range(cp)]
        torch.distributed.all_gather(peaks, peak, group=ctx.group)
        errors = {name: relative_error(a, t, ctx.group) for name, a, t in zip(("out", "dq", "dk", "dv"), actual, truth)}
        staged = ctx.p2p_via_host and variant.algorithm in ("ring", "hybrid")  # their blocks travel point to point
        backend = f"{kernel_name}, {staged_p2p.LABEL}" if staged else kernel_name
        rows.append(row(WING, case, backend, errors, ctx.dtype, max_over_ranks(coc_ms, ctx.group, ctx.device),
                        reference_ms, peak_mb=[round(p.item(), 1) for p in peaks]))
    return rows
