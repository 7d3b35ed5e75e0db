"""#44 item 6 on a device: the weight gradient into an fp32 ``main_grad`` from bf16/fp16 operands.

For each dtype and shape (m tokens, n outputs, k inputs), three ways of ``main_grad += gradᵀ @ input``:
- ``chosen``: ``coc_inject.pipeline.wgrad.into_main_grad``, as CoC's linears call it;
- ``upcast``: the code before 6a30474, ``main_grad.addmm_(grad.t().float(), input.float())``;
- ``unfused``: Megatron with ``gradient_accumulation_fusion`` off, a half-precision weight gradient
  that DDP's hook then adds to ``main_grad``.
It reports the way chosen; the aten ops the chosen call runs with their operand dtypes (a dispatch
mode: the GEMM must see its operands in their own dtype, nothing copied to fp32); each way's error
against float64; that the chosen call makes no host sync (``torch.cuda.set_sync_debug_mode``); the
memory each way takes beyond its operands; medians of CUDA-event times with the ways interleaved.
Exits 1 when a check fails. ``--device cpu --small`` is the dry run on this repository's CPU machine.
"""
import argparse
import json
import statistics
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from coc_inject import timer
from coc_inject.pipeline import wgrad


class OpLog(TorchDispatchMode):
    """Every aten op run inside, with the dtypes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtypes = [str(a.dtype).replace("torch.", "") for a in list(args) + list(kwargs.values())
                  if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), dtypes))
        return func(*args, **kwargs)


def ways(grad, inp):
    def chosen(accum):
        wgrad.into_main_grad(accum, grad, inp)

    def upcast(accum):
        accum.addmm_(grad.t().float(), inp.float())

    def unfused(accum):
        accum.add_(grad.t() @ inp)
    return {"chosen": chosen, "upcast": upcast, "unfused": unfused}


def event_ms(fn, accum, reps, device):
    """ms per call of ``reps`` back-to-back calls: the device's events on CUDA (no process group here for
    timer.Timer's barrier), else coc_inject.timer's wall clock."""
    if device.type != "cuda":
        return timer.seconds(lambda: [fn(accum) for _ in range(reps)])[1] * 1e3 / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(accum)
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps


def one_case(m, n, k, dtype, device, rounds, reps):
    gen = torch.Generator(device="cpu").manual_seed(m + n + k)
    grad = torch.randn(m, n, generator=gen).to(device, dtype)
    inp = torch.randn(m, k, generator=gen).to(device, dtype)
    accum0 = torch.randn(n, k, generator=gen).to(device, torch.float32)
    truth = accum0.double() + grad.double().t() @ inp.double()
    row = {"shape": [m, n, k], "dtype": str(dtype).replace("torch.", ""),
           "way": wgrad.choose(device.type, dtype, dtype, torch.float32, wgrad.megatron_kernel(), False)}
    fns = ways(grad, inp)
    for name, fn in fns.items():
        accum = accum0.clone()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        fn(accum)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            row[f"{name}_extra_mib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        row[f"{name}_rel_err"] = ((accum.double() - truth).abs().max() / truth.abs().max()).item()
    log, accum = OpLog(), accum0.clone()
    with log:
        fns["chosen"](accum)
    row["chosen_ops"] = log.ops
    row["to_fp32_copies"] = [op for op, dt in log.ops if "_to_copy" in op or "aten.to" in op]
    gemm = [dt for op, dt in log.ops if any(g in op for g in ("addmm", "mm", "matmul", "wgrad"))]
    row["gemm_operand_dtypes"] = gemm
    if device.type == "cuda":
        accum = accum0.clone()
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            fns["chosen"](accum)
            row["host_sync"] = "none"
        except RuntimeError as error:
            row["host_sync"] = str(error).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    times = {name: [] for name in fns}
    warm_up, timed = timer.schedule(list(fns), rounds)  # each timed round rotated by one
    for name in warm_up:
        event_ms(fns[name], accum0.clone(), 2, device)
    for name in timed:
        times[name].append(event_ms(fns[name], accum0.clone(), reps, device))
    for name in fns:
        row[f"{name}_ms"] = statistics.median(times[name])
    row["upcast_over_chosen"] = row["upcast_ms"] / row["chosen_ms"]
    row["unfused_over_chosen"] = row["unfused_ms"] / row["chosen_ms"]
    return row


def checks(row, device):
    """What must hold: errors within fp32 accumulation of half-precision products; on a device with
    the mixed kernel, operands in their own dtype (no fp32 copy) and no host sync."""
    failed = []
    if row["chosen_rel_err"] > 1e-4:
        failed.append(f"chosen error {row['chosen_rel_err']:.2e} > 1e-4")
    if row["way"] in (wgrad.MIXED, wgrad.KERNEL):
        if row["to_fp32_copies"]:
            failed.append(f"copies before the GEMM: {row['to_fp32_copies']}")
        if not row["gemm_operand_dtypes"] or any(dt.count(row["dtype"]) != 2 for dt in row["gemm_operand_dtypes"]):
            failed.append(f"GEMM operands {row['gemm_operand_dtypes']}")
    elif device.type == "cuda" and wgrad.torch_mixed_addmm("cuda", getattr(torch, row["dtype"]), torch.float32):
        failed.append(f"way {row['way']!r} on cuda where torch's mixed-dtype addmm runs")
    if device.type == "cuda" and row.get("host_sync") != "none":
        failed.append(f"host sync: {row.get('host_sync')}")
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="small shapes (the CPU dry run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    shapes = [(256, 128, 64), (128, 96, 160)] if args.small else [
        (4096, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336)]
    rows, failed = [], []
    for dtype in (torch.bfloat16, torch.float16):
        for m, n, k in shapes:
            row = one_case(m, n, k, dtype, device, args.rounds, args.reps)
            row["failed"] = checks(row, device)
            failed += row["failed"]
            rows.append(row)
            print(f"{row['dtype']} {m}x{n}x{k}: way={row['way']!r} chosen {row['chosen_ms']:.3f} ms, upcast "
                  f"{row['upcast_ms']:.3f} ({row['upcast_over_chosen']:.2f}x), unfused {row['unfused_ms']:.3f} "
                  f"({row['unfused_over_chosen']:.2f}x); rel err chosen {row['chosen_rel_err']:.1e} upcast "
                  f"{row['upcast_rel_err']:.1e} unfused {row['unfused_rel_err']:.1e}; extra MiB "
                  f"{row.get('chosen_extra_mib', float('nan')):.0f}/{row.get('upcast_extra_mib', float('nan')):.0f}/"
                  f"{row.get('unfused_extra_mib', float('nan')):.0f}; ops {[op for op, _ in row['chosen_ops']]} "
                  f"{row['gemm_operand_dtypes']}; host sync {row.get('host_sync', '-')}; failed {row['failed']}",
                  flush=True)
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)
    print("WGRAD CHECK", "PASS" if not failed else f"FAIL {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
