"""CPU shims for Megatron-LM's own ``pretrain_gpt.py`` (core_v0.19) on CPU ranks with gloo.

Megatron's training loop assumes CUDA; each shim below is what its code needs to run on the CPU,
with a comment saying which code needs it. They are this benchmark's, never applied by coc-inject
(which runs unchanged, from its bootstrap on PYTHONPATH); the streams and split sizes are the test
bed's (coc_inject.testbed.cpu), the copy the bench, self-test and tests use. Both runs -- coc-inject
off and on -- get the same shims. ``apply()`` before Megatron's training code runs (run_pretrain.py).
"""

import atexit
import importlib
import importlib.metadata
import importlib.util
import os
import pathlib
import sys
import sysconfig
import types
import typing

import torch
import torch._dynamo

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the checkout's coc_inject (hooks nothing)
from coc_inject.testbed.cpu import gloo_split_lists, replace_streams  # noqa: E402  (the one copy of these shims)

del sys.path[0]  # the checkout's other folders (tests/, ...) must not shadow Megatron-LM's

CPU = torch.device("cpu")


def apply() -> None:
    _python()
    _apex_stand_in()
    _devices()
    _streams()
    _rng()
    _collectives()
    _dataset_helpers()
    _sequence_parallel_norm()


def _python() -> None:
    # megatron/training/models/hybrid.py imports typing.override (Python >= 3.12); this may be 3.11.
    if not hasattr(typing, "override"):
        typing.override = lambda function: function


def _devices() -> None:
    # initialize_megatron asserts torch.cuda.is_available(), and sets up model parallelism and the
    # RNG tracker only if device_count() > 0: one "device" per process, and that device is the CPU,
    # so what Megatron allocates on torch.cuda.current_device() lands in host memory.
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: CPU
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda *args, **kwargs: None  # the timers, barriers around steps
    # With TP or CP > 1 the argument checks ask for the device's architecture (CUDA_DEVICE_MAX_CONNECTIONS
    # matters before Blackwell): a Hopper-like answer, the case most users have.
    torch.cuda.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(
        major=9, minor=0, name="CPU stand-in", total_memory=0, multi_processor_count=1)
    # With a "CUDA device" claimed, the router's torch.compile'd helpers ask Triton for its
    # properties: run them eagerly.
    torch._dynamo.config.disable = True
    _CudaOnCpu().__enter__()  # for the rest of the process (this thread; autograd carries it along)


def _apex_stand_in() -> None:
    # Gradient accumulation fusion (Megatron's default on every GPU job with apex or Transformer
    # Engine) needs apex's fused_weight_gradient_mlp_cuda: the tests' CPU stand-in, which adds
    # grad_output^T @ input into main_grad as the kernel does, is found under that name.
    path = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fakes" / "fused_wgrad.py"
    spec = importlib.util.spec_from_file_location("coc_tests_fused_wgrad", path)
    fused_wgrad = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fused_wgrad)
    sys.modules[fused_wgrad.NAME] = fused_wgrad.module()
    if os.environ.get("RANK", "0") == "0":
        atexit.register(lambda: print(f"[cpu shims] apex stand-in: {len(fused_wgrad.calls)} fused weight-gradient "
                                      "accumulations on rank 0", flush=True))


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # device=0: CUDA device 0


class _CudaOnCpu(torch.overrides.TorchFunctionMode):
    """Tensors that Megatron makes on "cuda" (``torch.tensor(..., device='cuda')`` in training.py and
    the optimizer's helpers, ``.cuda()``, ``.to("cuda")``: dozens of places) are made on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # The distributed optimizer and clip_grads check parameters' type names ("torch.cuda.BFloat16Tensor").
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = CPU
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device, int)) \
                and _is_cuda(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


def _streams() -> None:
    # The alltoall dispatcher copies its split counts to the host on a side stream (wait_stream,
    # record_event().synchronize()): on the CPU there is nothing to wait for.
    replace_streams()


def _rng() -> None:
    # Megatron's RNG tracker (tensor_parallel/random.py) saves, seeds and forks "the CUDA RNG", also
    # through torch.cuda.default_generators; on the CPU that is torch's default generator
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: a no-op here).
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = lambda seed: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    megatron_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _collectives() -> None:
    # The alltoall dispatcher hands its split sizes to all_to_all_single as tensors (the host copy
    # it makes on CUDA is skipped on the CPU); gloo takes lists.
    gloo_split_lists()


def _dataset_helpers() -> None:
    # initialize.py compiles the dataset index helpers with `make` in the checkout, with whatever
    # `python3` / `python3-config` PATH has (not this interpreter) and pybind11 (maybe missing).
    # The installed megatron-core wheel ships them built for this interpreter: every rank loads that
    # copy (the same helpers.cpp) unless the checkout has its own built, and the compile is skipped.
    from megatron.core.datasets import utils

    utils.compile_helpers = lambda: None
    name = "megatron.core.datasets.helpers_cpp"
    try:
        importlib.import_module(name)
        return
    except ImportError:
        pass
    built = "megatron/core/datasets/helpers_cpp" + sysconfig.get_config_var("EXT_SUFFIX")
    spec = importlib.util.spec_from_file_location(
        name, importlib.metadata.distribution("megatron-core").locate_file(built))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module


def _sequence_parallel_norm() -> None:
    # Without apex the local spec's norm is Megatron's WrappedTorchNorm, which refuses sequence
    # parallelism only because it does not flag its parameters for the gradient all-reduce over TP
    # (apex's FusedLayerNorm does): build it without the flag in the config, then flag its parameters.
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        sequence_parallel, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = original(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new
