"""Worker functions for the Megatron feature guards (tests/linears/test_megatron_guards.py).

Each builds a real megatron-core layer with one feature on, runs it unpatched and with
coc-inject installed, and returns what the test asserts on: the numbers of both runs,
how many calls CoC took, and what coc-inject said.
"""

from __future__ import annotations

import contextlib
import io
import logging

import torch
import torch.distributed as dist

from dist_harness import reinitialize_model_parallel
from layer_cases import build_layer, grad_for, make_input, relative_error


@contextlib.contextmanager
def _coc_installed(**options):
    """coc-inject installed with ``options``; yields the log text list and the engine."""
    from coc_inject import log
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log.configure("debug")
    log.logger.addHandler(handler)
    assert linears.install(CocConfig(**{"parallel_num": 3, **options}))
    said = []
    try:
        yield said, linears.engine()
    finally:
        linears.uninstall()
        log.logger.removeHandler(handler)
        log.configure("info")
        said.append(stream.getvalue())


def _forward_backward(layer, x, prepare=None, read_back=None, **forward_kwargs):
    if prepare is not None:
        prepare(layer)
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(torch.is_grad_enabled())
    output, _ = layer(x, **forward_kwargs)
    result = {"output": output.detach().clone()}
    if torch.is_grad_enabled():
        output.backward(grad_for(output))
        result["input_grad"] = x.grad.clone()
        if read_back is not None:
            result.update(read_back(layer))
    return result


def unpatched_and_coc(layer, x, *, calls_twice=True, prepare=None, read_back=None, coc_options=None,
                      **forward_kwargs):
    """Megatron's own forward, then CoC's (twice: a reason must be said once): both results,
    CoC's call count and log text."""
    from coc_inject.linears import install as linears

    linears.uninstall()
    reference = _forward_backward(layer, x, prepare, read_back, **forward_kwargs)
    with _coc_installed(**(coc_options or {})) as (said, engine):
        coc = _forward_backward(layer, x, prepare, read_back, **forward_kwargs)
        if calls_twice:
            _forward_backward(layer, x, prepare, read_back, **forward_kwargs)
        calls = engine.calls
    return {
        "calls": calls,
        "log": said[0],
        "bitwise_equal": all(torch.equal(coc[name], reference[name]) for name in reference),
        "errors": {name: relative_error(coc[name], reference[name]) for name in reference},
        "keys": sorted(reference),
    }


# -- tensor-parallel weight sharding (GTP, megatron-core >= 0.19) ---------------------------


def weight_sharding(kind, *, sequence_parallel, tp=2, gtp=2):
    """A layer built while Megatron's GTP group has ``gtp`` ranks: layer.weight is a shard."""
    from fakes import te_gtp

    te_gtp.install()
    world = dist.get_world_size()
    reinitialize_model_parallel(tensor_model_parallel_size=tp, gtp_remat_size=gtp)
    try:
        layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=True, skip_bias_add=False,
                            dtype="float32", hidden=32, ffn=64)
        x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=16, batch=2, dtype="float32")

        def prepare(layer):  # Megatron's DDP would own this buffer; GTP reduce-scatters wgrad into it
            layer.weight.main_grad = torch.zeros(layer.weight.shape)

        result = unpatched_and_coc(layer, x, prepare=prepare,
                                   read_back=lambda layer: {"main_grad": layer.weight.main_grad.clone()})
        result["gtp_remat_size"] = layer.gtp_remat_size
        result["weight_shape"] = tuple(layer.weight.shape)
        return result
    finally:
        reinitialize_model_parallel(tensor_model_parallel_size=world)


# -- a weight of another shape than the layer's ----------------------------------------------


def resized_weight(kind, *, sequence_parallel):
    """layer.weight swapped for one with twice the output rows (Megatron multiplies by it as is)."""
    layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=False, skip_bias_add=False,
                        dtype="float32", hidden=32, ffn=64)
    rows, columns = layer.weight.shape
    generator = torch.Generator().manual_seed(17 + dist.get_rank())
    layer.weight = torch.nn.Parameter(torch.randn(2 * rows, columns, generator=generator))
    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=16, batch=2, dtype="float32")
    return unpatched_and_coc(layer, x, coc_options={"enable_coc_in_column_backward": True},
                             read_back=lambda layer: {"weight_grad": layer.weight.grad.clone()})


# -- output_dtype (ColumnParallelLinear, Megatron main / 0.20) --------------------------------


def output_dtype(*, dtype, sequence_parallel=True):
    """bf16 layer and input with ``layer.output_dtype`` set, as Megatron main's GPT output layer
    sets it for fp32 logits. (No released megatron-core reads it yet: the attribute is set by
    hand on the real layer.)"""
    layer = build_layer("column", sequence_parallel=sequence_parallel, bias=False, skip_bias_add=False,
                        dtype="bfloat16", hidden=32, ffn=64)
    layer.output_dtype = getattr(torch, dtype)
    x = make_input("column", layer, sequence_parallel=sequence_parallel, seq=16, batch=2, dtype="bfloat16")
    return unpatched_and_coc(layer, x)


# -- inference-optimized output all-gather (megatron-core >= 0.18) ---------------------------


def inference_gather(*, training):
    """ColumnParallelLinear(gather_output=True) built under transformer_impl="inference_optimized"."""
    import megatron.core.tensor_parallel.inference_layers as inference_layers

    layer = build_layer("column", sequence_parallel=False, bias=True, skip_bias_add=False, dtype="float32",
                        hidden=32, ffn=64, gather_output=True, transformer_impl="inference_optimized")
    layer.train(training)
    x = make_input("column", layer, sequence_parallel=False, seq=16, batch=2, dtype="float32")
    original = inference_layers.inference_all_gather_from_tensor_model_parallel_region
    used = []

    def counting(*args, **kwargs):
        used.append(1)
        return original(*args, **kwargs)

    inference_layers.inference_all_gather_from_tensor_model_parallel_region = counting
    try:
        with torch.set_grad_enabled(training):
            result = unpatched_and_coc(layer, x, calls_twice=False,
                                       coc_options={"enable_coc_in_column_backward": True})
    finally:
        inference_layers.inference_all_gather_from_tensor_model_parallel_region = original
    result["inference_gathers"] = len(used)  # in the unpatched and the CoC run together
    result["has_feature"] = layer.use_inference_optimized_all_gather
    return result


# -- Megatron-FSDP parameters (megatron-core >= 0.14) ------------------------------------------


def fsdp_main_grad(kind, *, sequence_parallel):
    """gradient_accumulation_fusion with a parameter marked ``__fsdp_param__``: Megatron writes
    the wgrad into the buffer ``get_main_grad()`` hands out (no ``main_grad`` beforehand)."""
    layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=True, skip_bias_add=False,
                        dtype="float32", hidden=32, ffn=64)
    layer.gradient_accumulation_fusion = True  # set after init: Megatron's init demands apex
    weight = layer.weight
    weight.__fsdp_param__ = True
    weight.grad_added_to_main_grad = False
    buffers = []

    def get_main_grad():
        # A stale value must be overwritten, as Megatron's matmul(out=) does.
        buffers.append(torch.full(weight.shape, 7.0))
        return buffers[-1]

    weight.get_main_grad = get_main_grad

    def prepare(layer):
        if hasattr(weight, "main_grad"):
            del weight.main_grad

    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=16, batch=2, dtype="float32")
    result = unpatched_and_coc(layer, x, calls_twice=False, prepare=prepare,
                               read_back=lambda layer: {"main_grad": buffers[-1].clone()})
    result["buffers_handed_out"] = len(buffers)
    result["grad_added_to_main_grad"] = weight.grad_added_to_main_grad
    return result
