"""torch_npu MC2 fused ops (Ascend): npu_mm_all_reduce_base, npu_mm_reduce_scatter_base,
npu_all_gather_base_mm.

Contract (docs/dev/fused-backends.md §2): ``x1 [m, k]``, ``x2 [k, n]`` (our ``weight.t()``; a
transposed view is accepted), fp16/bf16 for both; k in [256, 65535); world size 2, 4 or 8; the
communicator is the group's HCCL name, ``group._get_backend(npu).get_hccl_comm_name(global
rank)``; everything after ``hcom`` (all-reduce) or ``world_size`` is keyword-only. We pass no
bias (mm_all_reduce would add it inside the reduction, i.e. R times; the other two take none):
the caller adds it afterwards, as Megatron does. ``npu_all_gather_base_mm`` returns
``(output, gathered)`` with ``gather_output=True``.

Not verified on Ascend hardware: tested against a fake ``torch_npu`` that checks this contract.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coc_inject.linears.fused.npu_library import NpuLibraryBackend

DTYPES = (torch.float16, torch.bfloat16)
K_RANGE = (256, 65535)
WORLD_SIZES = (2, 4, 8)
OPS = ("matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul")


class Mc2Backend(NpuLibraryBackend):
    name = "mc2"
    module = "torch_npu"
    required_attribute = "npu_mm_all_reduce_base"

    def unsupported(self, op: str, x: torch.Tensor, weight: torch.Tensor, group) -> str | None:
        reason = self.unavailable()
        if reason:
            return reason
        w8a16 = op == "matmul_all_reduce_w8a16"
        if op not in OPS and not w8a16:
            return f"MC2 has no {op}"
        size, k = group.size(), x.shape[-1]
        if size not in WORLD_SIZES:
            return f"tensor-parallel size {size}: MC2 supports {', '.join(map(str, WORLD_SIZES))}"
        expected_weight = torch.int8 if w8a16 else x.dtype
        if x.dtype not in DTYPES or weight.dtype != expected_weight:
            return (f"dtypes {x.dtype}/{weight.dtype}: MC2 takes fp16 or bf16 activations with a weight of "
                    f"the same dtype, or int8 for w8a16")
        if not K_RANGE[0] <= k < K_RANGE[1]:
            return f"k={k} is outside MC2's range [{K_RANGE[0]}, {K_RANGE[1]})"
        return self.placement_unsupported(op, x, size, "MC2")

    def _hcom(self, group) -> str:
        backend = group._get_backend(torch.device(self.device_type))
        return backend.get_hccl_comm_name(dist.get_global_rank(group, group.rank()))

    def run(self, op: str, x: torch.Tensor, weight: torch.Tensor, group, trans_weight: bool = True,
            antiquant: dict | None = None):
        """Same calling convention as the ATB backend: ``weight [n, k]`` (``trans_weight``) or ``[k, n]``.
        ``antiquant`` (w8a16, mm+all-reduce): int8 weight with scale/offset in MC2's shapes
        ([1], [n], or [ceil(k/g), n] with ``group_size`` g)."""
        npu, hcom, size = self._library, self._hcom(group), group.size()
        x2 = weight.t() if trans_weight else weight
        if op == "matmul_all_reduce":
            if antiquant is not None:
                return [npu.npu_mm_all_reduce_base(
                    x, x2, hcom, reduce_op="sum", antiquant_scale=antiquant["scale"],
                    antiquant_offset=antiquant["offset"], antiquant_group_size=antiquant["group_size"])]
            return [npu.npu_mm_all_reduce_base(x, x2, hcom, reduce_op="sum")]
        if op == "matmul_reduce_scatter":
            return [npu.npu_mm_reduce_scatter_base(x, x2, hcom, size, reduce_op="sum")]
        output, gathered = npu.npu_all_gather_base_mm(x, x2, hcom, size, gather_index=0, gather_output=True)
        return [output, gathered]
