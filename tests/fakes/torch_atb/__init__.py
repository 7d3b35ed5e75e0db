"""FAKE ``torch_atb`` (Ascend ATB Python binding) for CPU tests. NOT the real library.

It checks the call contract of ``LinearParallelParam`` / ``Operation`` for the "lcoc" fused
kernels as documented in docs/dev/fused-backends.md §1 and §5.1 — every check below mirrors a
constraint of the real binding — and computes the true result with torch.distributed (gloo)
collectives on the tensor-parallel group that ``rank`` / ``rank_size`` / ``comm_domain`` name.
What it cannot tell: the real kernel's performance, its numerics beyond fp32-accumulate-and-round,
and anything the real LCAL communicator does. Tests put tests/fakes on sys.path to use it.
"""

from __future__ import annotations

import enum
import os

import torch
import torch.distributed as dist

COC_FAKE_DEVICE_TYPE = "cpu"  # the device type this fake emulates (the real one: "npu")
CALLS: list = []  # (type name, trans_weight, keep_intermediate, input shapes) per forward
CREATED: list = []  # LCCL_DETERMINISTIC as seen when each Operation was created
# A wrong kernel on purpose (the self-test must catch it): the ParallelType name whose output is off by 5%.
WRONG = os.environ.get("FAKE_ATB_WRONG")


class CommMode(enum.IntEnum):
    COMM_UNDEFINED = -1
    COMM_MULTI_PROCESS = 0
    COMM_MULTI_THREAD = 1


class LinearParallelParam:
    class ParallelType(enum.IntEnum):
        UNDEFINED = -1
        LINEAR_ALL_REDUCE = 0
        LINEAR_REDUCE_SCATTER = 1
        ALL_GATHER_LINEAR = 2
        PURE_LINEAR = 3
        ALL_GATHER_LINEAR_REDUCE_SCATTER = 4

    class QuantType(enum.IntEnum):
        QUANT_TYPE_UNDEFINED = -1
        QUANT_TYPE_PER_TENSOR = 0
        QUANT_TYPE_PER_CHANNEL = 1
        QUANT_TYPE_PER_GROUP = 2

    def __init__(self):
        object.__setattr__(self, "assigned", set())
        defaults = dict(trans_weight=True, rank=0, rank_size=0, rank_root=0, has_residual=False,
                        backend="hccl", comm_mode=CommMode.COMM_MULTI_PROCESS, rank_table_file="",
                        type=self.ParallelType.LINEAR_ALL_REDUCE, keep_intermediate=False,
                        quant_type=self.QuantType.QUANT_TYPE_UNDEFINED, quant_group_size=0,
                        comm_domain="")
        for name, value in defaults.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        if not hasattr(self, name):
            raise AttributeError(f"LinearParallelParam has no field {name!r}")
        self.assigned.add(name)
        object.__setattr__(self, name, value)


def _fail(why):
    raise RuntimeError(f"Failed to create operation (fake torch_atb): {why}")


def _tp_group(rank_size, comm_domain):
    """The process group of the ranks this rank_size/comm_domain names (caller: min(ranks)//size)."""
    from torch.distributed import distributed_c10d as c10d

    me = dist.get_rank()
    for group, ranks in c10d._world.pg_group_ranks.items():
        if not isinstance(group, dist.ProcessGroup):  # the NON_GROUP_MEMBER sentinel
            continue
        members = sorted(ranks)
        if len(members) == rank_size and me in ranks and str(members[0] // rank_size) == comm_domain:
            return group
    _fail(f"no tensor-parallel group of {rank_size} ranks with comm_domain {comm_domain!r} holds rank {me}")


class Operation:
    def __init__(self, param: LinearParallelParam):
        types = LinearParallelParam.ParallelType
        if param.backend != "lcoc":
            _fail(f"backend={param.backend!r}: only 'lcoc' is the fused kernel")
        if "trans_weight" not in param.assigned:
            _fail("trans_weight must be set explicitly (inferring it from shapes fails when k == n)")
        size = param.rank_size
        if size <= 0 or size & (size - 1):
            _fail(f"rank_size={size} is not a power of 2")
        if not 0 <= param.rank < size or not 0 <= param.rank_root < size:
            _fail(f"rank={param.rank} / rank_root={param.rank_root} outside [0, {size})")
        if param.comm_mode != CommMode.COMM_MULTI_PROCESS:
            _fail("comm_mode must be COMM_MULTI_PROCESS")
        if not (param.comm_domain.isdigit() and 0 <= int(param.comm_domain) <= 65535):
            _fail(f"comm_domain={param.comm_domain!r} is not a decimal string in 0..65535")
        if param.type not in (types.LINEAR_ALL_REDUCE, types.LINEAR_REDUCE_SCATTER, types.ALL_GATHER_LINEAR):
            _fail(f"type={param.type!r} is not faked")
        if param.keep_intermediate and param.type != types.ALL_GATHER_LINEAR:
            _fail("keep_intermediate is only valid with ALL_GATHER_LINEAR")
        if param.quant_type != LinearParallelParam.QuantType.QUANT_TYPE_UNDEFINED or param.has_residual:
            _fail("quantised / residual variants are not faked")
        self.group = _tp_group(size, param.comm_domain)
        if self.group.rank() != param.rank or self.group.size() != size:
            _fail(f"rank={param.rank}/rank_size={size} do not match the group ({self.group.rank()}/{self.group.size()})")
        self.param = param
        CREATED.append(os.environ.get("LCCL_DETERMINISTIC"))

    def forward(self, tensors):
        outputs = self._forward(tensors)
        if WRONG == self.param.type.name:
            outputs[0] = outputs[0] * 1.05
        return outputs

    def _forward(self, tensors):
        param, types = self.param, LinearParallelParam.ParallelType
        if len(tensors) != 2:
            raise RuntimeError(f"expected [x, weight], got {len(tensors)} tensors")
        x, weight = tensors
        if x.dim() != 2 or weight.dim() != 2:
            raise RuntimeError(f"x and weight must be 2-D, got {tuple(x.shape)} and {tuple(weight.shape)}")
        k = weight.shape[1] if param.trans_weight else weight.shape[0]
        if x.shape[1] != k:
            raise RuntimeError(f"x [m, {x.shape[1]}] does not match weight {tuple(weight.shape)} "
                               f"with trans_weight={param.trans_weight}")
        if x.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != x.dtype:
            raise RuntimeError(f"lcoc takes fp16/fp16 or bf16/bf16, got {x.dtype}/{weight.dtype}")
        if x.device.type != COC_FAKE_DEVICE_TYPE or weight.device != x.device:
            raise RuntimeError("tensors must be on the device")
        CALLS.append((param.type.name, param.trans_weight, param.keep_intermediate,
                      tuple(x.shape), tuple(weight.shape)))
        w = (weight.t() if param.trans_weight else weight).float()
        size = self.group.size()
        if param.type == types.LINEAR_ALL_REDUCE:
            y = x.float() @ w
            dist.all_reduce(y, group=self.group)
            return [y.to(x.dtype)]
        if param.type == types.LINEAR_REDUCE_SCATTER:
            if x.shape[0] % size:
                raise RuntimeError(f"m={x.shape[0]} must divide by rank_size={size}")
            y = x.float() @ w
            out = torch.empty(x.shape[0] // size, y.shape[1])
            dist.reduce_scatter_tensor(out, y, group=self.group)
            return [out.to(x.dtype)]
        gathered = torch.empty(x.shape[0] * size, x.shape[1])
        dist.all_gather_into_tensor(gathered, x.float().contiguous(), group=self.group)
        y = (gathered @ w).to(x.dtype)
        return [y, gathered.to(x.dtype)] if param.keep_intermediate else [y]
