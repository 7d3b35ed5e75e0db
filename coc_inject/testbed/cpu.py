"""Megatron's GPU-only pieces made to run on CPU ranks (gloo): for the bench, self-test, tune and
tests, never applied in a user's job.

* :class:`CpuLayerNorm`: the local spec's norm is apex's FusedLayerNorm (a CUDA kernel); without apex
  Megatron falls back to a torch LayerNorm that refuses ``sequence_parallel`` because it does not flag
  its parameters for the gradient all-reduce. This one flags them as FusedLayerNorm does.
* :func:`cpu_streams`: torch.cuda's streams inert (Megatron's DDP orders its communication against
  them, the alltoall dispatcher copies its split counts to the host on a side stream: on the CPU
  there is nothing to order or wait for).
* :func:`gloo_split_lists`: ``all_to_all_single``'s split sizes, which the alltoall dispatcher hands
  over as tensors (the host copy it makes on CUDA is skipped on the CPU), given to gloo as lists.
* :func:`cpu_moe_shims`: both, for good, as Megatron's MoE code needs them.
* :func:`cpu_recompute_rng`: Megatron's recompute saves and restores the "cuda" RNG state: on the
  CPU, torch's (for good, in the rank).
"""

import contextlib

import torch
import torch.distributed as dist


class CpuLayerNorm(torch.nn.LayerNorm):
    def __init__(self, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                 normalization="LayerNorm"):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in (self.weight, self.bias):
            param.sequence_parallel = config.sequence_parallel


class _Event:
    def synchronize(self):
        pass


class _Stream:
    """Every stream call does nothing; ``record_event()`` gives an event whose ``synchronize()`` returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _Event()

    def __getattr__(self, name):  # wait_stream, wait_event, synchronize
        return lambda *args, **kwargs: None


_STREAM_NAMES = ("Stream", "stream", "current_stream")


def replace_streams() -> dict:
    """torch.cuda's streams made inert; returns what stood there (cpu_streams puts it back)."""
    saved = {name: getattr(torch.cuda, name) for name in _STREAM_NAMES}
    torch.cuda.Stream, torch.cuda.stream = _Stream, lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *args, **kwargs: _Stream()
    return saved


@contextlib.contextmanager
def cpu_streams():
    """Inside, torch.cuda's streams are inert; as they were on the way out."""
    saved = replace_streams()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


def gloo_split_lists() -> None:
    """``dist.all_to_all_single`` takes its split sizes as tensors too (once per process)."""
    if getattr(dist.all_to_all_single, "_splits_as_lists", False):
        return
    original = dist.all_to_all_single

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        as_list = lambda sizes: sizes.tolist() if hasattr(sizes, "tolist") else sizes  # noqa: E731
        return original(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args, **kwargs)

    all_to_all_single._splits_as_lists = True
    dist.all_to_all_single = all_to_all_single


def cpu_moe_shims() -> None:
    """Megatron's alltoall dispatcher on CPU ranks, for the rest of the process (and 0.13 to 0.16's
    router, which names Transformer Engine's GEMM, defined only where TE imports)."""
    from megatron.core.transformer.moe import moe_utils

    replace_streams()
    gloo_split_lists()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def cpu_recompute_rng() -> None:
    """Megatron's recompute keeps the "cuda" RNG state for its recomputed forward: on CPU ranks, torch's."""
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
