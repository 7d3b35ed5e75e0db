"""The CoC linears: every available backend (the chunked pipeline at each --chunks, the fused
kernels of coc_inject.linears.fused: Ascend ATB lcoc, torch_npu MC2, CUDA symmetric memory) against the
unfused result -- the matmul, then the collective, as Megatron does it -- on the same inputs."""

from __future__ import annotations

from coc_inject.selftest.common import relative_error, row, skipped, timed

WING = "linears"
CASES = ("matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul", "w8a16_matmul_all_reduce")
FUSED_CASES = ("matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul")
# The chunked pipeline sums in the same order as the unfused matmul: fp32 is exact to rounding.
BOUNDS = {"float32": 1e-5, "bfloat16": 2.0**-6, "float16": 1e-3}


def _cases(m, k, n, dtype, device, group):
    """(fused inputs, weight, {case: (coc function of a chunk count, unfused reference)}) on this rank."""
    import torch
    import torch.distributed as dist

    from coc_inject.linears import ops

    world, rank = group.size(), dist.get_rank(group)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    weight = torch.randn(n, k, generator=gen).to(device=device, dtype=dtype) / k ** 0.5
    x_shard = x[: m // world]
    int8 = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).to(device)
    scale = (torch.rand(n, generator=gen) * 0.01).to(device=device, dtype=dtype)

    def all_reduced(t):
        dist.all_reduce(t, group=group)
        return t

    def reduce_scattered(t):
        out = torch.empty(t.shape[0] // world, t.shape[1], dtype=t.dtype, device=t.device)
        dist.reduce_scatter_tensor(out, t.contiguous(), group=group)
        return out

    def all_gathered(t):
        out = torch.empty(t.shape[0] * world, t.shape[1], dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out

    dequantized = ops.dequantize_weight(int8, scale, dtype=dtype)
    fused_inputs = {"matmul_all_reduce": x, "matmul_reduce_scatter": x, "all_gather_matmul": x_shard}
    return fused_inputs, weight, {
        "matmul_all_reduce": (lambda c: ops.matmul_all_reduce(x, weight, group, chunks=c),
                              lambda: all_reduced(x @ weight.t())),
        "matmul_reduce_scatter": (lambda c: ops.matmul_reduce_scatter(x, weight, group, chunks=c),
                                  lambda: reduce_scattered(x @ weight.t())),
        "all_gather_matmul": (lambda c: ops.all_gather_matmul(x_shard, weight, group, chunks=c),
                              lambda: all_gathered(x_shard) @ weight.t()),
        "w8a16_matmul_all_reduce": (
            lambda c: ops.matmul_all_reduce(x, int8, group, antiquant_scale=scale, chunks=c),
            lambda: all_reduced(x @ dequantized.t())),
    }


def run(ctx) -> list:
    import torch

    from coc_inject.linears.fused import registry

    m, k, n = ctx.options.shape
    if ctx.world < 2:
        return [skipped(WING, case, "chunked", "one rank: no collective to overlap") for case in CASES]
    rows, bound = [], BOUNDS.get(ctx.dtype)
    with torch.no_grad():
        fused_inputs, weight, cases = _cases(m, k, n, ctx.torch_dtype(), ctx.device, ctx.group)
        for name, (coc, reference) in cases.items():
            ctx.progress(WING, f"{name} [{m},{k}]x[{k},{n}]")
            expected, reference_ms = timed(reference, ctx.device, ctx.reps)
            for chunks in ctx.options.chunks:
                actual, coc_ms = timed(lambda: coc(chunks), ctx.device, ctx.reps)
                rows.append(row(WING, name, f"chunked N={chunks}", {"output": relative_error(actual, expected, ctx.group)},
                                ctx.dtype, coc_ms, reference_ms, bound))
            for backend in registry.BACKENDS.values() if name in FUSED_CASES else ():
                x = fused_inputs[name]
                why = backend.unsupported(name, x, weight, ctx.group)
                if why is None and ctx.shared_device and backend.name == "symm_mem":
                    why = "ranks share one GPU (cuda-gloo): symmetric memory maps one buffer per GPU"
                if why is not None:
                    rows.append(skipped(WING, name, f"fused {backend.name}", why))
                    continue
                actual, coc_ms = timed(lambda: backend.run(name, x, weight, ctx.group)[0], ctx.device, ctx.reps)
                rows.append(row(WING, name, f"fused {backend.name}", {"output": relative_error(actual, expected, ctx.group)},
                                ctx.dtype, coc_ms, reference_ms, bound))
    return rows
