"""FAKE ``torch_npu`` exposing the three MC2 ops and npu_fusion_attention(_grad), for CPU tests. NOT the real library.

Checks the call contract of docs/dev/fused-backends.md §2 / §5.2 — keyword-only arguments, the
HCCL communicator name of the tensor-parallel group obtained with the caller's *global* rank,
world size 2/4/8, 2-D ``x1 [m, k]`` and ``x2 [k, n]``, fp16/bf16, k in [256, 65535) — and
computes the true result in fp32 with gloo collectives on that group. To name communicators,
it gives gloo process groups a ``get_hccl_comm_name`` like the real HCCL backend's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

COC_FAKE_DEVICE_TYPE = "cpu"
CALLS: list = []  # (op name, x1 shape, x2 shape, world_size, x2 dtype)


def _groups():
    from torch.distributed import distributed_c10d as c10d

    # Skip the NON_GROUP_MEMBER sentinel (an int) kept for groups this rank is not in.
    return [(group, ranks) for group, ranks in c10d._world.pg_group_ranks.items()
            if isinstance(group, dist.ProcessGroup)]


def _comm_name(ranks) -> str:
    return "hccl_" + "_".join(map(str, sorted(ranks)))


def _get_hccl_comm_name(backend, rankid, init_comm=True):
    for group, ranks in _groups():
        if group._get_backend(torch.device("cpu")) is backend:
            if rankid not in ranks:
                raise RuntimeError(f"get_hccl_comm_name({rankid}): not a global rank of this group "
                                   f"(ranks {sorted(ranks)}); pass the global rank")
            if rankid != dist.get_rank():
                raise RuntimeError(f"get_hccl_comm_name({rankid}) on global rank {dist.get_rank()}")
            return _comm_name(ranks)
    raise RuntimeError("unknown process group")


ProcessGroupGloo.get_hccl_comm_name = _get_hccl_comm_name


def _group_of(hcom):
    for group, ranks in _groups():
        if _comm_name(ranks) == hcom and dist.get_rank() in ranks:
            return group
    raise RuntimeError(f"hcom={hcom!r} names no process group of this rank")


def _check(name, x1, x2, hcom, world_size=None, weight_dtype=None):
    group = _group_of(hcom)
    if world_size is not None and world_size != group.size():
        raise RuntimeError(f"{name}: world_size={world_size} but the communicator has {group.size()} ranks")
    if group.size() not in (2, 4, 8):
        raise RuntimeError(f"{name}: world size {group.size()} not in 2, 4, 8")
    if x1.dim() != 2 or x2.dim() != 2 or x2.shape[0] != x1.shape[1]:
        raise RuntimeError(f"{name}: expected x1 [m, k] and x2 [k, n], got {tuple(x1.shape)}, {tuple(x2.shape)}")
    if x1.dtype not in (torch.float16, torch.bfloat16) or x2.dtype != (weight_dtype or x1.dtype):
        raise RuntimeError(f"{name}: fp16/bf16 only (int8 x2 for w8a16), got {x1.dtype}/{x2.dtype}")
    if not 256 <= x1.shape[1] < 65535:
        raise RuntimeError(f"{name}: k={x1.shape[1]} outside [256, 65535)")
    CALLS.append((name, tuple(x1.shape), tuple(x2.shape), group.size(), str(x2.dtype)))
    return group


def npu_mm_all_reduce_base(x1, x2, hcom, *, reduce_op="sum", bias=None, antiquant_scale=None,
                           antiquant_offset=None, x3=None, dequant_scale=None, pertoken_scale=None,
                           comm_quant_scale_1=None, comm_quant_scale_2=None, antiquant_group_size=0,
                           comm_turn=0):
    quantised = antiquant_scale is not None
    group = _check("npu_mm_all_reduce_base", x1, x2, hcom, weight_dtype=torch.int8 if quantised else None)
    if reduce_op != "sum" or bias is not None or x3 is not None or dequant_scale is not None:
        raise RuntimeError("fake: only reduce_op='sum' without bias/x3/dequant is faked")
    weight = x2.float()
    if quantised:  # w8a16: (x2 + offset) * scale, broadcast per tensor [1], channel [n], group [ceil(k/g), n]
        k, n = x2.shape
        def expand(t):
            t = t.float()
            if antiquant_group_size:
                if antiquant_group_size % 32 or tuple(t.shape) != (-(-k // antiquant_group_size), n):
                    raise RuntimeError(f"per-group antiquant: group size {antiquant_group_size} (multiple of 32) "
                                       f"and shape [ceil(k/g), n] required, got {tuple(t.shape)}")
                return t.repeat_interleave(antiquant_group_size, dim=0)[:k]
            if t.numel() == 1 or tuple(t.shape) in ((n,), (1, n)):
                return t.reshape(1, -1)
            raise RuntimeError(f"antiquant shape {tuple(t.shape)}: expected [1], [n], [1, n] or [ceil(k/g), n]")
        if antiquant_offset is not None:
            weight = weight + expand(antiquant_offset)
        weight = weight * expand(antiquant_scale)
    y = x1.float() @ weight
    dist.all_reduce(y, group=group)
    return y.to(x1.dtype)


def npu_mm_reduce_scatter_base(input, x2, hcom, world_size, *, reduce_op="sum", bias=None, comm_turn=0):
    group = _check("npu_mm_reduce_scatter_base", input, x2, hcom, world_size)
    if reduce_op != "sum" or bias is not None:
        raise RuntimeError("npu_mm_reduce_scatter_base: bias is not supported")
    if input.shape[0] % world_size:
        raise RuntimeError(f"m={input.shape[0]} must divide by world_size={world_size}")
    y = input.float() @ x2.float()
    out = torch.empty(y.shape[0] // world_size, y.shape[1])
    dist.reduce_scatter_tensor(out, y, group=group)
    return out.to(input.dtype)


def npu_all_gather_base_mm(input, x2, hcom, world_size, *, bias=None, gather_index=0, gather_output=True,
                           comm_turn=0):
    group = _check("npu_all_gather_base_mm", input, x2, hcom, world_size)
    if bias is not None or gather_index != 0:
        raise RuntimeError("npu_all_gather_base_mm: bias unsupported; gather_index 0 (x1) faked only")
    gathered = torch.empty(input.shape[0] * world_size, input.shape[1])
    dist.all_gather_into_tensor(gathered, input.float().contiguous(), group=group)
    out = (gathered @ x2.float()).to(input.dtype)
    return out, (gathered.to(input.dtype) if gather_output else torch.empty(0, dtype=input.dtype))


# -- npu_fusion_attention / npu_fusion_attention_grad (the FAKE's attention ops) ------------------
# Contract (torch_npu's op schema; MindSpeed's ring_context_parallel): BNSD layout, head_num = the
# query heads, fewer K/V heads allowed (GQA), fp16/bf16; a causal block passes the 2048 x 2048
# upper-triangle bool mask (True = masked) with sparse_mode 3, a full block no mask with sparse_mode
# 0; softmax_max / softmax_sum are fp32 [B, N, Sq, 8]; the grad's arguments after input_layout are
# keyword-only. Computes the true result (tests/fakes/attention_math.py).
ATTENTION_CALLS: list = []


def _attention_contract(query, key, value, head_num, input_layout, atten_mask, sparse_mode):
    assert input_layout == "BNSD" and head_num == query.shape[1], (input_layout, head_num, query.shape)
    assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == value.dtype == query.dtype
    assert query.shape[1] % key.shape[1] == 0 and key.shape == value.shape
    if sparse_mode == 3:
        assert atten_mask is not None and atten_mask.dtype == torch.bool and tuple(atten_mask.shape) == (2048, 2048)
        assert torch.equal(atten_mask[:64, :64], torch.ones(64, 64, dtype=torch.bool).triu(1))
        assert query.shape[2] == key.shape[2], "a causal block is square"
        return True
    assert sparse_mode == 0 and atten_mask is None, (sparse_mode, atten_mask)
    return False


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False):
    import attention_math

    causal = _attention_contract(query, key, value, head_num, input_layout, atten_mask, sparse_mode)
    assert keep_prob == 1.0 and pse is None and padding_mask is None
    ATTENTION_CALLS.append(("npu_fusion_attention", tuple(query.shape), tuple(key.shape), causal))
    scores = attention_math.scores(query, key, scale, causal)
    row_max = scores.amax(dim=-1, keepdim=True)
    row_sum = (scores - row_max).exp().sum(dim=-1, keepdim=True)
    out, _ = attention_math.forward(query, key, value, scale, causal)
    widen = lambda t: t.float().expand(*t.shape[:-1], 8).contiguous()  # noqa: E731
    return out.to(query.dtype), widen(row_max), widen(row_sum), torch.empty(0), 0, 0, 0


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False):
    import attention_math

    causal = _attention_contract(query, key, value, head_num, input_layout, atten_mask, sparse_mode)
    stats = (*query.shape[:3], 8)
    for stat in (softmax_max, softmax_sum):
        assert stat is not None and stat.dtype == torch.float32 and tuple(stat.shape) == stats, stat
    assert attention_in is not None and attention_in.shape == query.shape and attention_in.dtype == query.dtype
    assert dy.shape == query.shape and keep_prob == 1.0
    ATTENTION_CALLS.append(("npu_fusion_attention_grad", tuple(query.shape), tuple(key.shape), causal))
    lse = softmax_max[..., 0].double() + softmax_sum[..., 0].double().log()
    grads = attention_math.backward(dy, query, key, value, attention_in, lse, scale_value, causal)
    return (*(g.to(query.dtype) for g in grads), None)
