"""Ascend ATB "lcoc" LinearParallel through the ``torch_atb`` binding (CANN-NNAL).

Contract (docs/dev/fused-backends.md §1): ``LinearParallelParam`` with ``backend="lcoc"``, every
field set explicitly (``trans_weight`` too: MindSpeed's shape-based guess is wrong when k == n);
``Operation(param).forward([x, weight])`` with 2-D ``x [m, k]`` and ``weight [n, k]`` when
``trans_weight`` else ``[k, n]``; fp16/bf16 only; ``rank_size`` a power of two; the
communicator is named by a numeric ``comm_domain`` (ATB builds its own, keyed by rank and
domain), one per tensor-parallel group: we use the group's lowest global rank // group size,
as MindSpeed uses device // TP. Outputs are fresh tensors: LINEAR_ALL_REDUCE ``[m, n]``,
LINEAR_REDUCE_SCATTER ``[m/R, n]``, ALL_GATHER_LINEAR ``[m*R, n]`` (+ the gathered ``[m*R, k]``
with ``keep_intermediate``).

Not verified on Ascend hardware: tested against a fake ``torch_atb`` that checks this contract.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coc_inject.linears.fused.npu_library import NpuLibraryBackend

TYPES = {
    "matmul_all_reduce": "LINEAR_ALL_REDUCE",
    "matmul_reduce_scatter": "LINEAR_REDUCE_SCATTER",
    "all_gather_matmul": "ALL_GATHER_LINEAR",
}
DTYPES = (torch.float16, torch.bfloat16)


class AtbBackend(NpuLibraryBackend):
    name = "atb"
    module = "torch_atb"
    install_hint = " (CANN-NNAL ATB)"

    def __init__(self):
        super().__init__()
        self._operations = {}

    def unsupported(self, op: str, x: torch.Tensor, weight: torch.Tensor, group) -> str | None:
        """Why this call is outside the kernel's limits, or None. ``x`` is 2-D ``[m, k]``."""
        reason = self.unavailable()
        if reason:
            return reason
        size = group.size()
        if op == "matmul_all_reduce_w8a16":
            return "w8a16 through ATB lcoc is not wired (its dequant formula is unconfirmed)"
        if op not in TYPES:
            return f"ATB lcoc has no {op}"
        if size & (size - 1):
            return f"tensor-parallel size {size} is not a power of 2 (ATB lcoc needs one)"
        if x.dtype not in DTYPES or weight.dtype != x.dtype:
            return f"dtypes {x.dtype}/{weight.dtype}: ATB lcoc takes fp16 or bf16 for both operands"
        return self.placement_unsupported(op, x, size, "ATB lcoc")

    def _operation(self, op: str, group, trans_weight: bool):
        ranks = dist.get_process_group_ranks(group)
        domain = str(min(ranks) // len(ranks))
        key = (op, group.rank(), group.size(), domain, trans_weight)
        if key not in self._operations:
            atb = self._library
            param = atb.LinearParallelParam()
            param.trans_weight = trans_weight
            param.rank = group.rank()
            param.rank_size = group.size()
            param.rank_root = 0
            param.has_residual = False
            param.backend = "lcoc"
            param.type = getattr(atb.LinearParallelParam.ParallelType, TYPES[op])
            param.keep_intermediate = op == "all_gather_matmul"
            param.comm_domain = domain
            self._operations[key] = atb.Operation(param)
        return self._operations[key]

    def run(self, op: str, x: torch.Tensor, weight: torch.Tensor, group, trans_weight: bool = True):
        """``x [m, k]`` with ``weight [n, k]`` (``trans_weight``) or ``[k, n]``; returns the outputs list."""
        return self._operation(op, group, trans_weight).forward([x, weight])
