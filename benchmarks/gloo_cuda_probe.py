"""Which collectives gloo runs on CUDA tensors, with ranks sharing one GPU (NCCL refuses that).

    torchrun --nproc-per-node 2 benchmarks/gloo_cuda_probe.py

(bf16 values: the sums are exact at 2 ranks; at more, a sum past 256 may round and read as WRONG.)

Each collective the wings issue, on bf16 CUDA tensors, waited and checked against its true result;
rank 0 prints one line per collective: ok, wrong, or the error. The selftest's ``cuda-gloo`` mode
(``COC_SELFTEST_DEVICE=cuda-gloo``) can run only what passes here.
"""
import os

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
else:  # the dry run on a CPU machine
    device = torch.device("cpu")
dist.init_process_group("gloo")
dtype = torch.bfloat16


def mine(n):
    return torch.arange(n, device=device, dtype=dtype) + 100 * rank


def all_reduce():
    t = mine(8)
    dist.all_reduce(t, async_op=True).wait()
    return t, sum(torch.arange(8, device=device, dtype=dtype) + 100 * r for r in range(world))


def all_gather_into_tensor():
    out = torch.empty(8 * world, device=device, dtype=dtype)
    dist.all_gather_into_tensor(out, mine(8), async_op=True).wait()
    return out, torch.cat([torch.arange(8, device=device, dtype=dtype) + 100 * r for r in range(world)])


def reduce_scatter_tensor():
    out = torch.empty(4, device=device, dtype=dtype)
    dist.reduce_scatter_tensor(out, mine(4 * world), async_op=True).wait()
    full = sum(torch.arange(4 * world, device=device, dtype=dtype) + 100 * r for r in range(world))
    return out, full[4 * rank:4 * rank + 4]


def all_to_all_single():
    out = torch.empty(4 * world, device=device, dtype=dtype)
    dist.all_to_all_single(out, mine(4 * world), async_op=True).wait()
    return out, torch.cat([(torch.arange(4 * world, device=device, dtype=dtype) + 100 * r)[4 * rank:4 * rank + 4]
                           for r in range(world)])


def all_to_all_single_uneven():
    splits = [1 + r for r in range(world)]  # rank r receives r + 1 rows from every rank
    send = torch.cat([torch.full((1 + r,), float(rank * 10 + r), device=device, dtype=dtype) for r in range(world)])
    out = torch.empty(world * (1 + rank), device=device, dtype=dtype)
    dist.all_to_all_single(out, send, output_split_sizes=[1 + rank] * world, input_split_sizes=splits, async_op=True).wait()
    return out, torch.cat([torch.full((1 + rank,), float(r * 10 + rank), device=device, dtype=dtype)
                           for r in range(world)])


def all_gather_list():
    outs = [torch.empty(8, device=device, dtype=dtype) for _ in range(world)]
    dist.all_gather(outs, mine(8), async_op=True).wait()
    return torch.cat(outs), torch.cat([torch.arange(8, device=device, dtype=dtype) + 100 * r for r in range(world)])


def broadcast():
    t = mine(8)
    dist.broadcast(t, 0, async_op=True).wait()
    return t, torch.arange(8, device=device, dtype=dtype)


def send_recv_ring():
    send, recv = mine(8), torch.empty(8, device=device, dtype=dtype)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return recv, torch.arange(8, device=device, dtype=dtype) + 100 * ((rank - 1) % world)


for probe in (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single,
              all_to_all_single_uneven, all_gather_list, broadcast, send_recv_ring):
    try:
        got, want = probe()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        verdict = "ok" if torch.equal(got, want) else f"WRONG {got.tolist()} != {want.tolist()}"
    except Exception as error:  # noqa: BLE001 -- the probe reports every failure, whatever it is
        verdict = f"ERROR {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gloo on {device} ({name}), rank {rank}: {probe.__name__}: {verdict}", flush=True)  # before a crash
    dist.barrier()
dist.destroy_process_group()
