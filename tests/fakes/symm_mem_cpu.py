"""FAKE CPU kernels for ``symm_mem::fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``.

torch only has CUDA kernels for these ops. ``register()`` adds CPU kernels (removed again by
``unregister()``) that check the call contract of docs/dev/fused-backends.md §3 — 2-D A, 2-D B [k, n]
matching A, gather/scatter dim 0, ``reduce_op`` "sum", a live ``group_name``, m divisible by the
group size for reduce-scatter, equal dtypes — and compute the true result with gloo collectives
on that group. NOT a symmetric-memory implementation: no P2P buffers, no CUDA.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

CALLS: list = []
_library = None


def _group(name):
    group = c10d._resolve_process_group(name)
    if group is None:
        raise RuntimeError(f"group_name={name!r} names no process group")
    return group


def _check(A, B, dim):
    if A.dim() != 2 or B.dim() != 2 or B.shape[0] != A.shape[1]:
        raise RuntimeError(f"expected A [m, k] and B [k, n], got {tuple(A.shape)} and {tuple(B.shape)}")
    if dim != 0:
        raise RuntimeError(f"dim={dim}: coc-inject always gathers/scatters rows (dim 0)")
    if A.dtype != B.dtype:
        raise RuntimeError(f"dtypes differ: {A.dtype} / {B.dtype}")


def _opaque_to_autocast(kernel):
    """A device kernel is opaque to torch.autocast: its Python stand-in must not be cast inside."""
    import functools

    @functools.wraps(kernel)
    def run(A, *args, **kwargs):
        with torch.autocast(A.device.type, enabled=False):
            return kernel(A, *args, **kwargs)

    return run


@_opaque_to_autocast
def _all_gather_matmul(A, Bs, gather_dim, group_name, *, return_A=True):
    if len(Bs) != 1:
        raise RuntimeError(f"coc-inject passes one B, got {len(Bs)}")
    _check(A, Bs[0], gather_dim)
    group = _group(group_name)
    gathered = torch.empty(A.shape[0] * group.size(), A.shape[1], dtype=torch.float32)
    dist.all_gather_into_tensor(gathered, A.float().contiguous(), group=group)
    CALLS.append(("fused_all_gather_matmul", tuple(A.shape), tuple(Bs[0].shape), return_A))
    return (gathered.to(A.dtype) if return_A else None), [(gathered @ Bs[0].float()).to(A.dtype)]


@_opaque_to_autocast
def _matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name):
    _check(A, B, scatter_dim)
    if reduce_op != "sum":
        raise RuntimeError(f"reduce_op={reduce_op!r}: coc-inject sums")
    group = _group(group_name)
    if A.shape[0] % group.size():
        raise RuntimeError(f"m={A.shape[0]} must divide by the group size {group.size()}")
    y = A.float() @ B.float()
    out = torch.empty(A.shape[0] // group.size(), y.shape[1])
    dist.reduce_scatter_tensor(out, y, group=group)
    CALLS.append(("fused_matmul_reduce_scatter", tuple(A.shape), tuple(B.shape), None))
    return out.to(A.dtype)


def register():
    global _library
    import torch.distributed._symmetric_memory  # noqa: F401  (defines the symm_mem ops)

    if _library is None:
        _library = torch.library.Library("symm_mem", "IMPL")
        _library.impl("fused_all_gather_matmul", _all_gather_matmul, "CPU")
        _library.impl("fused_matmul_reduce_scatter", _matmul_reduce_scatter, "CPU")
    CALLS.clear()


def unregister():
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
