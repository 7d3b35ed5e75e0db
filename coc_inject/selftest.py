"""Hardware self-test: every available CoC backend against the unfused result, on your devices.

    torchrun --nproc-per-node K -m coc_inject.selftest [--shape M K N] [--dtype bfloat16]
    coc-inject selftest            (no torchrun: 2 local CPU ranks over gloo)

For each backend and case it runs the CoC op and the unfused reference (matmul, then the
collective, as Megatron does it) on the same inputs and prints, on rank 0, the largest
relative error (max |Δ| / max |reference|, over all ranks) and the median time of both.
Backends that cannot run here are listed with the reason. This version ships the chunked
pipeline and the fused backends of coc_inject.fused (Ascend ATB lcoc, torch_npu MC2, CUDA
symmetric memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from coc_inject.bench.ranks import free_port, run_local_ranks, torchrun_device

CASES = ("matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul", "w8a16_matmul_all_reduce")
FUSED_CASES = ("matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul")


def _sync(device):
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _timed(fn, device, reps):
    times, result = [], None
    for _ in range(reps):
        _sync(device)
        begin = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - begin)
    return result, 1e3 * statistics.median(times)


def _cases(m, k, n, dtype, device, group):
    """(name, coc function, unfused reference function) per case, on this rank's inputs."""
    import torch
    import torch.distributed as dist

    from coc_inject import ops

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


def run_rank(args, device, group) -> list | None:
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, args.dtype)
    m, k, n = args.shape
    from coc_inject.fused import registry

    rows, skipped = [], []

    def record(backend, name, actual, expected, coc_ms, ref_ms):
        stats = torch.tensor([(actual.double() - expected.double()).abs().max().item(),
                              expected.double().abs().max().item()], device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
        rows.append((backend, name, (stats[0] / stats[1]).item(), coc_ms, ref_ms))

    with torch.no_grad():
        fused_inputs, weight, cases = _cases(m, k, n, dtype, device, group)
        for name, (coc, reference) in cases.items():
            expected, ref_ms = _timed(reference, device, args.reps)
            for chunks in args.chunks:
                actual, coc_ms = _timed(lambda: coc(chunks), device, args.reps)
                record(f"chunked N={chunks}", name, actual, expected, coc_ms, ref_ms)
            backends = registry.BACKENDS.values() if name in FUSED_CASES else ()
            for backend in backends:
                x = fused_inputs[name]
                why = backend.unsupported(name, x, weight, group)
                if why is not None:
                    skipped.append((backend.name, name, why))
                    continue
                actual, coc_ms = _timed(lambda: backend.run(name, x, weight, group)[0], device, args.reps)
                record(f"fused {backend.name}", name, actual, expected, coc_ms, ref_ms)
    return (rows, skipped) if dist.get_rank() == 0 else None


def format_table(rows, skipped, header) -> str:
    lines = [header, f"{'backend':<16} {'case':<26} {'max rel err':>11} {'CoC ms':>9} {'unfused ms':>10}"]
    lines += [f"{b:<16} {c:<26} {e:11.2e} {t:9.2f} {r:10.2f}" for b, c, e, t, r in rows]
    lines += [f"fused {b:<10} {c:<26} not run: {why}" for b, c, why in skipped]
    return "\n".join(lines)


def _local_rank(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return run_rank(args, torch.device("cpu"), dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="coc-inject selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", nargs=3, type=int, default=[512, 256, 256], metavar=("M", "K", "N"))
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on accelerators, float32 on CPU")
    parser.add_argument("--chunks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if "RANK" in os.environ:  # under torchrun: this rank's accelerator
        import torch.distributed as dist

        device, backend = torchrun_device("COC_SELFTEST_DEVICE")
        args.dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
        dist.init_process_group(backend)
        rows = run_rank(args, device, dist.group.WORLD)
        where = f"torchrun, {dist.get_world_size()} ranks on {device.type} ({backend})"
        dist.destroy_process_group()
    else:
        args.dtype = args.dtype or "float32"
        try:
            rows = run_local_ranks(_local_rank, 2, free_port(), args)
        except RuntimeError as error:
            print(f"coc-inject selftest failed:\n{error}", file=sys.stderr)
            return 1
        where = "2 local CPU ranks (gloo)"
    if rows is None:
        return 0
    rows, skipped = rows
    m, k, n = args.shape
    print(format_table(rows, skipped, f"coc-inject selftest: {where}; [M,K]x[K,N] = [{m},{k}]x[{k},{n}] {args.dtype}"))
    bound = 1e-5 if args.dtype == "float32" else 2.0**-6
    worst = max(row[2] for row in rows)
    print(f"{'PASS' if worst <= bound else 'FAIL'}: worst relative error {worst:.2e} (bound {bound:.0e})")
    return 0 if worst <= bound else 1


if __name__ == "__main__":
    sys.exit(main())
