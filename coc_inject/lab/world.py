"""Start and stop the emulated group: this process is rank 0 of ``world`` ranks over the lab backend,
Megatron's parallel state made over it (TP, CP, EP as asked; expert TP 1), torch's RNG and Megatron's
seeded; on the CPU Megatron's CUDA-only pieces shimmed (testbed.cpu). Everything is undone on leaving."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from coc_inject.lab import backend
from coc_inject.lab.store import MirrorStore
from coc_inject.lab.streams import CudaStreams, ThreadStreams

RANK = 0


def _cpu_shims() -> None:
    """Megatron's CUDA-only pieces on the CPU (for the lab's process, as the test bed's ranks)."""
    from megatron.core.fusions import fused_softmax

    from coc_inject.testbed.cpu import cpu_moe_shims

    torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron's SP buffers (as testbed/ranks.py)
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    cpu_moe_shims()


@contextlib.contextmanager
def lab_group(link, device: str, world: int):
    """Inside: this process rank 0 of ``world`` over the lab backend (the store answering for the other
    ranks); the state (link, lanes, modelled time) yielded. No Megatron, no shims."""
    from coc_inject.pipeline import agreement

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        make = lambda: CudaStreams(device)  # noqa: E731
    else:
        make = ThreadStreams
    state = backend.LabState(link=link, make_streams=make)
    backend.register()
    backend.set_state(state)
    state.store = MirrorStore(RANK)  # held: c10d keeps only the C++ side, and its Python methods die with the object
    dist.init_process_group(backend.BACKEND, store=state.store, rank=RANK, world_size=world)
    try:
        yield state
    finally:
        dist.destroy_process_group()
        agreement.forget()
        for lane in state.lanes:
            lane.streams.close()
        backend.set_state(None)


@contextlib.contextmanager
def lab_world(link, device: str, tp: int = 1, cp: int = 1, ep: int = 1):
    """Inside: :func:`lab_group` of lcm(TP x CP, EP) ranks and Megatron's parallel state over it; on the
    CPU one compute thread and Megatron's CUDA-only pieces shimmed (for the rest of the process)."""
    import math

    from megatron.core import parallel_state

    on_cpu = not device.startswith("cuda")
    threads = torch.get_num_threads()
    if on_cpu:
        _cpu_shims()
        torch.set_num_threads(1)  # the lab's stream thread beside one compute thread (as the test bed's ranks)
    try:
        with lab_group(link, device, math.lcm(tp * cp, ep)) as state:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                                     expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                                                     create_gloo_process_groups=False)
            try:
                yield state
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def link_as(state, link):
    """Inside, every transfer timed by ``link`` (the compute-only twin: the link at zero time)."""
    saved, state.link = state.link, link
    try:
        yield
    finally:
        state.link = saved
