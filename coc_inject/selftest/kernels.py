"""The attention kernels: the block kernel each (device, dtype, head dim) chooses -- what context
parallelism and COC_FLASH_ATTN run -- against float64 attention on the same inputs: out, lse, dq,
dk, dv; causal and full; multi-head and grouped-query; head dims 64 and 128; fp32, bf16 and fp16
where the device's kernel takes them. Timed against coc-inject's reference kernel (tiled fp32
torch ops, the fallback) on the same device. Every rank checks its own device."""

from __future__ import annotations

import math

from coc_inject.selftest.common import relative_error, row, skipped, timed

WING = "attention-kernels"
DTYPES = ("float32", "bfloat16", "float16")
HEAD_DIMS = (64, 128)
HEADS, SEQ, BATCH = 4, 256, 1
LAYOUTS = {"mha": HEADS, "gqa": HEADS // 2}  # key/value heads


def _truth(q, k, v, dout, scale: float, causal: bool):
    """float64 attention on the CPU: out, lse, dq, dk, dv (GQA: K/V heads repeated, their gradients summed)."""
    import torch

    q, k, v, dout = (t.detach().cpu().double() for t in (q, k, v, dout))
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    repeat = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(repeat, 1).transpose(-1, -2) * scale
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v.repeat_interleave(repeat, 1)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _inputs(heads, groups, head_dim, dtype, device, rank):
    import torch

    generator = torch.Generator().manual_seed(4321 + rank)
    shapes = [(BATCH, heads, SEQ, head_dim), (BATCH, groups, SEQ, head_dim), (BATCH, groups, SEQ, head_dim),
              (BATCH, heads, SEQ, head_dim)]
    return [torch.randn(shape, generator=generator).to(device=device, dtype=dtype) for shape in shapes]


def run(ctx) -> list:
    import torch

    from coc_inject import attention_kernels
    from coc_inject.attention_kernels import reference

    rows = []
    for dtype in DTYPES:
        for head_dim in HEAD_DIMS:
            choice = attention_kernels.choose(attention_kernels.AUTO, ctx.device.type, ctx.torch_dtype(dtype), head_dim)
            backend = choice.name if choice.fallback_reason is None else f"{choice.name} ({choice.fallback_reason})"
            for layout, groups in LAYOUTS.items():
                for causal in (True, False):
                    case = f"{'causal' if causal else 'full'} {layout} d{head_dim}"
                    ctx.progress(WING, f"{case} {dtype}")
                    try:
                        q, k, v, dout = _inputs(HEADS, groups, head_dim, ctx.torch_dtype(dtype), ctx.device, ctx.rank)
                    except (RuntimeError, TypeError) as error:  # the device has no such dtype
                        rows.append(skipped(WING, case, choice.name, f"{dtype} tensors on {ctx.device.type}: {error}"))
                        continue
                    scale = 1 / math.sqrt(head_dim)

                    def fused(kernel=choice.kernel):
                        out, lse = kernel.forward(q, k, v, scale, causal)
                        return (out, lse, *kernel.backward(dout, q, k, v, out, lse, scale, causal))

                    actual, coc_ms = timed(fused, ctx.device, ctx.reps)
                    _, reference_ms = timed(lambda: fused(reference.KERNEL), ctx.device, ctx.reps)
                    truth = _truth(q, k, v, dout, scale, causal)
                    errors = {name: relative_error(a, t, ctx.group)
                              for name, a, t in zip(("out", "lse", "dq", "dk", "dv"), actual, truth)}
                    rows.append(row(WING, case, backend, errors, dtype, coc_ms, reference_ms))
    return rows
