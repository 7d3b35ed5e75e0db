"""What every wing's self-test case shares: the context it runs in, its timing, its error and its row.

A wing module has ``run(ctx) -> list[dict]``, called on every rank of the self-test's process group
(collectives in the same order on every rank); it returns its rows on rank 0 (other ranks' rows are
ignored). A row is :func:`row` (a case run against the truth) or :func:`skipped` (a case this
device cannot run, and why). Errors are relative: max |actual - truth| / max |truth|, the MAX over
ranks, so every rank has the same row.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

# Bound on the relative error per dtype: fp32 results are exact up to summation order; bf16 and fp16
# keep 8 and 11 mantissa bits (a kernel that rounds per block to the input dtype is still within these).
BOUNDS = {"float64": 1e-9, "float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass
class Context:
    """Where a wing's cases run: ``device`` (this rank's), ``dtype`` (the --dtype, a name), ``reps``
    (timed repetitions), the world group and its size and this rank. ``p2p_via_host``: a device's
    tensors over gloo, which cannot send a CUDA tensor point to point (the process aborts: 'writev ...
    Bad address', seen on an H100: staged_p2p stages those sends through host memory);
    ``shared_device``: more ranks than GPUs, where symmetric memory cannot map one GPU twice."""

    device: object
    dtype: str
    reps: int
    group: object
    world: int
    rank: int
    options: object  # the parsed command line (a wing reads its own options, e.g. --shape)
    shared_device: bool = False  # more ranks than GPUs, over gloo (COC_SELFTEST_DEVICE=cuda-gloo)
    p2p_via_host: bool = False  # a device's tensors over gloo: point-to-point sends staged through the host

    def progress(self, wing: str, case: str) -> None:
        """One line per case as it starts (rank 0), so a slow or hanging case is seen."""
        if self.rank == 0:
            print(f"[selftest] {wing}: {case} ...", file=sys.stderr, flush=True)

    def torch_dtype(self, name: str | None = None):
        import torch

        return getattr(torch, name or self.dtype)


def timed(fn, device, reps: int):
    """(the last result, the median milliseconds of ``reps`` runs), the device synchronised around each."""
    from coc_inject import timer  # torch: only in the ranks

    result, seconds = timer.median(fn, reps, device)
    return result, 1e3 * seconds


def relative_error(actual, truth, group) -> float:
    """max |actual - truth| / max |truth| (each computed in float64 on the CPU), the largest over the
    ranks of ``group``."""
    import torch
    import torch.distributed as dist

    truth = truth.detach().cpu().double()
    difference = (actual.detach().cpu().double() - truth).abs().max()
    # Reduced in fp32 on the rank's device (NCCL and HCCL take no CPU tensors; not every device does fp64).
    stats = torch.stack([difference, truth.abs().max()]).float().to(actual.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    return (stats[0] / stats[1].clamp_min(1e-30)).item()


def max_over_ranks(value: float, group, device) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([float(value)], dtype=torch.float32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.item()


def row(wing: str, case: str, backend: str, errors: dict, dtype: str, coc_ms: float | None = None,
        reference_ms: float | None = None, bound: float | None = None, **detail) -> dict:
    """A case run against the truth: ``errors`` {what: relative error}; passed when every one is within
    ``bound`` (default: the dtype's)."""
    bound = BOUNDS[dtype] if bound is None else bound
    worst = max(errors.values())
    return {"wing": wing, "case": case, "backend": backend, "dtype": dtype, "errors": errors, "error": worst,
            "bound": bound, "passed": bool(worst <= bound), "coc_ms": coc_ms, "reference_ms": reference_ms,
            **detail}


def skipped(wing: str, case: str, backend: str, why: str, missing: str | None = None) -> dict:
    """A case this device cannot run, and why (not a failure). ``missing``: the package whose absence
    stopped it (the verdict names the wing as not checked, and the exit status says so)."""
    return {"wing": wing, "case": case, "backend": backend, "skipped": why,
            **({"missing": missing} if missing else {})}
