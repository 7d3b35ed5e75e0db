"""CUDA symmetric-memory fused ops (torch >= 2.5): ``torch.ops.symm_mem.fused_all_gather_matmul``
and ``fused_matmul_reduce_scatter``.

Contract (docs/dev/fused-backends.md §3): registered by ``import torch.distributed._symmetric_memory``
(which also imports on CPU-only builds, so usability is decided by whether the op has a kernel
for the tensors' device: CUDA only in torch); ``A [m, k]``, ``B [k, n]`` (our ``weight.t()``),
gather/scatter dim 0 (never -1), ``group.group_name``; ``fused_all_gather_matmul(A, [B], 0, name,
return_A=True) -> (A_gathered, [A_gathered @ B])``; ``fused_matmul_reduce_scatter(A, B, "sum", 0,
name)`` needs m divisible by the group size. There is no fused matmul + all-reduce. The peers
must share one NVLink domain (symmetric memory is peer-to-peer).

Not verified on CUDA hardware: tested with a fake CPU kernel registered for these ops that checks
this contract (tests/fakes/symm_mem_cpu.py).
"""

from __future__ import annotations

import importlib

import torch

OPS = {"matmul_reduce_scatter": "fused_matmul_reduce_scatter", "all_gather_matmul": "fused_all_gather_matmul"}
DISPATCH_KEYS = {"cuda": "CUDA", "cpu": "CPU"}
ARGUMENTS = {"fused_all_gather_matmul": ("A", "Bs", "gather_dim", "group_name", "return_A"),  # return_A: torch 2.6+
             "fused_matmul_reduce_scatter": ("A", "B", "reduce_op", "scatter_dim", "group_name")}


class SymmMemBackend:
    name = "symm_mem"
    module = "torch.distributed._symmetric_memory"

    def __init__(self):
        self._library = None

    def unavailable(self) -> str | None:
        if self._library is None:
            try:
                self._library = importlib.import_module(self.module)  # registers the symm_mem ops
            except Exception as error:
                return f"importing {self.module} failed: {type(error).__name__}: {error}"
        cuda = torch.cuda.is_available() and any(self._has_kernel(op, "CUDA") for op in OPS.values())
        if not cuda and not any(self._has_kernel(op, "CPU") for op in OPS.values()):
            return "no CUDA device (the symm_mem fused kernels are CUDA only)"
        return None

    @staticmethod
    def _has_kernel(op_name: str, dispatch_key: str) -> bool:
        try:
            return torch._C._dispatch_has_kernel_for_dispatch_key(f"symm_mem::{op_name}", dispatch_key)
        except RuntimeError:  # a torch whose symm_mem registers no such op
            return False

    @staticmethod
    def _schema_reason(op_name: str) -> str | None:
        """Why this torch's op does not take the arguments :meth:`run` passes (torch 2.5 lacks ``return_A``)."""
        try:
            names = {argument.name for argument in getattr(torch.ops.symm_mem, op_name).default._schema.arguments}
        except Exception as error:  # noqa: BLE001 - no such op or overload: step aside, never fail
            return f"symm_mem::{op_name} unreadable on torch {torch.__version__}: {type(error).__name__}: {error}"
        missing = [name for name in ARGUMENTS[op_name] if name not in names]
        return f"symm_mem::{op_name} of torch {torch.__version__} has no {', '.join(missing)} argument" if missing else None

    def unsupported(self, op: str, x: torch.Tensor, weight: torch.Tensor, group) -> str | None:
        reason = self.unavailable()
        if reason:
            return reason
        if op not in OPS:
            return f"CUDA symmetric memory has no fused {op} (there is no matmul + all-reduce kernel)"
        key = DISPATCH_KEYS.get(x.device.type)
        if key is None or not self._has_kernel(OPS[op], key):
            return f"symm_mem::{OPS[op]} has no kernel for {x.device.type} tensors (CUDA only)"
        schema = self._schema_reason(OPS[op])
        if schema:
            return schema
        if weight.dtype != x.dtype:
            return f"dtypes {x.dtype}/{weight.dtype} differ"
        if op == "matmul_reduce_scatter" and x.shape[0] % group.size():
            return f"m={x.shape[0]} rows do not divide by the tensor-parallel size {group.size()}"
        return None

    def run(self, op: str, x: torch.Tensor, weight: torch.Tensor, group, trans_weight: bool = True):
        """Same calling convention as the other backends: ``weight [n, k]`` (``trans_weight``) or ``[k, n]``."""
        b = weight.t() if trans_weight else weight
        if op == "all_gather_matmul":
            gathered, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(x, [b], 0, group.group_name, return_A=True)
            return [out, gathered]
        return [torch.ops.symm_mem.fused_matmul_reduce_scatter(x, b, "sum", 0, group.group_name)]
